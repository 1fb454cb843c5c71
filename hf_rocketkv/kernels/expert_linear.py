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

Two schedules of that contract (``schedule``; ``"auto"`` picks by the pairs per expert):

- ``pairs``: a program per (pair, column tile), each reading its pair's expert rows; an expert chosen by several
  pairs is read once per pair. For a few pairs (decode at small batches), where no expert is read twice anyway.
- ``grouped``: the pairs sorted by expert on the device (``argsort``, counts and starts by ``scatter_add``/``cumsum``:
  fixed shapes, no host sync, CUDA-graph safe), then a program per (expert, column tile) multiplies the rows of all
  of its pairs, ``GROUPED_BLOCK_M`` at a time, by the expert's weight tile (``tl.dot``, fp32 accumulation): each
  expert's weights are read once per step whatever the batch. For more pairs than experts (batched decode: at 32
  tokens of gpt-oss-20b, 128 pairs over 32 experts).

``expert_linear_reference`` is its PyTorch twin (the same contract: a gather of the chosen experts, a product in fp32,
one rounding); ``tests/kernels/test_expert_linear.py`` holds both to a float64 oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import DTYPE_CODE, PLAIN_TENSORS, interpreting, round_to
from .launch import TritonLaunch, direct_launches

EXPERT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) by layout. Transposed ([E, K, N], N contiguous: gpt-oss): the least
# summed time over 1, 2, 4 and 8 decode tokens at gpt-oss-20b's shapes on an H200 (benchmarks/expert_linear.py
# --sweep, 48 tiles). nn.Linear's ([E, N, K], K contiguous: Mixtral, Qwen-MoE): not swept.
DEFAULT_TILES = {True: (64, 128, 4, 4), False: (32, 128, 4, 3)}


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

GROUPED_BLOCK_M = 16  # pair rows per tl.dot (its least M)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped schedule by layout. Transposed: within 1% of the least time
# at 16-128 tokens of gpt-oss-20b on an H200 (benchmarks/expert_linear.py --sweep-grouped, 48 tiles). nn.Linear's: not
# swept.
GROUPED_TILES = {True: (128, 64, 4, 3), False: (64, 64, 4, 3)}


@triton.jit
def _expert_grouped_kernel(x_ptr, w_ptr, b_ptr, order_ptr, starts_ptr, counts_ptr, out_ptr, n_out, k_in, rows_per_x,
                           s_x, s_we, s_wk, s_wn, s_be, DT: tl.constexpr, HAS_BIAS: tl.constexpr,
                           IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    start = tl.load(starts_ptr + expert)
    count = tl.load(counts_ptr + expert)
    w_base = w_ptr + expert.to(tl.int64) * s_we + cols[None, :].to(tl.int64) * s_wn
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * s_be + cols, mask=col_ok, other=0.0).to(tl.float32)
    for m0 in range(0, count, BLOCK_M):
        slots = m0 + tl.arange(0, BLOCK_M)
        row_ok = slots < count
        pairs = tl.load(order_ptr + start + slots, mask=row_ok, other=0).to(tl.int64)
        x_rows = x_ptr + (pairs // rows_per_x) * s_x
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_in
            xk = tl.load(x_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + ks[:, None].to(tl.int64) * s_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:  # fp32 inputs (or the interpreter, whose dot takes no bf16): fp32 products, no TF32
                acc = tl.dot(xk.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:  # 16-bit inputs: their products are exact in the fp32 accumulator
                acc = tl.dot(xk, w, acc)
        if HAS_BIAS:
            acc += bias[None, :]
        tl.store(out_ptr + pairs[:, None] * n_out + cols[None, :], round_to(acc, DT).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


_expert_grouped_launch = TritonLaunch(_expert_grouped_kernel)
SCHEDULES = ("auto", "pairs", "grouped")


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
                         transposed: bool, rows_per_x: int = 1, tiles: tuple[int, int, int, int] | None = None,
                         schedule: str = "auto") -> torch.Tensor:
    """Same contract as ``expert_linear_reference`` (``expert_linear_supported`` must hold; ``ids`` in range).
    ``schedule``: ``"pairs"``, ``"grouped"`` (module docstring) or ``"auto"``: pairs while they are at most the
    experts, grouped beyond. ``tiles``: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` instead of the schedule's
    default (``benchmarks/expert_linear.py`` sweeps them)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"expert_linear_triton: schedule must be one of {SCHEDULES}, got {schedule!r}")
    k_in, n_out = _out_features(weight, transposed)
    pairs = ids.numel()
    out = torch.empty((pairs, n_out), dtype=x.dtype, device=x.device)
    if pairs == 0 or n_out == 0:
        return out
    s_wk, s_wn = (weight.stride(1), weight.stride(2)) if transposed else (weight.stride(2), weight.stride(1))
    experts = weight.shape[0]
    if schedule == "grouped" or (schedule == "auto" and pairs > experts):
        return _grouped(x, weight, bias, ids.reshape(-1), out, k_in, n_out, s_wk, s_wn, rows_per_x,
                        tiles or GROUPED_TILES[transposed])
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


def _grouped(x, weight, bias, ids, out, k_in, n_out, s_wk, s_wn, rows_per_x, tiles) -> torch.Tensor:
    """The grouped schedule: the pairs sorted by expert (device ops of fixed shapes), then one program per (expert,
    column tile)."""
    experts = weight.shape[0]
    order, counts, starts = sort_by_expert(ids, experts)
    block_n, block_k, warps, stages = tiles
    grid = (experts, triton.cdiv(n_out, block_n))
    with direct_launches():
        _expert_grouped_launch[grid](
            x, weight, bias if bias is not None else x, order, starts, counts, out, n_out, k_in, rows_per_x,
            x.stride(0), weight.stride(0), s_wk, s_wn, bias.stride(0) if bias is not None else 0,
            DT=DTYPE_CODE[x.dtype], HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or interpreting(),
            BLOCK_M=GROUPED_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
    return out


def sort_by_expert(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, counts, starts)`` of the pairs' expert ids ``[S]``: the pair indices expert by expert (stable,
    int32), and each expert's pair count and first place in ``order`` (int32 ``[E]``). Device ops of fixed shapes:
    no host sync, capturable in a CUDA graph."""
    order = torch.argsort(ids, stable=True).to(torch.int32)
    counts = torch.zeros(experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, ids.to(torch.int64), torch.ones_like(ids, dtype=torch.int32))
    starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).contiguous()
    return order, counts, starts
