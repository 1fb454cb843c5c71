"""Rotary position embedding of a forward's query and key in one launch, bit for bit transformers' eager
``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``) in bfloat16 and float16.

Why: the eager formula is ten launches per layer (four products, two sums, two negations, two concatenations). In a
decode step that is about 0.6 ms of a 6.7 ms graphed batch-1 step of a 32-layer model on an H200, and ~50 us of host
time per layer in eager decode; in an 8k-token prefill the ten passes over strided views take ~14 ms of device time
of a ~290 ms Llama-3.1-8B forward on an H100 (``results/h100_2026-11-28_batching_engine_prefill_profile.json``), where
one pass reads q and k once and writes them once.

Shapes (B batch, Hq query heads, Hkv KV heads, T tokens of the forward, D head_dim, even):
    q:        [B, Hq, T, D]   any strides (the projection's transposed view)
    k:        [B, Hkv, T, D]  any strides
    cos, sin: [B, T, D] or [1, T, D] (broadcast over the batch), in q's dtype: the rotary embedding's output
    q_norm, k_norm: optional (weight [D] in q's dtype, eps), both or neither: Gemma 3's per-head RMSNorms, applied
              to each head before its rotation (``formula``: one of ``kernels/rms_norm.FORMULAS``, shared)
    returns   (q_embed [B, Hq, T, D], k_embed [B, Hkv, T, D]) in q's dtype, laid out as [B, T, H, D] (the
              projection's layout; contiguous when T == 1)

Exactness: PyTorch computes each product and each sum of a half-precision expression in fp32 and rounds the result
to the tensor's dtype before the next operation; the kernel rounds at the same places (``round_to``: round
to nearest even with integer operations, the same on every backend, the interpreter included), so no multiply-add
can be contracted across them. With the per-head norms, each head is first normalized by ``kernels/rms_norm``'s
formula code (``scaled``: the same roundings; the sum of squares reduced in another order than PyTorch's, so a
normalized value may sit one unit in the last place from eager's): Gemma 3's q norm, k norm and RoPE in one launch
per layer instead of three. Only 16-bit dtypes are handled: in fp32 the compiler could fuse a product into the sum
(an FMA), which eager PyTorch does not, so fp32 stays on transformers' formula (``rope_supported``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import DT_BF16, DT_FP16, PLAIN_TENSORS, cdiv, next_pow2, round_to
from .launch import TritonLaunch, direct_launches
from .rms_norm import FORMULAS, Norm, inverse_rms, rms_norm_reference, scaled

HEADS_PER_PROGRAM = 8
ROPE_DTYPES = {torch.bfloat16: DT_BF16, torch.float16: DT_FP16}


@triton.jit
def _negated(x):
    """``-x`` by flipping the sign bit: ``(-a) * b`` rounds to exactly ``-(a * b)``, zeros' signs included, while
    Triton compiles ``-t`` as ``0 - t`` (+0.0 for t = +0.0)."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def rotate_pair(x1, x2, c1, c2, s1, s2, DT: tl.constexpr):
    """The two halves of ``x * cos + rotate_half(x) * sin`` (fp32 values of dtype code DT; ``x1``, ``c1``, ``s1`` the
    first half's, ``x2``, ``c2``, ``s2`` the second's): rotate_half(x) = cat(-x2, x1), each product and the sum rounded
    to DT as eager PyTorch rounds them. Returns (first, second), rounded, as fp32."""
    first = round_to(round_to(x1 * c1, DT) + round_to(_negated(x2 * s1), DT), DT)
    second = round_to(round_to(x2 * c2, DT) + round_to(x1 * s2, DT), DT)
    return first, second


@triton.jit
def _rotate_heads(x_row, out_row, cos_row, sin_row, w_ptr, eps, h0, num_heads, half, s_xh, s_xd, s_cd,
                  DT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
                  FORMULA: tl.constexpr):
    """Heads h0 .. h0 + BLOCK_H of one token (``x_row``: its first head; ``out_row``: its [H, D] output block,
    contiguous): with ``NORM``, first each head's RMSNorm by ``FORMULA`` with weight ``w_ptr`` [D]
    (``rms_norm.scaled``); then out = x * cos + rotate_half(x) * sin, rounded like eager PyTorch."""
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h < num_heads)[:, None] & (d < half)[None, :]
    x_heads = x_row + h.to(tl.int64)[:, None] * s_xh
    x1 = tl.load(x_heads + d[None, :] * s_xd, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_heads + (d + half)[None, :] * s_xd, mask=ok, other=0.0).to(tl.float32)
    c_ok = d < half
    if NORM:  # each head's two halves: one sum of squares, one inverse RMS
        inv = inverse_rms(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), 2 * half, eps)[:, None]
        x1 = scaled(x1, inv, tl.load(w_ptr + d, mask=c_ok, other=0.0).to(tl.float32)[None, :], DT, FORMULA)
        x2 = scaled(x2, inv, tl.load(w_ptr + d + half, mask=c_ok, other=0.0).to(tl.float32)[None, :], DT, FORMULA)
    c1 = tl.load(cos_row + d * s_cd, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + (d + half) * s_cd, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + d * s_cd, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + (d + half) * s_cd, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    first, second = rotate_pair(x1, x2, c1, c2, s1, s2, DT)
    o_heads = out_row + h.to(tl.int64)[:, None] * (2 * half)
    tl.store(o_heads + d[None, :], first.to(out_row.dtype.element_ty), mask=ok)  # exact: already rounded
    tl.store(o_heads + (d + half)[None, :], second.to(out_row.dtype.element_ty), mask=ok)


# ``tokens`` specialised on being 1 (the decode step) but not on its divisibility by 16: two compiled kernels,
# decode and prefill, whatever the prompt lengths
@triton.jit(do_not_specialize_on_alignment=["tokens"])
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_eps, k_eps,
    s_qb, s_qt, s_qh, s_qd, s_kb, s_kt, s_kh, s_kd, s_cb, s_ct, s_cd,
    tokens, num_q_heads, num_kv_heads, half, q_blocks,
    DT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, FORMULA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * tokens + t: the output's row of [B * T, H, D]
    b = row // tokens
    t = row % tokens
    blk = tl.program_id(1)
    c_off = b * s_cb + t * s_ct
    if blk < q_blocks:
        _rotate_heads(q_ptr + b * s_qb + t * s_qt, qo_ptr + row * (num_q_heads * 2 * half), cos_ptr + c_off,
                      sin_ptr + c_off, qw_ptr, q_eps, blk * BLOCK_H, num_q_heads, half, s_qh, s_qd, s_cd,
                      DT, BLOCK_H, BLOCK_D, NORM, FORMULA)
    else:
        _rotate_heads(k_ptr + b * s_kb + t * s_kt, ko_ptr + row * (num_kv_heads * 2 * half), cos_ptr + c_off,
                      sin_ptr + c_off, kw_ptr, k_eps, (blk - q_blocks) * BLOCK_H, num_kv_heads, half, s_kh, s_kd,
                      s_cd, DT, BLOCK_H, BLOCK_D, NORM, FORMULA)


_rope_launch = TritonLaunch(_rope_kernel)


def rope_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: Norm | None = None, k_norm: Norm | None = None) -> bool:
    """Whether ``rope_triton`` computes what transformers' formula would for these tensors: 16-bit dtypes, q and k
    of the same batch, tokens and even head_dim, ``cos``/``sin`` of shape [B or 1, T, D] in the same dtype; per-head
    norms both or neither, each a plain contiguous [D] weight in q's dtype on q's device. Called on every layer's
    RoPE inside RocketKV calls: cheap checks first."""
    q_shape, k_shape, c_shape = q.shape, k.shape, cos.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(c_shape) != 3 or (q_norm is None) != (k_norm is None):
        return False
    dtype = q.dtype
    return (
        dtype in ROPE_DTYPES and k.dtype == dtype and cos.dtype == dtype and sin.dtype == dtype
        and k_shape[0] == q_shape[0] and k_shape[2] == q_shape[2] and k_shape[3] == q_shape[3]
        and q_shape[3] % 2 == 0
        and c_shape[1] == q_shape[2] and c_shape[2] == q_shape[3] and c_shape[0] in (1, q_shape[0])
        and sin.shape == c_shape and q.device == k.device == cos.device == sin.device
        and all(_norm_readable(norm, q) for norm in (q_norm, k_norm) if norm is not None)
    )


def _norm_readable(norm: Norm, q: torch.Tensor) -> bool:
    weight, eps = norm
    return (type(weight) in PLAIN_TENSORS and weight.dim() == 1 and weight.shape[0] == q.shape[3]
            and weight.dtype == q.dtype and weight.device == q.device and weight.stride(0) == 1
            and isinstance(eps, float))


def rotary_operands(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """``cos``, ``sin`` [B or 1, T, D] as the kernels read them, with one set of strides for both (made contiguous
    where the two differ; the rotary embedding makes them alike) and that set: (batch, token, channel), the batch
    stride 0 when one table serves every row."""
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2))


def rope_torch(q, k, cos, sin, q_norm: Norm | None = None, k_norm: Norm | None = None, formula: str = "gemma"):
    """PyTorch twin: transformers' formula, ``cos``/``sin`` [B or 1, T, D] broadcast over the heads, after each
    given per-head norm (``rms_norm_reference`` by ``formula``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if q_norm is not None:
        q, k = rms_norm_reference(q, *q_norm, formula), rms_norm_reference(k, *k_norm, formula)

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_norm: Norm | None = None, k_norm: Norm | None = None, formula: str = "gemma"):
    """Same values as ``rope_torch`` (``rope_supported`` must hold), the norms within one unit in the last place of
    eager PyTorch's (``kernels/rms_norm.py``); outputs laid out as [B, T, H, D]."""
    batch, num_q_heads, tokens, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((batch, tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device).transpose(1, 2)
    k_out = torch.empty((batch, tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device).transpose(1, 2)
    if q_out.numel() == 0 or k_out.numel() == 0:
        return q_out, k_out
    half = head_dim // 2
    q_blocks = cdiv(num_q_heads, HEADS_PER_PROGRAM)
    cos, sin, cos_strides = rotary_operands(cos, sin)
    (q_weight, q_eps), (k_weight, k_eps) = (q_norm, k_norm) if q_norm is not None else ((cos, 0.0), (cos, 0.0))
    with direct_launches():
        _rope_launch[(batch * tokens, q_blocks + cdiv(num_kv_heads, HEADS_PER_PROGRAM))](
            q, k, q_out, k_out, cos, sin, q_weight, k_weight, float(q_eps), float(k_eps),
            q.stride(0), q.stride(2), q.stride(1), q.stride(3), k.stride(0), k.stride(2), k.stride(1), k.stride(3),
            *cos_strides,
            tokens, num_q_heads, num_kv_heads, half, q_blocks,
            DT=ROPE_DTYPES[q.dtype], BLOCK_H=HEADS_PER_PROGRAM, BLOCK_D=next_pow2(half), NORM=q_norm is not None,
            FORMULA=FORMULAS[formula] if q_norm is not None else 0, num_warps=1,
        )
    return q_out, k_out
