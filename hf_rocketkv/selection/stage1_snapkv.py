"""Stage 1 of RocketKV: SnapKV-style permanent eviction after prefill (reference PyTorch path).

Pure functions over tensors: they know nothing of caches or transformers.

Shapes (B batch, Hq query heads, Hkv KV heads, G = Hq // Hkv, N stored slots, D head_dim, w window):
    q_window: [B, Hq, w, D]   post-RoPE queries of the last w prompt tokens
    keys:     [B, Hkv, N, D]  post-RoPE keys in slot order
    start, end: [B]           row b's valid slots are [start[b], end[b]) (left padding sits before start[b];
                              the w window queries are the tokens in slots end[b]-w .. end[b]-1)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .logit_features import PLAIN, LogitFeatures, soft_cap, softmax_with_sinks


def window_scores(
    q_window: torch.Tensor, keys: torch.Tensor, start: torch.Tensor, end: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Softmax attention of the window queries over every valid key, summed over the window and the GQA group.

    Returns fp32 ``[B, Hkv, N]``; slots outside ``[start, end)`` and keys after a query (causality inside the
    window) get probability 0. The softmax runs in fp32 (as SnapKV and TensorRT-LLM do).
    """
    return featured_window_scores(q_window, keys, start, end, scaling, PLAIN)


def featured_window_scores(
    q_window: torch.Tensor, keys: torch.Tensor, start: torch.Tensor, end: torch.Tensor, scaling: float,
    features: LogitFeatures,
) -> torch.Tensor:
    """``window_scores`` with the logits the model attends with: soft-capped before the mask (``features.softcap``),
    and the softmax's denominator enlarged by each query head's sink (``features.sinks``), as the model's own
    attention probabilities are."""
    batch, num_q_heads, w, head_dim = q_window.shape
    num_kv_heads, num_slots = keys.shape[1], keys.shape[2]
    group = num_q_heads // num_kv_heads
    q = q_window.reshape(batch, num_kv_heads, group, w, head_dim).float()
    logits = soft_cap(torch.einsum("bhgwd,bhnd->bhgwn", q, keys.float()) * scaling, features.softcap)
    slot = torch.arange(num_slots, device=keys.device)
    query_slot = end[:, None] - w + torch.arange(w, device=keys.device)[None, :]  # [B, w]
    visible = (slot[None, None, :] <= query_slot[:, :, None]) & (slot[None, None, :] >= start[:, None, None])
    logits = logits.masked_fill(~visible[:, None, None, :, :], float("-inf"))
    sinks = features.grouped_sinks(num_kv_heads)
    # a row with no valid key (all padding) -> zeros
    probs = softmax_with_sinks(logits, sinks[None, :, :, None, None] if sinks is not None else None)
    return probs.sum(dim=(2, 3))


def scores_with(features: LogitFeatures):
    """A scorer with ``window_scores``' signature for a layer whose logits have ``features`` (the reference: no
    Triton kernel takes soft-capping or sinks)."""
    if features.plain:
        return window_scores
    return functools.partial(featured_window_scores, features=features)


def pooled_prefix_scores(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Max-pool ``[H, n]`` scores with stride 1 and same length (the implicit padding acts as -inf)."""
    if scores.shape[-1] == 0:
        return scores
    return F.max_pool1d(scores[:, None, :], kernel_size=kernel_size, stride=1, padding=kernel_size // 2)[:, 0, :]


def keep_slots_for_row(
    scores_row: torch.Tensor, start: int, end: int, window_size: int, prompt_budget: int, kernel_size: int
) -> torch.Tensor:
    """Slots kept for one batch row, ``[Hkv, n_keep]`` ascending, ``n_keep = min(end - start, prompt_budget)``.

    Rows of at most ``prompt_budget`` valid tokens are kept whole. Otherwise the last ``window_size`` tokens
    are kept, plus the ``prompt_budget - window_size`` prefix tokens with the highest max-pooled scores.
    """
    num_kv_heads = scores_row.shape[0]
    n_valid = end - start
    device = scores_row.device
    if n_valid <= prompt_budget:
        return torch.arange(start, end, device=device).expand(num_kv_heads, n_valid)
    w = min(window_size, n_valid)
    prefix = pooled_prefix_scores(scores_row[:, start : end - w], kernel_size)
    chosen = prefix.topk(prompt_budget - w, dim=-1).indices.sort(dim=-1).values + start
    window = torch.arange(end - w, end, device=device).expand(num_kv_heads, w)
    return torch.cat([chosen, window], dim=-1)


def snapkv_keep_slots(
    q_window: torch.Tensor,
    keys: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    *,
    window_size: int,
    prompt_budget: int,
    kernel_size: int,
    scaling: float,
    scores_fn=None,
    window_len: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Stage-1 selection for every row: a list of B LongTensors ``[Hkv, n_keep_b]`` of slots, ascending.

    Only rows longer than the budget are scored, so short prompts cost nothing here. ``scores_fn`` replaces
    ``window_scores`` (same signature), e.g. by the Triton kernel. ``window_len`` [B] (None: all ``w``): how many of
    the last window queries of each row are real tokens; a row with fewer (a later turn whose new tokens are fewer
    than the window, left-padded in a batch) scores with only those and keeps only those as its window, exactly as
    when it runs alone. Rows are grouped by window length, so ``scores_fn`` always sees full windows.
    """
    batch, w = q_window.shape[0], q_window.shape[2]
    lengths = [w] * batch if window_len is None else [min(int(n), w) for n in window_len.tolist()]
    if any(n < 1 for n in lengths):
        raise ValueError(f"every row needs at least one real query in its stage-1 window, got window lengths {lengths}")
    kept: list[torch.Tensor | None] = [None] * batch
    for length in sorted(set(lengths)):
        rows = [b for b in range(batch) if lengths[b] == length]
        if len(rows) == batch:
            group = (q_window[:, :, w - length :], keys, start, end)
        else:
            index = torch.tensor(rows, device=keys.device)
            group = (q_window[index][:, :, w - length :], keys[index], start[index], end[index])
        group_kept = _keep_slots_same_window(
            *group, window_size=min(window_size, length), prompt_budget=prompt_budget, kernel_size=kernel_size,
            scaling=scaling, scores_fn=scores_fn if scores_fn is not None else window_scores,
        )
        for b, slots in zip(rows, group_kept):
            kept[b] = slots
    return kept


def _keep_slots_same_window(q_window, keys, start, end, *, window_size, prompt_budget, kernel_size, scaling, scores_fn):
    starts, ends = start.tolist(), end.tolist()
    needs_scores = any(e - s > prompt_budget for s, e in zip(starts, ends))
    scores = scores_fn(q_window, keys, start, end, scaling) if needs_scores else None
    kept = []
    for b, (s, e) in enumerate(zip(starts, ends)):
        row_scores = scores[b] if scores is not None else keys.new_zeros(keys.shape[1], keys.shape[2])
        kept.append(keep_slots_for_row(row_scores, s, e, window_size, prompt_budget, kernel_size))
    return kept
