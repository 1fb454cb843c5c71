"""Reference (PyTorch) writes and reads of tokens in paged storage, in positional order.

Token ``t`` of a table lives in page ``page_ids[t // p]``, slot ``t % p`` (p = page_size), in every layer. These are
the oracles of the paged kernels that come later, and what tests and prefix files use; they are not fast.

fp8 pages: a write re-quantizes every page it touches over the page's valid tokens (those before the end of the
write; tokens ``[0, start)`` must have been written already), so a page's scale always covers what it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fp8 import dequantize_fp8, quantize_pages
from .storage import LayerStorage


def _token_slots(page_ids: Sequence[int], start: int, count: int, page_size: int, device: torch.device):
    positions = torch.arange(start, start + count, device=device)
    if count and (start + count - 1) // page_size >= len(page_ids):
        raise ValueError(
            f"tokens [{start}, {start + count}) need {(start + count - 1) // page_size + 1} pages, the table has "
            f"{len(page_ids)}"
        )
    table = torch.as_tensor(list(page_ids), dtype=torch.long, device=device)
    return table[positions // page_size], positions % page_size


def _check_states(layer: LayerStorage, states: torch.Tensor, name: str) -> None:
    shape = layer.shape
    if states.dim() != 3 or states.shape[0] != shape.num_kv_heads or states.shape[2] != shape.head_dim:
        raise ValueError(
            f"{name} must be [num_kv_heads={shape.num_kv_heads}, tokens, head_dim={shape.head_dim}], "
            f"got {tuple(states.shape)}"
        )


def write_tokens(layer: LayerStorage, page_ids: Sequence[int], start: int, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
    """Store ``keys``/``values`` ``[H, T, D]`` as tokens ``[start, start + T)`` of the table ``page_ids``."""
    _check_states(layer, keys, "keys")
    _check_states(layer, values, "values")
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
    count, p = keys.shape[1], layer.shape.page_size
    if count == 0:
        return
    pages, slots = _token_slots(page_ids, start, count, p, layer.device)
    if not layer.shape.is_fp8:
        layer.k[pages, :, slots] = keys.transpose(0, 1).to(layer.k.dtype)
        layer.v[pages, :, slots] = values.transpose(0, 1).to(layer.v.dtype)
        return
    first_page, last_page = start // p, (start + count - 1) // p
    touched = torch.as_tensor(list(page_ids[first_page : last_page + 1]), dtype=torch.long, device=layer.device)
    end = start + count
    slot_positions = (torch.arange(first_page, last_page + 1, device=layer.device)[:, None] * p
                      + torch.arange(p, device=layer.device)[None, :])  # [m, p] token index of each slot
    valid = (slot_positions < end)[:, None, :, None]  # [m, 1, p, 1]
    local = torch.arange(start, end, device=layer.device) // p - first_page  # [T] index into `touched`
    for data, store, scale in ((keys, layer.k, layer.k_scale), (values, layer.v, layer.v_scale)):
        dense = dequantize_fp8(store[touched], scale[touched])  # [m, H, p, D] float32
        dense[local, :, slots] = data.transpose(0, 1).to(torch.float32)
        dense = torch.where(valid, dense, torch.zeros((), dtype=dense.dtype, device=dense.device))
        quantized, new_scale = quantize_pages(dense, layer.shape.scale_granularity)
        store[touched] = quantized
        scale[touched] = new_scale


def read_tokens(layer: LayerStorage, page_ids: Sequence[int], count: int, start: int = 0,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[start, start + count)`` of the table ``page_ids`` as ``(keys, values)`` ``[H, count, D]``."""
    pages, slots = _token_slots(page_ids, start, count, layer.shape.page_size, layer.device)
    out = []
    for store, scale in ((layer.k, layer.k_scale), (layer.v, layer.v_scale)):
        if layer.shape.is_fp8:
            tokens = dequantize_fp8(store[pages], scale[pages], dtype)  # [T, H, p, D]
            tokens = tokens[torch.arange(count, device=layer.device), :, slots]  # [T, H, D]
        else:
            tokens = store[pages, :, slots].to(dtype)  # [T, H, D]
        out.append(tokens.transpose(0, 1).contiguous())
    return out[0], out[1]
