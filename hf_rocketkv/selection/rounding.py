"""Rounding a float32 tensor to a narrower float format, bit for bit what ``x.to(dtype).float()`` gives, in a form
that torch.compile keeps.

Why not the cast itself: inductor fuses ``x.to(bfloat16).float()`` into the surrounding float32 arithmetic and drops
the rounding (it does not emulate precision casts by default), so a compiled decode step scored pages with another
query than the eager one and could pick another page on a near tie. Integer and ``torch.round`` arithmetic cannot
be dropped, so both paths round alike.

The rule is round to nearest, ties to even, as the cast does:
- normal range: add half an ulp of the target (plus the tie-breaking bit) to the float32 bits and clear the bits the
  target does not keep;
- below the smallest normal of the target (its subnormals): a multiple of the smallest subnormal, ``torch.round``
  (ties to even) of the scaled value; scaling by a power of two is exact;
- above the largest finite value: infinity with the sign, as the cast overflows (bfloat16 shares float32's range).
NaN stays NaN.
"""

from __future__ import annotations

import math

import torch

# dtype -> (mantissa bits, exponent of the smallest normal, largest finite value)
_FORMATS = {
    torch.bfloat16: (7, -126, None),  # float32's exponent range: nothing to clamp, subnormals round like normals
    torch.float16: (10, -14, 65504.0),
    torch.float8_e5m2: (2, -14, 57344.0),
}


def round_like_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32, any shape) rounded to ``dtype`` and returned as float32: equal to ``x.to(dtype).float()``
    element for element, in eager and compiled code alike. float32 (or wider) ``dtype``: ``x`` itself."""
    if x.dtype != torch.float32:
        raise ValueError(f"round_like_cast takes float32, got {x.dtype}")
    if dtype in (torch.float32, torch.float64):
        return x
    if dtype not in _FORMATS:
        raise ValueError(f"round_like_cast: dtype must be one of bfloat16, float16, float8_e5m2, float32; got {dtype}")
    mantissa, min_exponent, largest = _FORMATS[dtype]
    shift = 23 - mantissa
    bits = x.view(torch.int32)
    tie_bit = (bits >> shift) & 1
    rounded = ((bits + ((1 << (shift - 1)) - 1) + tie_bit) & -(1 << shift)).view(torch.float32)
    rounded = torch.where(torch.isnan(x), x, rounded)  # a NaN whose payload sits in the cleared bits stays NaN
    if largest is None:
        return rounded
    step = 2.0 ** (mantissa - min_exponent)  # 1 / (the smallest subnormal)
    subnormal = torch.round(x * step) / step
    rounded = torch.where(x.abs() < 2.0**min_exponent, subnormal, rounded)
    # the cast overflows to infinity from half an ulp above the largest finite value on (round to nearest)
    overflow = largest + 2.0 ** (math.floor(math.log2(largest)) - mantissa - 1)
    return torch.where(rounded.abs() >= overflow, torch.copysign(torch.full_like(x, math.inf), x), rounded)
