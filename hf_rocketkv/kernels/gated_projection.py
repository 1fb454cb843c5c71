"""A decode step's MLP projections in one launch each for a few rows: ``act(x @ gate.T) * (x @ up.T)`` (both weights
read once), then ``h @ down.T``.

Why: a decode step of a Llama- or Gemma-style model runs ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` per layer:
at a few rows that is three weight-bound GEMMs (cuBLAS picks split-K kernels plus a reduce each at 1-16 rows), an
activation and a product, six to nine launches per layer. The kernel here reads the weights tile by tile with no
split of the reduction (each program owns ``BLOCK_C`` output columns and walks the whole reduction dimension): gated,
it reads ``gate`` and ``up`` in one launch and applies the activation and the product to its tile before one store;
plain, it is one projection ``x @ weight.T`` (``down_proj``).

Shapes: ``x`` [rows, hidden] (rows up to ``MAX_ROWS``; the caller flattens [B, T, hidden]), ``gate`` / ``up``
[inter, hidden], ``weight`` [out, in] (``nn.Linear`` weights: no bias, the reduction dimension contiguous), all in
one 16-bit dtype; returns [rows, inter] (gated) or [rows, out] (plain) in that dtype.

Formula and rounding (``gated_projection_reference`` / ``projection_reference``, transformers' eager module step by
step): ``g = x @ gate.T`` and ``u = x @ up.T`` rounded to the dtype (each a GEMM's output), ``a = act(g)`` computed
in fp32 and rounded (a 16-bit activation computes in fp32), ``a * u`` computed in fp32 and rounded; a plain
projection's output is rounded once. ``act``: ``"silu"`` (``g / (1 + exp(-g))``) or ``"gelu_tanh"`` (``0.5 g (1 +
tanh(sqrt(2/pi) (g + 0.044715 g^3)))``). Not bit for bit: the reductions run in another order than cuBLAS's and
``exp`` / ``tanh`` are the backend's, so an output may differ from eager PyTorch by a few units in the last place
(``tests/kernels/test_gated_projection.py`` bounds it against a float64 oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import DT_BF16, DT_FP16, PLAIN_TENSORS, cdiv, interpreting, round_to, tanh_f32
from .projection_tile import column_sums
from .launch import TritonLaunch, direct_launches

PROJECTION_DTYPES = {torch.bfloat16: DT_BF16, torch.float16: DT_FP16}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # the kernel's ACT for each name (module docstring)
PLAIN_ACT = -1  # the kernel's ACT for a plain projection (one weight, no activation): ACT < 0
MAX_ROWS = 64  # a decode step's tokens; beyond, two cuBLAS GEMMs at full tiles are the faster way


@triton.jit
def _gated_projection_kernel(x_ptr, gate_ptr, up_ptr, out_ptr, rows, cols, hidden, s_xr, s_gc, s_uc, s_or,
                             DT: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = r < rows, c < cols
    # gated: up_proj beside gate_proj
    acc_g, acc_u = column_sums(x_ptr, gate_ptr, up_ptr, r, c, r_ok, c_ok, hidden, s_xr, s_gc, s_uc, ACT >= 0, EVEN_K,
                               IEEE, BLOCK_R, BLOCK_C, BLOCK_K)
    g = round_to(acc_g, DT)  # gate_proj(x) (or the plain projection): a GEMM's output in the dtype
    if ACT < 0:  # a plain projection
        out = g
    else:
        u = round_to(acc_u, DT)  # up_proj(x)
        if ACT == 1:  # gelu, tanh approximation
            a = 0.5 * g * (1.0 + tanh_f32(0.7978845608028654 * (g + 0.044715 * g * g * g)))
        else:  # silu
            a = g / (1.0 + tl.exp(-g))
        out = round_to(round_to(a, DT) * u, DT)
    out_ptrs = out_ptr + r[:, None].to(tl.int64) * s_or + c[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


_gated_projection_launch = TritonLaunch(_gated_projection_kernel)


def _supported(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> bool:
    dtype = x.dtype
    if dtype not in PROJECTION_DTYPES or type(x) is not torch.Tensor or x.dim() < 1:
        return False  # no subclass (DTensor, quantized weights): raw pointers
    hidden, device = x.shape[-1], x.device
    if not (0 < x.numel() // max(hidden, 1) <= MAX_ROWS and hidden > 0 and x.stride(-1) == 1
            and (device.type == "cuda" or (device.type == "cpu" and interpreting()))):
        return False
    shape = weights[0].shape
    return all(
        type(w) in PLAIN_TENSORS and w.dtype == dtype and w.dim() == 2 and w.shape == shape and w.shape[1] == hidden
        and w.stride(1) == 1 and w.device == device for w in weights
    )


def gated_projection_supported(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``gated_projection_triton`` applies: plain CUDA tensors (CPU ones under Triton's interpreter), one
    16-bit dtype, ``x`` [..., hidden] with at most ``MAX_ROWS`` rows and a contiguous last dimension, ``gate`` /
    ``up`` [inter, hidden] of one shape with the hidden dimension contiguous. Called on every MLP of a RocketKV
    forward: cheap checks first."""
    return _supported(x, (gate, up))


def projection_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``projection_triton`` applies: as ``gated_projection_supported`` for one weight [out, in]."""
    return _supported(x, (weight,))


def gated_projection_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """PyTorch twin: the module docstring's formula, as transformers' eager module runs it."""
    g = torch.nn.functional.linear(x, gate)
    u = torch.nn.functional.linear(x, up)
    if act == "gelu_tanh":
        a = torch.nn.functional.gelu(g, approximate="tanh")
    else:
        a = torch.nn.functional.silu(g)
    return a * u


def projection_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of ``projection_triton``: ``nn.Linear`` without a bias."""
    return torch.nn.functional.linear(x, weight)


def _tiles(rows: int, gated: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_R, BLOCK_C, BLOCK_K, warps, stages) for ``rows`` rows: the least row block ``tl.dot`` takes that holds
    them, and the column and reduction tiles measured best (``benchmarks/probes/tune_gated_projection.py``, 14 tile
    choices at 1, 16 and 64 rows, Llama-3.1-8B and Gemma-3-12B shapes). Gated: within 1 us of the best at every point
    on one H200 (``results/h200_2026-12-05_tune_gated_projection.json``: 56-63 us against cuBLAS's 63-70) and within
    2 us on one H100 (``results/h100_2026-12-05_tune_projections.json``: 82-85 us against 89-98). Plain
    (``down_proj``): one weight per stage instead of two, so deeper pipelines; on that H100 43-45 us against cuBLAS's
    46 at 1 and 16 rows with 256-wide reduction tiles, 47-49 against 48-50 at 64 rows with 128-wide ones (the
    largest that fit five stages at that row block)."""
    block_r = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    if gated:
        return block_r, 32, 128, 4, 3
    return block_r, 32, 256 if rows <= 16 else 128, 4, 5


def _launch(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, act: int,
            tiles: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    hidden, cols = x.shape[-1], first.shape[0]
    rows = x.numel() // hidden
    out = torch.empty((*x.shape[:-1], cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x2 = x.reshape(rows, hidden)
    block_r, block_c, block_k, warps, stages = tiles or _tiles(rows, act != PLAIN_ACT)
    grid = (cdiv(cols, block_c), cdiv(rows, block_r))
    with direct_launches():
        _gated_projection_launch[grid](
            x2, first, second, out, rows, cols, hidden, x2.stride(0), first.stride(0), second.stride(0), cols,
            DT=PROJECTION_DTYPES[x.dtype], ACT=act, EVEN_K=hidden % block_k == 0,
            IEEE=interpreting(), BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
    return out


def gated_projection_triton(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str,
                            tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Same contract as ``gated_projection_reference`` (``gated_projection_supported`` must hold; ``act`` one of
    ``ACTIVATIONS``). ``tiles``: (BLOCK_R, BLOCK_C, BLOCK_K, warps, stages) instead of the measured choice (the
    tuning probe)."""
    return _launch(x, gate, up, ACTIVATIONS[act], tiles)


def projection_triton(x: torch.Tensor, weight: torch.Tensor,
                      tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Same contract as ``projection_reference`` (``projection_supported`` must hold): ``x @ weight.T``, ``[...,
    out]``. ``tiles`` as for ``gated_projection_triton``."""
    return _launch(x, weight, weight, PLAIN_ACT, tiles)
