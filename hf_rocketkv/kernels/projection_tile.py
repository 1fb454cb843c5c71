"""The inner loop of the decode-step projection kernels (``stacked_projection.py``, ``gated_projection.py``): the fp32
sums of one tile of ``x @ w.T`` over the whole reduction dimension, for one weight or two side by side.

Shapes: rows ``r`` [BLOCK_R] of ``x`` (row stride ``s_xr``, the reduction dimension contiguous), columns ``c``
[BLOCK_C] of each weight (row stride ``s_w1`` / ``s_w2``, the reduction dimension contiguous); returns two
[BLOCK_R, BLOCK_C] fp32 accumulators (the second all zeros unless ``TWO``). Each x tile is loaded once for both
weights. 16-bit products are exact in the fp32 accumulator; the interpreter (``IEEE``), whose dot takes no bf16,
multiplies in fp32, which is exact for 16-bit inputs too.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def column_sums(x_ptr, w1_ptr, w2_ptr, r, c, r_ok, c_ok, hidden, s_xr, s_w1, s_w2, TWO: tl.constexpr,
                EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_K: tl.constexpr):
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + r[:, None].to(tl.int64) * s_xr + k[None, :]
    w1_ptrs = w1_ptr + c[:, None].to(tl.int64) * s_w1 + k[None, :]
    w2_ptrs = w2_ptr + c[:, None].to(tl.int64) * s_w2 + k[None, :]
    acc1 = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=r_ok[:, None], other=0.0)
            w1 = tl.load(w1_ptrs, mask=c_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + k) < hidden
            x = tl.load(x_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w1 = tl.load(w1_ptrs, mask=c_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            x = x.to(tl.float32)
            acc1 = tl.dot(x, tl.trans(w1.to(tl.float32)), acc1, input_precision="ieee")
        else:
            acc1 = tl.dot(x, tl.trans(w1), acc1)
        if TWO:
            if EVEN_K:
                w2 = tl.load(w2_ptrs, mask=c_ok[:, None], other=0.0)
            else:
                w2 = tl.load(w2_ptrs, mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc2 = tl.dot(x, tl.trans(w2.to(tl.float32)), acc2, input_precision="ieee")
            else:
                acc2 = tl.dot(x, tl.trans(w2), acc2)
            w2_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
    return acc1, acc2
