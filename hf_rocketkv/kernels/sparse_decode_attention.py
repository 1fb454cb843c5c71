"""Exact attention of one decode query over the tokens of the selected pages (stage 2, step 3).

Shapes (B batch, Hkv KV heads, G query heads per KV head, C slot capacity, P page_size, K pages, D head_dim):
    q:          [B, Hkv, G, D]
    keys/values:[B, Hkv, C, D]
    page_idx:   [B, Hkv, K] long, page_valid: [B, Hkv, K] bool, lengths: [B]
    returns     [B, Hkv, G, D] in q's dtype

The G query heads of one KV head share its pages, so every selected K/V row is read once per group.
"""

from __future__ import annotations

import torch


def selected_slots(
    page_idx: torch.Tensor, page_valid: torch.Tensor, lengths: torch.Tensor, page_size: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of the selected pages ``[B, Hkv, K*P]`` (clamped into range) and whether each holds a token."""
    offsets = torch.arange(page_size, device=page_idx.device)
    slots = (page_idx[..., None] * page_size + offsets).flatten(-2)
    valid = page_valid[..., None].expand(*page_valid.shape, page_size).flatten(-2)
    valid = valid & (slots < lengths[:, None, None])
    return slots.clamp(max=capacity - 1), valid


def sparse_decode_attention_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_idx: torch.Tensor,
    page_valid: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    scaling: float,
) -> torch.Tensor:
    """Reference: gather the selected tokens, fp32 softmax, weighted sum of their values."""
    head_dim = q.shape[-1]
    slots, valid = selected_slots(page_idx, page_valid, lengths, page_size, keys.shape[2])
    gather_idx = slots[..., None].expand(-1, -1, -1, head_dim)
    k = keys.gather(2, gather_idx).float()
    v = values.gather(2, gather_idx).float()
    logits = torch.einsum("bhgd,bhnd->bhgn", q.float(), k) * scaling
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    return torch.einsum("bhgn,bhnd->bhgd", probs, v).to(q.dtype)
