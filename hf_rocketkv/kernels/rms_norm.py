"""RMSNorm of one decode step's hidden states in one launch, in bfloat16 and float16, by one of three formulas
(``FORMULAS``): transformers' ``LlamaRMSNorm``, ``GptOssRMSNorm`` or ``GemmaRMSNorm``.

Why: the eager module is six to seven launches per norm (to fp32, square, mean, add eps and rsqrt, multiply, back to
the input dtype, multiply by the weight), 65 norms per decode step of a 32-layer model (two per layer and the final
one), ~0.4-0.5 ms of an 8.4 ms graphed batch-1 step of Llama-3.1-8B on an H200. Prefill keeps transformers' module.

Shapes: ``x`` [..., H] (the leading dimensions are rows, one program each; H up to ``MAX_HIDDEN``, any size),
``weight`` [H] in x's dtype; returns [..., H] in x's dtype, contiguous.

Formula (``LlamaRMSNorm.forward``): ``h = x.float(); h = h * rsqrt(mean(h * h, -1) + eps); weight * h.to(x.dtype)``.
The last product is a 16-bit product in eager PyTorch: the normalized value is rounded to x's dtype first, then
multiplied by the weight in fp32 (exact: two 8- or 11-bit significands) and rounded again; the kernel rounds at the
same two places (``round_to``: round to nearest even with integer operations, the same on every backend). Not bit
for bit: the sum of squares is reduced in another order than PyTorch's and ``rsqrt`` is the backend's, so an output
may differ from eager PyTorch by one unit in the last place of its dtype (``tests/kernels/test_rms_norm.py``
bounds it against a float64 oracle). fp32 inputs stay on transformers' formula (``rms_norm_supported``).

The two others take the product in fp32 and round once, at the end (``FP32_PRODUCT``):
``"gpt_oss"`` (``GptOssRMSNorm``): ``(weight * h).to(x.dtype)``; ``"gemma"`` (``GemmaRMSNorm``, also Gemma 2's and
3's, their q/k norms included): ``(h * (1 + weight.float())).type_as(x)``. Eager Gemma 3 spends ten launches per norm
and six norms per layer on it (a decode step of Gemma-3-12B: ~2,900 of its ~4,600 kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import DT_BF16, DT_FP16, PLAIN_TENSORS, interpreting, next_pow2, round_to
from .launch import TritonLaunch, direct_launches

NORM_DTYPES = {torch.bfloat16: DT_BF16, torch.float16: DT_FP16}
FORMULAS = {"llama": 0, "gpt_oss": 1, "gemma": 2}  # the kernel's FORMULA for each name (module docstring)
Norm = tuple[torch.Tensor, float]  # (weight [H], eps) of one RMSNorm module
MAX_HIDDEN = 32768  # one row in one block of registers (16 warps: 64 fp32 values per thread at the largest)


@triton.jit
def scaled(h, inv, w, DT: tl.constexpr, FORMULA: tl.constexpr):
    """``h`` (fp32) times its inverse RMS ``inv`` (broadcast against h), weighted by ``FORMULA`` with ``w`` (fp32)
    and rounded to dtype code DT where eager PyTorch rounds (the module docstring); returned in fp32, already
    rounded."""
    if FORMULA == 1:  # gpt-oss: (w * h) in fp32, one rounding
        out = round_to(w * (h * inv), DT)
    elif FORMULA == 2:  # Gemma: (h * (1 + w)) in fp32, one rounding
        out = round_to((h * inv) * (1.0 + w), DT)
    else:  # Llama
        normed = round_to(h * inv, DT)  # h.to(input_dtype)
        out = round_to(w * normed, DT)  # weight * h: a 16-bit product, exact in fp32 before its rounding
    return out


@triton.jit
def inverse_rms(sum_of_squares, hidden, eps):
    """``rsqrt(mean(h * h) + eps)`` in fp32 from a row's sum of squares (fp32 even where a caller passes eps as
    fp64, as inductor does)."""
    return tl.math.rsqrt((sum_of_squares / hidden + eps).to(tl.float32))


@triton.jit
def normalized(h, w, hidden, eps, DT: tl.constexpr, FORMULA: tl.constexpr):
    """One row ``h`` (fp32, masked columns 0) normalized by ``FORMULA`` with weight ``w`` (fp32), rounded to dtype
    code DT where eager PyTorch rounds (the module docstring); returned in fp32, already rounded."""
    return scaled(h, inverse_rms(tl.sum(h * h, axis=0), hidden, eps), w, DT, FORMULA)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, s_xr, hidden, eps,
                     DT: tl.constexpr, BLOCK: tl.constexpr, FORMULA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    h = tl.load(x_ptr + row * s_xr + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = normalized(h, w, hidden, eps, DT, FORMULA)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=ok)  # exact: already rounded


_rms_norm_launch = TritonLaunch(_rms_norm_kernel)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm_triton`` applies: a plain CUDA tensor (or a CPU one under Triton's interpreter,
    TRITON_INTERPRET=1), bf16/fp16, a 1-D weight of the last dimension's size in the same dtype and on the same
    device, a contiguous last dimension, at most ``MAX_HIDDEN`` columns. Called on every norm inside RocketKV calls:
    cheap checks first."""
    dtype = x.dtype
    if dtype not in NORM_DTYPES or weight.dtype != dtype or weight.dim() != 1 or x.dim() < 1:
        return False
    if type(x) is not torch.Tensor or type(weight) not in PLAIN_TENSORS:  # no subclass (DTensor...): raw pointers
        return False
    hidden = x.shape[-1]
    device = x.device
    return (
        0 < hidden <= MAX_HIDDEN and weight.shape[0] == hidden and weight.device == device
        and (x.stride(-1) == 1 or hidden == 1) and (weight.stride(0) == 1 or hidden == 1)
        and (device.type == "cuda" or (device.type == "cpu" and interpreting()))
    )


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, formula: str = "llama") -> torch.Tensor:
    """PyTorch twin: ``formula`` of the module docstring, step by step in eager PyTorch."""
    h = x.to(torch.float32)
    variance = (h * h).mean(dim=-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if formula == "gpt_oss":
        return (weight.to(torch.float32) * h).to(x.dtype)
    if formula == "gemma":
        return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)
    return weight * h.to(x.dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, formula: str = "llama") -> torch.Tensor:
    """Same contract as ``rms_norm_reference`` (``rms_norm_supported`` must hold; ``formula`` one of ``FORMULAS``)."""
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = out.numel() // hidden
    if rows == 0:
        return out
    x2 = x.reshape(rows, hidden)  # a view for the usual [B, 1, H] activations; a copy only for odd leading strides
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block = next_pow2(hidden)
    with direct_launches():
        _rms_norm_launch[(rows,)](
            x2, weight, out, x2.stride(0), hidden, float(eps),
            DT=NORM_DTYPES[x.dtype], BLOCK=block, FORMULA=FORMULAS[formula], num_warps=warps_for(block),
        )
    return out


def warps_for(block: int) -> int:
    """Warps per row: 8 fp32 values per thread up to 16 warps (a 4096-wide row), more per thread beyond."""
    return max(1, min(16, block // 256))
