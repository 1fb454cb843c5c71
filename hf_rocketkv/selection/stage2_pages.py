"""Stage 2 of RocketKV: KT page summaries, page scoring and top-k page selection (reference PyTorch path).

Pure functions over tensors, the oracle for the Triton kernels in ``hf_rocketkv/kernels``.

Shapes (B batch, Hkv KV heads, G query heads per KV head, C slot capacity, P page_size, NP = C // P pages,
D head_dim, r = min(topr, D), K = min(topk, NP)):
    keys:      [B, Hkv, C, D]       slot order (compacted prompt, then generated tokens)
    kt:        [B, Hkv, NP, 2, D]   per page: [0] element-wise min, [1] element-wise max of its keys, in the KT
                                    dtype; pages with no token hold zeros
    lengths:   [B] or [B, Hkv]      tokens stored per row (every KV head the same) or per row and KV head
    n_pages:   [B] or [B, Hkv]      pages in use, ``num_pages(lengths, P)``
    q:         [B, Hkv, G, D]       the decode query, grouped by KV head

Every op that takes ``lengths`` / ``n_pages`` / ``slot`` accepts both forms; a [B] tensor means the same count
for every KV head of the row (``per_head`` broadcasts it), so [B] and its [B, Hkv] expansion give identical results.
"""

from __future__ import annotations

import torch

from .rounding import round_like_cast


def num_pages(lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages in use per row (or per row and KV head): ceil(lengths / page_size), same shape as ``lengths``."""
    return (lengths + page_size - 1) // page_size


def per_head(counts: torch.Tensor, batch: int, num_kv_heads: int, name: str = "lengths") -> torch.Tensor:
    """``counts`` ([B] per row or [B, Hkv] per row and KV head) as a [B, Hkv] tensor (a broadcast view for [B])."""
    if counts.dim() == 1 and counts.shape[0] == batch:
        return counts[:, None].expand(batch, num_kv_heads)
    if counts.dim() == 2 and tuple(counts.shape) == (batch, num_kv_heads):
        return counts
    raise ValueError(
        f"{name} must have shape [B]=[{batch}] (per row) or [B, Hkv]=[{batch}, {num_kv_heads}] (per row and KV "
        f"head), got {list(counts.shape)}"
    )


def build_kt(keys: torch.Tensor, lengths: torch.Tensor, page_size: int, kt_dtype: torch.dtype) -> torch.Tensor:
    """Min/max of the keys of every page over the first ``lengths[b]`` slots; partial last page covers only its tokens.

    Returns ``[B, Hkv, C // P, 2, D]`` in ``kt_dtype`` (C must be a multiple of P).
    """
    batch, num_kv_heads, capacity, head_dim = keys.shape
    slot = torch.arange(capacity, device=keys.device)
    filled = (slot < per_head(lengths, batch, num_kv_heads)[..., None])[..., None]  # [B, Hkv, C, 1]
    k = keys.float()
    page_shape = (batch, num_kv_heads, capacity // page_size, page_size, head_dim)
    kmin = k.masked_fill(~filled, float("inf")).view(page_shape).amin(dim=3)
    kmax = k.masked_fill(~filled, float("-inf")).view(page_shape).amax(dim=3)
    kt = torch.stack([kmin, kmax], dim=3)
    return torch.where(torch.isinf(kt), torch.zeros_like(kt), kt).to(kt_dtype)


def update_kt(kt: torch.Tensor, key_new: torch.Tensor, slot: torch.Tensor, page_size: int) -> None:
    """In place: fold the key written at ``slot`` (``key_new`` ``[B, Hkv, D]``) into its page's min/max.

    ``slot`` is [B] (the same slot for every KV head) or [B, Hkv]. The first token of a page overwrites it (a fresh
    page); later tokens take the element-wise min/max. Rounding to the KT dtype is monotone, so this equals
    ``build_kt`` over the same keys exactly.
    """
    batch, num_kv_heads = kt.shape[:2]
    slot = per_head(slot, batch, num_kv_heads, "slot")
    rows = torch.arange(batch, device=kt.device)[:, None]
    heads = torch.arange(num_kv_heads, device=kt.device)[None, :]
    page = slot // page_size  # [B, Hkv]
    fresh = (slot % page_size == 0)[..., None]  # [B, Hkv, 1]
    current = kt[rows, heads, page].float()  # [B, Hkv, 2, D]
    k = key_new.float()
    new_min = torch.where(fresh, k, torch.minimum(current[:, :, 0], k))
    new_max = torch.where(fresh, k, torch.maximum(current[:, :, 1], k))
    kt[rows, heads, page] = torch.stack([new_min, new_max], dim=2).to(kt.dtype)


def top_channels(q: torch.Tensor, topr: int) -> torch.Tensor | None:
    """Channels used for scoring: top ``topr`` of |q| summed over the group, ``[B, Hkv, r]``; None = all channels."""
    if topr >= q.shape[-1]:
        return None
    return q.abs().sum(dim=2).topk(topr, dim=-1).indices


def page_scores(
    q: torch.Tensor, kt: torch.Tensor, n_pages: torch.Tensor, topr: int, per_head_bound: bool = False
) -> torch.Tensor:
    """Group-mean page probabilities ``[B, Hkv, NP]`` (fp32; pages >= n_pages[b] get 0).

    Per channel c the group-summed query sign picks Kmax (sum > 0) or Kmin; each query head scores
    ``s[g, j] = sum_c q[g, c] * Kp[j, c]``, softmax over the row's pages at temperature 1/sqrt(D), then the mean
    over the G heads of the group. As in TensorRT-LLM, q is rounded to the KT dtype before scoring.
    ``per_head_bound`` (``stage2_score="head_bound"``): each query head picks by its own sign instead,
    ``s[g, j] = sum_c max(q[g, c] * Kmax[j, c], q[g, c] * Kmin[j, c])``, Quest's upper bound of the head's largest
    logit on the page (with G = 1 both rules agree).
    """
    head_dim = q.shape[-1]
    return page_probs(page_logits(q, kt, topr, per_head_bound) * head_dim**-0.5, n_pages)


def page_logits(q: torch.Tensor, kt: torch.Tensor, topr: int, per_head_bound: bool = False) -> torch.Tensor:
    """Unscaled page logits ``[B, Hkv, G, NP]`` fp32 (``page_scores`` without temperature, mask and softmax)."""
    q = round_like_cast(q.float(), kt.dtype)  # = q.to(kt.dtype).float(), also under torch.compile
    minmax = kt.float()  # [B, Hkv, NP, 2, D]
    channels = top_channels(q, topr)
    if channels is not None:
        q = q.gather(-1, channels[:, :, None, :].expand(-1, -1, q.shape[2], -1))
        idx = channels[:, :, None, None, :].expand(-1, -1, minmax.shape[2], 2, -1)
        minmax = minmax.gather(-1, idx)
    if per_head_bound:  # max(q Kmax, q Kmin) = max(q, 0) Kmax + min(q, 0) Kmin, as Kmax >= Kmin
        return (torch.einsum("bhgr,bhpr->bhgp", q.clamp(min=0), minmax[:, :, :, 1])
                + torch.einsum("bhgr,bhpr->bhgp", q.clamp(max=0), minmax[:, :, :, 0]))
    use_max = (q.sum(dim=2) > 0)[:, :, None, :]  # [B, Hkv, 1, r]
    picked = torch.where(use_max, minmax[:, :, :, 1], minmax[:, :, :, 0])  # [B, Hkv, NP, r]
    return torch.einsum("bhgr,bhpr->bhgp", q, picked)


def page_probs(logits: torch.Tensor, n_pages: torch.Tensor) -> torch.Tensor:
    """Softmax of scaled page logits ``[B, Hkv, G, NP]`` over the row's pages in use, mean over the group ->
    ``[B, Hkv, NP]`` fp32 (pages >= n_pages get 0)."""
    page = torch.arange(logits.shape[-1], device=logits.device)
    in_use = (page < per_head(n_pages, *logits.shape[:2], "n_pages")[..., None])[:, :, None, :]  # [B, Hkv, 1, NP]
    probs = torch.softmax(logits.masked_fill(~in_use, float("-inf")), dim=-1).nan_to_num_(0.0)
    return probs.mean(dim=2)


def capped_page_scores(
    q: torch.Tensor, kt: torch.Tensor, n_pages: torch.Tensor, topr: int, per_head_bound: bool, scaling: float,
    softcap: float,
) -> torch.Tensor:
    """``page_scores`` for a layer that soft-caps its logits: the page logits at the model's own ``scaling``,
    soft-capped (``tanh(x / softcap) * softcap``) as the model caps the logits it attends with, then the same
    softmax over pages and group mean."""
    logits = page_logits(q, kt, topr, per_head_bound) * scaling
    return page_probs(torch.tanh(logits / softcap) * softcap, n_pages)


def check_softcap(softcap: float | None, scaling: float | None) -> None:
    """``top_pages``' soft-capping arguments: None, or a positive cap with the model's positive ``scaling``."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"top_pages: softcap must be a positive number or None, got {softcap!r}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise ValueError(f"top_pages: scaling (the model's logit scale) must be a positive number with softcap, "
                         f"got {scaling!r}")


def check_forcing(topk: int, sink_pages: int, recent_pages: int) -> None:
    """Validate ``select_pages``' integer arguments (host-side only: no device sync)."""
    if topk < 1:
        raise ValueError(f"select_pages: topk must be >= 1, got {topk}")
    if sink_pages < 0:
        raise ValueError(f"select_pages: sink_pages must be >= 0, got {sink_pages}")
    if recent_pages < 0:
        raise ValueError(f"select_pages: recent_pages must be >= 0, got {recent_pages}")
    if sink_pages + recent_pages > topk:
        raise ValueError(
            f"select_pages: sink_pages + recent_pages must be <= topk (forced pages take top-k slots), got "
            f"sink_pages={sink_pages} + recent_pages={recent_pages} > topk={topk}"
        )


def forced_pages(n: torch.Tensor, num_slots: int, sink_pages: int, recent_pages: int) -> torch.Tensor:
    """Pages always selected, ``[B, Hkv, NP]`` bool from ``n`` [B, Hkv] pages in use: the first ``sink_pages``
    and the last ``recent_pages`` pages in use (the newest page holds the newest token)."""
    page = torch.arange(num_slots, device=n.device)
    n = n[..., None]
    return ((page < sink_pages) | (page >= n - recent_pages)) & (page < n)


def select_pages(
    probs: torch.Tensor, n_pages: torch.Tensor, topk: int, sink_pages: int = 0, recent_pages: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k pages per KV head, with the first ``sink_pages`` and last ``recent_pages`` pages in use forced in.

    ``probs`` [B, Hkv, NP] (>= 0; NaN and negative values rank as 0), ``n_pages`` [B] or [B, Hkv] (clamped to
    [0, NP]). With n pages in use, the forced pages {j < min(sink_pages, n)} and {max(0, n - recent_pages) <= j < n}
    are taken, then the best-scoring other pages in use until min(K, n) are taken; ties go to the lower page id.
    Returns ``page_idx`` LongTensor ``[B, Hkv, K]`` and ``page_valid`` bool ``[B, Hkv, K]`` (K = min(topk, NP));
    slots past min(K, n) are invalid and hold the unused page ids n, n+1, ... Callers must treat the order inside
    the K as unspecified; this reference (and the Triton kernel) list the forced pages in ascending order, then the
    others by descending score, then the invalid ones.
    The defaults (no sink, the newest page forced) are RocketKV's decode rule. Needs sink_pages + recent_pages <=
    topk.
    """
    check_forcing(topk, sink_pages, recent_pages)
    batch, num_kv_heads, num_slots = probs.shape
    k = min(topk, num_slots)
    n = per_head(n_pages, batch, num_kv_heads, "n_pages").clamp(0, num_slots)
    page = torch.arange(num_slots, device=probs.device)
    forced = forced_pages(n, num_slots, sink_pages, recent_pages)
    candidate = (page < n[..., None]) & ~forced
    # rank key: class (forced 2, other pages in use 1, unused 0), then score, then lower page id. Two stable sorts
    # give the lexicographic order (the last sort is the major key); scores count only inside class 1.
    score = torch.where(candidate & (probs > 0), probs, torch.zeros_like(probs))  # NaN > 0 is False
    order = score.sort(dim=-1, descending=True, stable=True).indices
    klass = forced.long() * 2 + candidate.long()
    order = order.gather(-1, klass.gather(-1, order).sort(dim=-1, descending=True, stable=True).indices)
    page_idx = order[..., :k]
    page_valid = page_idx < n[..., None]
    return page_idx, page_valid


def top_pages(
    q: torch.Tensor,
    kt: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    topr: int,
    topk: int,
    sink_pages: int = 0,
    recent_pages: int = 1,
    per_head_bound: bool = False,
    softcap: float | None = None,
    scaling: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's page selection from the token counts: ``select_pages(page_scores(q, kt, num_pages(lengths),
    topr, per_head_bound), ...)``. ``lengths`` [B] or [B, Hkv] tokens stored; returns (page_idx, page_valid)
    [B, Hkv, K]. ``softcap`` (with the model's ``scaling``): the scores are ``capped_page_scores``."""
    check_softcap(softcap, scaling)
    n_pages = num_pages(lengths, page_size)
    if softcap is not None:
        probs = capped_page_scores(q, kt, n_pages, topr, per_head_bound, scaling, softcap)
    else:
        probs = page_scores(q, kt, n_pages, topr, per_head_bound)
    return select_pages(probs, n_pages, topk, sink_pages, recent_pages)
