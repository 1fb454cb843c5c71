"""Llama 4's attention temperature for rows at different positions (the batching engine's decode step).

transformers' Llama 4 scales the queries of its NoPE layers (``attn_temperature_tuning``, ``use_rope`` False) by
their position ``p`` before the cache sees them:

    s(p) = log1p(floor((p + 1) / floor_scale)) * attn_scale + 1        q <- (q * s(p)).to(q.dtype)

reading ``p`` as ``cache.get_seq_length(layer)`` plus the query's column: one Python int for the whole batch. The
engine's rows are at different positions, so its batch answers 0 for those layers (``BatchedDecodeCache(
position_scaled_layers=...)``) and the ``rocketkv`` attention function scales each row's query by its own position
here, from the layer's per-row logical lengths (device tensors: a captured decode step replays it). With
``floor_scale >= 2`` (every Llama 4 checkpoint: 8192), ``s(0)`` is exactly 1, so the query arrives unscaled and
the result has the bits of a row run alone; otherwise the query is divided by ``s(0)`` first (within rounding).
"""

from __future__ import annotations

import math

import torch


def temperature(module: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """``s(positions)`` as transformers computes it (fp32, the same operations in the same order)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def scale_rows_by_position(module: torch.nn.Module, query: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``query`` ``[B, Hq, 1, D]`` of a decode step whose row ``b`` has seen ``seen[b]`` tokens (this step's
    included, so its query is at position ``seen[b] - 1``), as the model scales a row alone; ``query`` came scaled as
    if at position 0."""
    if query.shape[2] != 1 or seen.shape != (query.shape[0],):
        raise ValueError(f"scale_rows_by_position: a decode step's query [B, Hq, 1, D] and seen [B], got "
                         f"{list(query.shape)} and {list(seen.shape)}")
    at_zero = math.log1p(math.floor(1.0 / module.floor_scale)) * module.attn_scale + 1.0
    if at_zero != 1.0:
        query = query / at_zero
    scales = temperature(module, seen - 1).view(-1, 1, 1, 1)
    return (query * scales).to(query.dtype)


def scales_by_position(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an attention that scales its queries by position (Llama 4's NoPE layers)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)
