"""The oracle of fp8 pool pages for tests: K/V rows cut into pool pages, each quantized with the reference
(``hf_rocketkv.memory.fp8.quantize_pages``) and read back, and the relative error the fp8 tests bound."""

from __future__ import annotations

import torch

from hf_rocketkv.memory.fp8 import dequantize_fp8, quantize_pages


def round_trip(rows: torch.Tensor, granularity: str, page: int) -> torch.Tensor:
    """``rows`` ``[B, Hkv, C, D]`` (``C`` a multiple of ``page``) cut into pool pages of ``page`` slots, each quantized
    with the reference and read back, in ``rows``' dtype and layout."""
    batch, heads, slots, dim = rows.shape
    pages = rows.reshape(batch, heads, slots // page, page, dim).transpose(1, 2).reshape(-1, heads, page, dim)
    q, scale = quantize_pages(pages, granularity)
    back = dequantize_fp8(q, scale, rows.dtype)
    return back.reshape(batch, slots // page, heads, page, dim).transpose(1, 2).reshape(batch, heads, slots, dim)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms)."""
    return float((a - b).norm() / b.norm())
