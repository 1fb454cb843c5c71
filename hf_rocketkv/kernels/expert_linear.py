"""One linear layer of the experts a few tokens were routed to, reading each expert's weights where they lie.

Why: at decode a mixture-of-experts layer runs ``tokens x top_k`` (token, expert) pairs, a handful. transformers'
``batched_mm`` experts first gathers the chosen experts' weights into a new tensor (``gate_up_proj[expert_ids]``),
then multiplies: the weights cross memory three times (read, write, read again). On gpt-oss-20b shapes at batch 1
those gathers were 2.35 ms of a 7.1 ms decode step on an H200 (96 ``vectorized_gather_kernel`` launches). This
kernel reads each pair's expert weights once, from the parameter itself.

Shapes: ``x`` [T, K] (a row per token; pair ``s`` reads row ``s // rows_per_x``), ``weight`` [E, K, N]
(``transposed=True``: input dimension first, gpt-oss' layout) or [E, N, K] (``transposed=False``, ``nn.Linear``'s),
``bias`` [E, N] or None, ``ids`` [S] integer expert ids in ``[0, E)``; returns ``out`` [S, N] in x's dtype with
``out[s] = x[s // rows_per_x] @ W[ids[s]] + bias[ids[s]]``, the products summed in fp32 and rounded once.

``expert_linear_reference`` is its PyTorch twin (the same contract: a gather of the chosen experts, a product in fp32,
one rounding); ``tests/kernels/test_expert_linear.py`` holds both to a float64 oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import DTYPE_CODE, interpreting, round_to
from .launch import TritonLaunch, direct_launches

EXPERT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) by layout. Transposed ([E, K, N], N contiguous: gpt-oss): the least
# summed time over 1, 2, 4 and 8 decode tokens at gpt-oss-20b's shapes on an H200 (benchmarks/expert_linear.py
# --sweep, 48 tiles). nn.Linear's ([E, N, K], K contiguous: Mixtral, Qwen-MoE): not swept.
DEFAULT_TILES = {True: (64, 128, 4, 4), False: (32, 128, 4, 3)}
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@triton.jit
def _expert_linear_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, out_ptr, n_out, k_in, rows_per_x, s_x, s_we, s_wk, s_wn,
                          s_be, DT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // rows_per_x) * s_x
    w_base = w_ptr + expert * s_we + cols[None, :].to(tl.int64) * s_wn
    partial = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)  # reduced over K once, after the loop
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        xk = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_base + ks[:, None].to(tl.int64) * s_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        partial += xk[:, None] * w.to(tl.float32)
    acc = tl.sum(partial, axis=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * s_be + cols, mask=col_ok, other=0.0).to(tl.float32)
    # rounded to the output dtype as torch rounds (to nearest even) on every backend, then stored exactly
    tl.store(out_ptr + pair * n_out + cols, round_to(acc, DT).to(out_ptr.dtype.element_ty), mask=col_ok)


_expert_linear_launch = TritonLaunch(_expert_linear_kernel)


def expert_linear_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``expert_linear_triton`` applies: plain tensors on one CUDA device (or the CPU under Triton's
    interpreter), one dtype of ``EXPERT_DTYPES`` throughout, ``x`` 2-D with a contiguous last dimension, ``weight``
    3-D, ``bias`` [E, N] contiguous in its last dimension."""
    dtype, device = x.dtype, x.device
    if dtype not in EXPERT_DTYPES or weight.dtype != dtype or x.dim() != 2 or weight.dim() != 3:
        return False
    if type(x) is not torch.Tensor or type(weight) not in PLAIN_TENSORS:  # no subclass (DTensor...): raw pointers
        return False
    if bias is not None and (type(bias) not in PLAIN_TENSORS or bias.dtype != dtype or bias.dim() != 2
                             or bias.device != device or bias.stride(-1) != 1):
        return False
    return (weight.device == device and x.stride(-1) == 1
            and (device.type == "cuda" or (device.type == "cpu" and interpreting())))


def _out_features(weight: torch.Tensor, transposed: bool) -> tuple[int, int]:
    """``(K, N)``: input and output features of ``weight`` in its layout."""
    return (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])


def expert_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                            transposed: bool, rows_per_x: int = 1) -> torch.Tensor:
    """PyTorch twin of the module docstring's contract: the experts gathered, the product in fp32, one rounding."""
    rows = x.repeat_interleave(rows_per_x, dim=0) if rows_per_x > 1 else x
    chosen = weight[ids].to(torch.float32)
    if not transposed:
        chosen = chosen.transpose(1, 2)
    out = torch.bmm(rows.to(torch.float32).unsqueeze(1), chosen).squeeze(1)
    if bias is not None:
        out = out + bias[ids].to(torch.float32)
    return out.to(x.dtype)


def expert_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                         transposed: bool, rows_per_x: int = 1, tiles: tuple[int, int, int] | None = None
                         ) -> torch.Tensor:
    """Same contract as ``expert_linear_reference`` (``expert_linear_supported`` must hold; ``ids`` in range).
    ``tiles``: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` instead of the layout's default (``benchmarks/expert_linear.py``
    sweeps them)."""
    k_in, n_out = _out_features(weight, transposed)
    pairs = ids.numel()
    out = torch.empty((pairs, n_out), dtype=x.dtype, device=x.device)
    if pairs == 0 or n_out == 0:
        return out
    s_wk, s_wn = (weight.stride(1), weight.stride(2)) if transposed else (weight.stride(2), weight.stride(1))
    block_n, block_k, warps, stages = tiles or DEFAULT_TILES[transposed]
    grid = (pairs, triton.cdiv(n_out, block_n))
    with direct_launches():
        _expert_linear_launch[grid](
            x, weight, bias if bias is not None else x, ids.reshape(-1), out, n_out, k_in, rows_per_x, x.stride(0),
            weight.stride(0), s_wk, s_wn, bias.stride(0) if bias is not None else 0,
            DT=DTYPE_CODE[x.dtype], HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
            num_stages=stages,
        )
    return out
