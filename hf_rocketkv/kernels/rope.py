"""Rotary position embedding of one decode step's query and key in one launch, bit for bit transformers' eager
``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``) in bfloat16 and float16.

Why: the eager formula is ten launches per layer (four products, two sums, two negations, two concatenations):
at batch 1 about 0.6 ms of a 6.7 ms graphed decode step of a 32-layer model on an H200, and ~50 us of host time per
layer in eager decode. Prefill (many tokens) keeps transformers' formula: there the launches are negligible.

Shapes (B batch, Hq query heads, Hkv KV heads, one new token, D head_dim, even):
    q:        [B, Hq, 1, D]   any strides (the projection's transposed view)
    k:        [B, Hkv, 1, D]  any strides
    cos, sin: [B, 1, D] or [1, 1, D] (broadcast over the batch), in q's dtype: the rotary embedding's output
    returns   (q_embed [B, Hq, 1, D], k_embed [B, Hkv, 1, D]), contiguous, in q's dtype

Exactness: PyTorch computes each product and each sum of a half-precision expression in fp32 and rounds the result
to the tensor's dtype before the next operation; the kernel rounds at the same places (``round_to``: round
to nearest even with integer operations, the same on every backend, the interpreter included), so no multiply-add
can be contracted across them. Only
16-bit dtypes are handled: in fp32 the compiler could fuse a product into the sum (an FMA), which eager PyTorch does
not, so fp32 stays on transformers' formula (``rope_supported``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._triton_common import DT_BF16, DT_FP16, cdiv, next_pow2, round_to
from .launch import TritonLaunch

try:  # what a triton_op's eager implementation uses to launch kernels directly (see ``_direct_launches``)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - an older torch: the launch goes through wrap_triton
    set_wrap_triton_enabled = None

HEADS_PER_PROGRAM = 8
ROPE_DTYPES = {torch.bfloat16: DT_BF16, torch.float16: DT_FP16}


@triton.jit
def _negated(x):
    """``-x`` by flipping the sign bit: ``(-a) * b`` rounds to exactly ``-(a * b)``, zeros' signs included, while
    Triton compiles ``-t`` as ``0 - t`` (+0.0 for t = +0.0)."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, cos_ptr, sin_ptr, b, h0, num_heads, half,
                  s_xb, s_xh, s_xd, s_ob, s_oh, s_cb, s_cd,
                  DT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads h0 .. h0 + BLOCK_H of row b: out = x * cos + rotate_half(x) * sin, rounded like eager PyTorch."""
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h < num_heads)[:, None] & (d < half)[None, :]
    x_row = x_ptr + b * s_xb + h.to(tl.int64)[:, None] * s_xh
    x1 = tl.load(x_row + d[None, :] * s_xd, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (d + half)[None, :] * s_xd, mask=ok, other=0.0).to(tl.float32)
    c_row = b * s_cb + d * s_cd
    c_ok = d < half
    c1 = tl.load(cos_ptr + c_row, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + c_row + half * s_cd, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + c_row, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + c_row + half * s_cd, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    # rotate_half(x) = cat(-x2, x1); each product and the sum rounded to DT as eager PyTorch does
    first = round_to(round_to(x1 * c1, DT) + round_to(_negated(x2 * s1), DT), DT)
    second = round_to(round_to(x2 * c2, DT) + round_to(x1 * s2, DT), DT)
    o_row = out_ptr + b * s_ob + h.to(tl.int64)[:, None] * s_oh
    tl.store(o_row + d[None, :], first.to(out_ptr.dtype.element_ty), mask=ok)  # exact: already rounded
    tl.store(o_row + (d + half)[None, :], second.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_decode_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    s_qb, s_qh, s_qd, s_kb, s_kh, s_kd, s_cb, s_cd,
    num_q_heads, num_kv_heads, half, q_blocks,
    DT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if blk < q_blocks:
        _rotate_heads(q_ptr, qo_ptr, cos_ptr, sin_ptr, b, blk * BLOCK_H, num_q_heads, half,
                      s_qb, s_qh, s_qd, num_q_heads * 2 * half, 2 * half, s_cb, s_cd, DT, BLOCK_H, BLOCK_D)
    else:
        _rotate_heads(k_ptr, ko_ptr, cos_ptr, sin_ptr, b, (blk - q_blocks) * BLOCK_H, num_kv_heads, half,
                      s_kb, s_kh, s_kd, num_kv_heads * 2 * half, 2 * half, s_cb, s_cd, DT, BLOCK_H, BLOCK_D)


_rope_decode_launch = TritonLaunch(_rope_decode_kernel)


def rope_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rope_decode_triton`` computes exactly what transformers' formula would for these tensors: one new
    token, 16-bit dtypes, an even head_dim, ``cos``/``sin`` of shape [B or 1, 1, D] in the same dtype. Called on
    every layer's RoPE inside RocketKV calls: cheap checks first (a prefill fails at the token count)."""
    q_shape, k_shape, c_shape = q.shape, k.shape, cos.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(c_shape) != 3 or q_shape[2] != 1 or k_shape[2] != 1:
        return False
    dtype = q.dtype
    return (
        dtype in ROPE_DTYPES and k.dtype == dtype and cos.dtype == dtype and sin.dtype == dtype
        and k_shape[0] == q_shape[0] and k_shape[3] == q_shape[3] and q_shape[3] % 2 == 0
        and c_shape[1] == 1 and c_shape[2] == q_shape[3] and c_shape[0] in (1, q_shape[0]) and sin.shape == c_shape
        and q.device == k.device == cos.device == sin.device
    )


def rope_decode_torch(q, k, cos, sin):
    """PyTorch twin: transformers' formula, ``cos``/``sin`` [B or 1, 1, D] broadcast over the heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q).contiguous(), rotate(k).contiguous()


def rope_decode_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Same contract as ``rope_decode_torch`` (``rope_supported`` must hold)."""
    batch, num_q_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((batch, num_q_heads, 1, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((batch, num_kv_heads, 1, head_dim), dtype=k.dtype, device=k.device)
    if q_out.numel() == 0:
        return q_out, k_out
    half = head_dim // 2
    q_blocks = cdiv(num_q_heads, HEADS_PER_PROGRAM)
    if sin.stride() != cos.stride():  # one set of strides serves both (the rotary embedding makes them alike)
        cos, sin = cos.contiguous(), sin.contiguous()
    s_cb = cos.stride(0) if cos.shape[0] > 1 else 0
    with _direct_launches():
        _rope_decode_launch[(batch, q_blocks + cdiv(num_kv_heads, HEADS_PER_PROGRAM))](
            q, k, q_out, k_out, cos, sin,
            q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(3), s_cb, cos.stride(2),
            num_q_heads, num_kv_heads, half, q_blocks,
            DT=ROPE_DTYPES[q.dtype], BLOCK_H=HEADS_PER_PROGRAM, BLOCK_D=next_pow2(half), num_warps=1,
        )
    return q_out, k_out


def _direct_launches():
    """Eager launches without torch's ``wrap_triton`` higher-order op (~300 us of host time per call on an H200,
    measured): this launcher is only ever called eagerly (``integration/rope.py`` leaves traced calls to
    transformers), which is what a registered triton_op's own eager implementation does too."""
    return contextlib.nullcontext() if set_wrap_triton_enabled is None else set_wrap_triton_enabled(False)
