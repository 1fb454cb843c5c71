"""Triton twin of ``stage2_pages.build_kt``: per-page element-wise min/max of the keys (the KT page summaries).

Shapes (B batch, Hkv KV heads, C slot capacity, P page_size, NP = C // P pages, D head_dim):
    keys:    [B, Hkv, C, D]      fp32 / fp16 / bf16, any strides
    lengths: [B] or [B, Hkv]     int, tokens stored per row (or per row and KV head); slots past it are ignored
    returns  kt [B, Hkv, NP, 2, D] in ``kt_dtype`` (fp32 / fp16 / bf16 / float8_e5m2): [..., 0, :] min, [..., 1, :] max;
             a partial last page covers only its tokens, pages without tokens hold zeros.

Grid (B*Hkv, cdiv(NP, BLOCK_P)): each program reduces BLOCK_P pages over the P tokens of each page (P loads of
[BLOCK_P, D] rows), in fp32, and rounds once to the KT dtype (rounding is monotone, so this equals rounding first).
Runs once per prompt (after stage 1) and after a multi-token append, so it is not on the per-token path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import TritonLaunch

from ._triton_common import cast_to, cdiv, count_strides, dtype_code, next_pow2


# num_pages follows the capacity (prompt budget + max_new_tokens): Triton would compile one variant per divisibility
# of it by 16 (measured: a first max_new_tokens=1 request recompiled this kernel, 0.75 s on an H100); it only bounds
# masks, so nothing is lost by not specialising on it
@triton.jit(do_not_specialize=["num_pages"])
def _build_kt_kernel(
    keys_ptr, lengths_ptr, kt_ptr,
    s_kb, s_kh, s_kc, s_kd,
    s_tb, s_th, s_tp, s_tm, s_td,
    s_lb, s_lh,
    num_kv_heads, num_pages, head_dim,
    P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, KT_DT: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    pages = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    length = tl.load(lengths_ptr + b * s_lb + h * s_lh)
    k_base = keys_ptr + b * s_kb + h * s_kh
    kmin = tl.full((BLOCK_P, BLOCK_D), float("inf"), tl.float32)
    kmax = tl.full((BLOCK_P, BLOCK_D), float("-inf"), tl.float32)
    for t in tl.static_range(P):
        slot = pages * P + t
        m = ((slot < length) & (pages < num_pages))[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot.to(tl.int64)[:, None] * s_kc + d[None, :] * s_kd, mask=m, other=0.0).to(tl.float32)
        kmin = tl.minimum(kmin, tl.where(m, k, float("inf")))
        kmax = tl.maximum(kmax, tl.where(m, k, float("-inf")))
    kmin = tl.where(tl.abs(kmin) == float("inf"), 0.0, kmin)
    kmax = tl.where(tl.abs(kmax) == float("inf"), 0.0, kmax)
    out = kt_ptr + b * s_tb + h * s_th + pages.to(tl.int64)[:, None] * s_tp + d[None, :] * s_td
    sm = (pages < num_pages)[:, None] & d_ok[None, :]
    tl.store(out, cast_to(kmin, KT_DT), mask=sm)
    tl.store(out + s_tm, cast_to(kmax, KT_DT), mask=sm)

_build_kt_launch = TritonLaunch(_build_kt_kernel)


def build_kt_triton(keys: torch.Tensor, lengths: torch.Tensor, page_size: int, kt_dtype: torch.dtype) -> torch.Tensor:
    """Same contract as ``stage2_pages.build_kt``."""
    batch, num_kv_heads, capacity, head_dim = keys.shape
    num_pages = capacity // page_size
    kt = torch.empty((batch, num_kv_heads, num_pages, 2, head_dim), dtype=kt_dtype, device=keys.device)
    if kt.numel() == 0:
        return kt
    block_d = next_pow2(head_dim)
    block_p = max(1, min(next_pow2(num_pages), 4096 // block_d))
    grid = (batch * num_kv_heads, cdiv(num_pages, block_p))
    _build_kt_launch[grid](
        keys, lengths, kt,
        *keys.stride(), *kt.stride(), *count_strides(lengths, batch, num_kv_heads, "lengths"),
        num_kv_heads, num_pages, head_dim,
        P=page_size, BLOCK_P=block_p, BLOCK_D=block_d, KT_DT=dtype_code(kt_dtype),
        num_warps=4,
    )
    return kt
