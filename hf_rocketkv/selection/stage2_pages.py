"""Stage 2 of RocketKV: KT page summaries, page scoring and top-k page selection (reference PyTorch path).

Pure functions over tensors, the oracle for the Triton kernels in ``hf_rocketkv/kernels``.

Shapes (B batch, Hkv KV heads, G query heads per KV head, C slot capacity, P page_size, NP = C // P pages,
D head_dim, r = min(topr, D), K = min(topk, NP)):
    keys:      [B, Hkv, C, D]       slot order (compacted prompt, then generated tokens)
    kt:        [B, Hkv, NP, 2, D]   per page: [0] element-wise min, [1] element-wise max of its keys, in the KT
                                    dtype; pages with no token hold zeros
    lengths:   [B]                  tokens stored per row (the same for every KV head)
    q:         [B, Hkv, G, D]       the decode query, grouped by KV head
"""

from __future__ import annotations

import torch


def num_pages(lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages in use per row: ceil(lengths / page_size)."""
    return (lengths + page_size - 1) // page_size


def build_kt(keys: torch.Tensor, lengths: torch.Tensor, page_size: int, kt_dtype: torch.dtype) -> torch.Tensor:
    """Min/max of the keys of every page over the first ``lengths[b]`` slots; partial last page covers only its tokens.

    Returns ``[B, Hkv, C // P, 2, D]`` in ``kt_dtype`` (C must be a multiple of P).
    """
    batch, num_kv_heads, capacity, head_dim = keys.shape
    slot = torch.arange(capacity, device=keys.device)
    filled = (slot[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, C, 1]
    k = keys.float()
    page_shape = (batch, num_kv_heads, capacity // page_size, page_size, head_dim)
    kmin = k.masked_fill(~filled, float("inf")).view(page_shape).amin(dim=3)
    kmax = k.masked_fill(~filled, float("-inf")).view(page_shape).amax(dim=3)
    kt = torch.stack([kmin, kmax], dim=3)
    return torch.where(torch.isinf(kt), torch.zeros_like(kt), kt).to(kt_dtype)


def update_kt(kt: torch.Tensor, key_new: torch.Tensor, slot: torch.Tensor, page_size: int) -> None:
    """In place: fold the key written at ``slot[b]`` (``key_new`` ``[B, Hkv, D]``) into its page's min/max.

    The first token of a page overwrites it (a fresh page); later tokens take the element-wise min/max.
    Rounding to the KT dtype is monotone, so this equals ``build_kt`` over the same keys exactly.
    """
    rows = torch.arange(kt.shape[0], device=kt.device)
    page = slot // page_size
    fresh = (slot % page_size == 0)[:, None, None]  # [B, 1, 1]
    current = kt[rows, :, page].float()  # [B, Hkv, 2, D]
    k = key_new.float()
    new_min = torch.where(fresh, k, torch.minimum(current[:, :, 0], k))
    new_max = torch.where(fresh, k, torch.maximum(current[:, :, 1], k))
    kt[rows, :, page] = torch.stack([new_min, new_max], dim=2).to(kt.dtype)


def top_channels(q: torch.Tensor, topr: int) -> torch.Tensor | None:
    """Channels used for scoring: top ``topr`` of |q| summed over the group, ``[B, Hkv, r]``; None = all channels."""
    if topr >= q.shape[-1]:
        return None
    return q.abs().sum(dim=2).topk(topr, dim=-1).indices


def page_scores(q: torch.Tensor, kt: torch.Tensor, n_pages: torch.Tensor, topr: int) -> torch.Tensor:
    """Group-mean page probabilities ``[B, Hkv, NP]`` (fp32; pages >= n_pages[b] get 0).

    Per channel c the group-summed query sign picks Kmax (sum > 0) or Kmin; each query head scores
    ``s[g, j] = sum_c q[g, c] * Kp[j, c]``, softmax over the row's pages at temperature 1/sqrt(D), then the mean
    over the G heads of the group. As in TensorRT-LLM, q is rounded to the KT dtype before scoring.
    """
    head_dim = q.shape[-1]
    q = q.to(kt.dtype).float()
    minmax = kt.float()  # [B, Hkv, NP, 2, D]
    channels = top_channels(q, topr)
    if channels is not None:
        q = q.gather(-1, channels[:, :, None, :].expand(-1, -1, q.shape[2], -1))
        idx = channels[:, :, None, None, :].expand(-1, -1, minmax.shape[2], 2, -1)
        minmax = minmax.gather(-1, idx)
    use_max = (q.sum(dim=2) > 0)[:, :, None, :]  # [B, Hkv, 1, r]
    picked = torch.where(use_max, minmax[:, :, :, 1], minmax[:, :, :, 0])  # [B, Hkv, NP, r]
    logits = torch.einsum("bhgr,bhpr->bhgp", q, picked) * head_dim**-0.5
    page = torch.arange(kt.shape[2], device=kt.device)
    in_use = (page[None, :] < n_pages[:, None])[:, None, None, :]
    probs = torch.softmax(logits.masked_fill(~in_use, float("-inf")), dim=-1).nan_to_num_(0.0)
    return probs.mean(dim=2)


def select_pages(
    probs: torch.Tensor, n_pages: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k pages per KV head; the page holding the newest token is always selected.

    Returns ``page_idx`` LongTensor ``[B, Hkv, K]`` and ``page_valid`` bool ``[B, Hkv, K]``
    (K = min(topk, NP); entries past a row's page count are invalid). Order inside the K is unspecified.
    """
    num_slots = probs.shape[-1]
    k = min(topk, num_slots)
    page = torch.arange(num_slots, device=probs.device)
    newest = (n_pages - 1).clamp(min=0)[:, None, None]
    # probabilities are in [0, 1]: 2 forces the newest page in, -1 keeps unused pages last
    ranked = torch.where(page == newest, torch.full_like(probs, 2.0), probs)
    ranked = torch.where(page < n_pages[:, None, None], ranked, torch.full_like(probs, -1.0))
    page_idx = ranked.topk(k, dim=-1).indices
    page_valid = page_idx < n_pages[:, None, None]
    return page_idx, page_valid
