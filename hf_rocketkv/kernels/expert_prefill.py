"""The experts of a prefill chunk, grouped by expert: the pieces around the two grouped GEMMs.

Why: a prefill chunk of gpt-oss-20b routes 8,192 tokens to 4 of 32 experts, 32,768 (token, expert) pairs.
transformers' ``grouped_mm`` experts forward spends less time in its two grouped GEMMs (59 ms over 24 layers on an
H200) than around them (~135 ms of elementwise and copy kernels: the bias gathered per pair, the gate as six ops over
``[S, 2I]``, the routing weights, the pairs put back in token order, the sum over ``top_k``, and in transformers 5.17
three ``masked_fill`` over the whole activations). Here each of those is one pass:

    sort_by_expert(ids, E)          (kernels/expert_linear.py) -> the pair indices expert by expert, each expert's
                                    count and first place: device ops of fixed shapes
    grouped_matmul(x, W, ends)      [S, K] rows sorted by expert, W [E, K, N] -> [S, N] (torch's grouped GEMM on CUDA
                                    in bf16; ``grouped_matmul_reference``, a loop over experts, elsewhere)
    clamped_glu(up, bias, ids, alpha, limit)
                                    gpt-oss' gate over the sorted rows ``[S, 2I]`` (gate and up interleaved) with the
                                    expert's bias added first: ``g = min(up_even + b, limit)``, ``u = clamp(up_odd + b,
                                    -limit, limit)``, ``out = (u + 1) * g * sigmoid(alpha * g)`` -> ``[S, I]``
    combine(down, position, bias, ids, weights)
                                    ``out[t] = sum_j (down[position[t * top_k + j]] + bias[ids[t, j]]) * weights[t, j]``
                                    -> ``[T, H]``: the pairs back in token order, the expert bias, the routing weights
                                    and the sum over ``top_k`` in one pass

Each Triton kernel computes in fp32 and rounds once to the output dtype (transformers rounds after every op); its
``*_reference`` twin states the same contract in PyTorch. ``tests/kernels/test_expert_prefill.py`` holds kernels and
twins to a float64 oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import DTYPE_CODE, interpreting, round_to
from .launch import TritonLaunch, direct_launches

PREFILL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# torch's grouped GEMM (what transformers' ``grouped_mm`` experts call): public from torch 2.10 as
# ``torch.nn.functional.grouped_mm``, ``torch._grouped_mm`` before
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
COLUMNS = 1024  # output features per program of the gate and the combine


# ------------------------------------------------------------------------------------------------ grouped GEMM
def grouped_matmul_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``grouped_matmul`` runs torch's grouped GEMM: CUDA, bf16 throughout, rows and weights 16-byte aligned
    as it needs."""
    return (_GROUPED_MM is not None and x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.device == x.device and x.shape[-1] % 8 == 0 and weight.shape[1] % 8 == 0
            and weight.shape[2] % 8 == 0)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x`` ``[S, K]`` with expert ``e``'s rows at ``[ends[e-1], ends[e])`` times that expert's weights: ``weight``
    ``[E, K, N]`` (``transposed``) or ``nn.Linear``'s ``[E, N, K]``; returns ``[S, N]`` in x's dtype. torch's grouped
    GEMM where ``grouped_matmul_runs``, else the reference (a host sync for the offsets)."""
    w = weight if transposed else weight.transpose(1, 2)
    if grouped_matmul_runs(x, w):
        return _GROUPED_MM(x, w, offs=ends)
    return grouped_matmul_reference(x, w, ends)


def grouped_matmul_reference(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The twin: each expert's rows times its ``[K, N]`` weights in fp32, one rounding."""
    out = torch.empty((x.shape[0], weight.shape[2]), dtype=x.dtype, device=x.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = (x[start:end].float() @ weight[expert].float()).to(x.dtype)
        start = end
    return out


# ------------------------------------------------------------------------------------------------ gpt-oss' gate
@triton.jit
def _clamped_glu_kernel(up_ptr, b_ptr, ids_ptr, out_ptr, width, s_up, s_b, alpha, limit, DT: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    # (gate, up) pairs as one contiguous [BLOCK, 2] tile (two loads at a stride of two read at half the bandwidth)
    pairs = 2 * cols[:, None] + tl.arange(0, 2)[None, :]
    both = tl.load(up_ptr + row * s_up + pairs, mask=ok[:, None], other=0.0).to(tl.float32)
    if HAS_BIAS:
        expert = tl.load(ids_ptr + row).to(tl.int64)
        both += tl.load(b_ptr + expert * s_b + pairs, mask=ok[:, None], other=0.0).to(tl.float32)
    gate, up = tl.split(both)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    out = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    tl.store(out_ptr + row * width + cols, round_to(out, DT).to(out_ptr.dtype.element_ty), mask=ok)


_clamped_glu_launch = TritonLaunch(_clamped_glu_kernel)


def clamped_glu_reference(up: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, alpha: float,
                          limit: float) -> torch.Tensor:
    """The twin: ``up`` ``[S, 2I]`` (gate and up interleaved), ``bias`` ``[E, 2I]`` or None, ``ids`` ``[S]`` each
    row's expert; returns ``[S, I]`` computed in fp32, one rounding."""
    x = up.float() + (bias[ids].float() if bias is not None else 0.0)
    gate, lin = x[:, ::2].clamp(max=limit), x[:, 1::2].clamp(-limit, limit)
    return ((lin + 1.0) * gate * torch.sigmoid(gate * alpha)).to(up.dtype)


def clamped_glu_triton(up: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, alpha: float,
                       limit: float) -> torch.Tensor:
    """``clamped_glu_reference``'s contract in one launch (``up`` contiguous rows, ``bias`` rows contiguous)."""
    rows, width = up.shape[0], up.shape[1] // 2
    out = torch.empty((rows, width), dtype=up.dtype, device=up.device)
    if rows == 0:
        return out
    with direct_launches():
        _clamped_glu_launch[(rows, triton.cdiv(width, COLUMNS))](
            up, bias if bias is not None else up, ids, out, width, up.stride(0),
            bias.stride(0) if bias is not None else 0, float(alpha), float(limit), DT=DTYPE_CODE[up.dtype],
            HAS_BIAS=bias is not None, BLOCK=COLUMNS)
    return out


# ------------------------------------------------------------------------------------------------ combine
@triton.jit
def _combine_kernel(down_ptr, pos_ptr, b_ptr, ids_ptr, w_ptr, out_ptr, hidden, top_k, s_down, s_b, s_w,
                    DT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, top_k):
        pair = token * top_k + j
        row = tl.load(pos_ptr + pair).to(tl.int64)
        value = tl.load(down_ptr + row * s_down + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            value += tl.load(b_ptr + expert * s_b + cols, mask=ok, other=0.0).to(tl.float32)
        acc += value * tl.load(w_ptr + token * s_w + j).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, round_to(acc, DT).to(out_ptr.dtype.element_ty), mask=ok)


_combine_launch = TritonLaunch(_combine_kernel)


def combine_reference(down: torch.Tensor, position: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """The twin: ``down`` ``[S, H]`` rows in sorted order, ``position`` ``[S]`` the sorted row of pair ``s``, ``ids``
    ``[T, top_k]`` and ``weights`` ``[T, top_k]``; returns ``[T, H]`` in down's dtype, computed in fp32."""
    tokens, top_k = ids.shape
    rows = down[position.long()].float()
    if bias is not None:
        rows = rows + bias[ids.reshape(-1)].float()
    out = (rows * weights.reshape(-1, 1).float()).view(tokens, top_k, -1).sum(dim=1)
    return out.to(down.dtype)


def combine_triton(down: torch.Tensor, position: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """``combine_reference``'s contract in one launch (``down`` and ``bias`` rows contiguous)."""
    tokens, top_k = ids.shape
    hidden = down.shape[1]
    out = torch.empty((tokens, hidden), dtype=down.dtype, device=down.device)
    if tokens == 0:
        return out
    w = weights.contiguous()
    with direct_launches():
        _combine_launch[(tokens, triton.cdiv(hidden, COLUMNS))](
            down, position, bias if bias is not None else down, ids.reshape(-1).contiguous(), w, out, hidden, top_k,
            down.stride(0), bias.stride(0) if bias is not None else 0, w.stride(0), DT=DTYPE_CODE[down.dtype],
            HAS_BIAS=bias is not None, BLOCK=COLUMNS)
    return out


def prefill_kernels_run(x: torch.Tensor) -> bool:
    """Whether the Triton kernels here take ``x``'s device and dtype (CUDA, or the CPU under Triton's interpreter)."""
    return x.dtype in PREFILL_DTYPES and (x.is_cuda or (x.device.type == "cpu" and interpreting()))
