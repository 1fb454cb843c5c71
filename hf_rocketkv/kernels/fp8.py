"""fp8 (e4m3) KV storage: the PyTorch reference of quantize / dequantize with per-page or per-head scales.

A page slice ``x`` of shape ``[n, H, p, D]`` (n pages, H KV heads, p tokens, D head_dim) is stored as
``q = round_to_e4m3(x / s)`` with a float32 scale ``s`` per page (``[n]``, granularity "page") or per page and head
(``[n, H]``, granularity "head"), chosen so the largest magnitude maps to e4m3's largest finite value:
``s = amax / 448`` (``s = 1`` for an all-zero page, so zeros stay zeros and nothing divides by 0).

Error bound of the round trip (tested): e4m3 has 3 mantissa bits, so a value in the normal range is off by at most
half a step, ``|x| * 2**-4``; below the normal range (``|x / s| < 2**-6``) steps are ``2**-9``, so the error is at
most ``s * 2**-10``. Together: ``|x - dequantize(quantize(x))| <= |x| * 2**-4 + s * 2**-10``.

The paged kernels that read and write fp8 pages (kernels/paged.py, append_token.py, compact.py,
sparse_decode_attention.py) match this reference; memory/fp8.py re-exports it for the pool. It lives here, at the
bottom of the package, so that kernels never import the memory layer above them.
"""

from __future__ import annotations

import torch


SCALE_DTYPE = torch.float32  # fp8 page scales (memory/layout.py lays them out beside the pages)
SCALE_GRANULARITIES = ("page", "head")  # one scale per page, or per page and KV head
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def _check_granularity(granularity: str) -> None:
    if granularity not in SCALE_GRANULARITIES:
        raise ValueError(f"KVBlockPool.scale_granularity must be one of {list(SCALE_GRANULARITIES)}, got {granularity!r}")


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` (float32), correctly rounded on every device, like the kernels' ``div_rn``. PyTorch's CUDA
    division by a Python number multiplies by its reciprocal instead, which lands one ulp off for some values: a 0-dim
    tensor divisor keeps the true division."""
    return amax / amax.new_full((), FP8_MAX)


def fp8_scales(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """Scales for ``x`` ``[n, H, p, D]``: float32 ``[n]`` ("page") or ``[n, H]`` ("head")."""
    _check_granularity(granularity)
    if x.dim() != 4:
        raise ValueError(f"fp8_scales expects pages [n, H, p, D], got shape {tuple(x.shape)}")
    reduce_dims = (1, 2, 3) if granularity == "page" else (2, 3)
    amax = x.detach().abs().to(SCALE_DTYPE).amax(dim=reduce_dims)
    return torch.where(amax > 0, scale_from_amax(amax), torch.ones_like(amax))


def _broadcast(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A ``[n]`` or ``[n, H]`` scale shaped to broadcast over ``[n, H, p, D]``."""
    return scale.reshape(*scale.shape, *([1] * (x.dim() - scale.dim())))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, H, p, D]`` (any float dtype) divided by ``scale`` and rounded to e4m3 (saturating at +-448)."""
    scaled = x.to(SCALE_DTYPE) / _broadcast(scale.to(SCALE_DTYPE), x)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` up to rounding: ``q * scale`` in ``dtype``."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_fp8 expects {FP8_DTYPE} pages, got {q.dtype}")
    return (q.to(SCALE_DTYPE) * _broadcast(scale.to(SCALE_DTYPE), q)).to(dtype)


def quantize_pages(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for ``x`` ``[n, H, p, D]``: scales from :func:`fp8_scales`, then :func:`quantize_fp8`."""
    scale = fp8_scales(x, granularity)
    return quantize_fp8(x, scale), scale
