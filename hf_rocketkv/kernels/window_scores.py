"""Triton twin of ``stage1_snapkv.window_scores`` (stage 1, once per prompt and layer, after prefill attention).

Shapes (B batch, Hq = Hkv*G query heads, w window queries, N stored slots, D head_dim):
    q_window: [B, Hq, w, D]   post-RoPE queries of the last w prompt tokens (any strides)
    keys:     [B, Hkv, N, D]  post-RoPE keys in slot order (any strides), fp32 / fp16 / bf16
    start, end: [B] int       row b's valid slots are [start[b], end[b]); window query i sits at slot end[b]-w+i
    scaling:  float
    returns   [B, Hkv, N] fp32: softmax(q k^T * scaling) over the visible keys (start <= slot <= the query's slot),
              computed in fp32 per query row, summed over the w window queries and the G heads of the group.

The [G*w, N] probability matrix is never materialised. The G*w query rows of a KV head are treated as one [R, D]
block (R = G*w), so every key is read for the whole group at once:
    pass 1  grid (B*Hkv, row blocks, key chunks): online softmax max / sum of every row over one chunk of keys
            -> partial statistics [B*Hkv, chunks, R] (a few KB);
    pass 2  grid (B*Hkv, key blocks): each program holds one [BLOCK_N, D] key block and loops over the R rows,
            accumulating exp(s - lse) over rows -> the output column block, written once (no atomics). Each
            program first combines pass 1's statistics of its rows into their log-sum-exp (+inf for a row that sees
            no key: probability 0): a few KB of loads, instead of a dozen small PyTorch launches between the passes
            (this runs once per layer on a prefill's host-bound path).
Keys are read twice in total; logits use half-precision tensor-core dots (exact products, fp32 accumulation), fp32
keys use an fp32 dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import TritonLaunch

from ._triton_common import cdiv, interpreting, next_pow2, num_sms

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(q_ptr, b, h, rows, d, group, window, head_dim, s_qb, s_qh, s_qw, s_qd, FP32: tl.constexpr):
    r_ok = rows < group * window
    g = rows // window
    i = rows % window
    ptr = q_ptr + b * s_qb + (h * group + g).to(tl.int64)[:, None] * s_qh + i[:, None] * s_qw + d[None, :] * s_qd
    q = tl.load(ptr, mask=r_ok[:, None] & (d < head_dim)[None, :], other=0.0)
    if FP32:
        q = q.to(tl.float32)
    return q, r_ok, i


@triton.jit
def _logits(q, k, FP32: tl.constexpr):
    if FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


# prompt-length-derived ints unspecialised: one compiled kernel for every prompt length (Triton would compile
# again for each new divisibility by 16 or value 1 of them, ~0.5 s in the middle of a request's prefill)
@triton.jit(do_not_specialize=["chunk", "num_chunks"])
def _window_stats_kernel(
    q_ptr, k_ptr, start_ptr, end_ptr, stats_ptr,
    s_qb, s_qh, s_qw, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    num_kv_heads, group, window, head_dim, chunk, num_chunks, num_rows_pad,
    scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32: tl.constexpr,
):
    bh = tl.program_id(0)
    rb = tl.program_id(1)
    c = tl.program_id(2)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    q, r_ok, i = _load_rows(q_ptr, b, h, rows, d, group, window, head_dim, s_qb, s_qh, s_qw, s_qd, FP32)
    start = tl.load(start_ptr + b).to(tl.int32)
    end = tl.load(end_ptr + b).to(tl.int32)
    q_slot = end - window + i
    lo = tl.maximum(start, c * chunk)
    hi = tl.minimum(end, (c + 1) * chunk)
    k_base = k_ptr + b * s_kb + h * s_kh + d[None, :] * s_kd
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        n_ok = slots < hi
        k = tl.load(k_base + slots.to(tl.int64)[:, None] * s_kn, mask=n_ok[:, None] & (d < head_dim)[None, :],
                    other=0.0)
        s = (_logits(q, k, FP32) * scale_log2).to(tl.float32)  # inductor passes Python floats as fp64
        vis = n_ok[None, :] & (slots[None, :] <= q_slot[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m_i = m_new
    out = stats_ptr + ((bh * num_chunks + c) * 2 * num_rows_pad + rows)
    tl.store(out, m_i)
    tl.store(out + num_rows_pad, l_i)

_window_stats_launch = TritonLaunch(_window_stats_kernel)


@triton.jit
def _row_lse(stats_ptr, bh, rows, r_ok, num_chunks, num_rows_pad, BLOCK_M: tl.constexpr):
    """Log2-sum-exp2 of each row over the chunks' partial (max, sum) from pass 1; +inf for a row that sees no key
    (its probabilities are then 0) or is padding."""
    base = stats_ptr + bh.to(tl.int64) * num_chunks * 2 * num_rows_pad + rows
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for c in range(0, num_chunks):
        m = tl.maximum(m, tl.load(base + c * 2 * num_rows_pad, mask=r_ok, other=float("-inf")))
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    total = tl.zeros((BLOCK_M,), tl.float32)
    for c in range(0, num_chunks):
        m_c = tl.load(base + c * 2 * num_rows_pad, mask=r_ok, other=float("-inf"))
        l_c = tl.load(base + c * 2 * num_rows_pad + num_rows_pad, mask=r_ok, other=0.0)
        total += l_c * tl.exp2(m_c - m_safe)
    return tl.where(total > 0, m_safe + tl.log2(total), float("inf"))


@triton.jit(do_not_specialize=["num_slots", "num_chunks"])  # (as _window_stats_kernel)
def _window_accum_kernel(
    q_ptr, k_ptr, start_ptr, end_ptr, stats_ptr, out_ptr,
    s_qb, s_qh, s_qw, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    num_kv_heads, group, window, head_dim, num_slots, num_chunks, num_rows_pad,
    scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    slots = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(start_ptr + b).to(tl.int32)
    end = tl.load(end_ptr + b).to(tl.int32)
    n_ok = (slots < num_slots) & (slots >= start) & (slots < end)
    k = tl.load(k_ptr + b * s_kb + h * s_kh + slots.to(tl.int64)[:, None] * s_kn + d[None, :] * s_kd,
                mask=n_ok[:, None] & (d < head_dim)[None, :], other=0.0)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for r0 in range(0, group * window, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        q, r_ok, i = _load_rows(q_ptr, b, h, rows, d, group, window, head_dim, s_qb, s_qh, s_qw, s_qd, FP32)
        lse = _row_lse(stats_ptr, bh, rows, r_ok, num_chunks, num_rows_pad, BLOCK_M)
        s = (_logits(q, k, FP32) * scale_log2).to(tl.float32)  # inductor passes Python floats as fp64
        vis = n_ok[None, :] & (slots[None, :] <= (end - window + i)[:, None]) & r_ok[:, None]
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        acc += tl.sum(p, axis=0)
    tl.store(out_ptr + bh.to(tl.int64) * num_slots + slots, acc, mask=slots < num_slots)

_window_accum_launch = TritonLaunch(_window_accum_kernel)


def window_scores_triton(
    q_window: torch.Tensor, keys: torch.Tensor, start: torch.Tensor, end: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Same contract as ``stage1_snapkv.window_scores``."""
    batch, num_q_heads, window, head_dim = q_window.shape
    num_kv_heads, num_slots = keys.shape[1], keys.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty((batch, num_kv_heads, num_slots), dtype=torch.float32, device=keys.device)
    if out.numel() == 0 or window == 0:
        return out.zero_()
    fp32 = keys.dtype == torch.float32 or q_window.dtype != keys.dtype or interpreting()
    block_d = next_pow2(head_dim)
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 128 else 32
    num_rows = group * window
    row_blocks = cdiv(num_rows, block_m)
    rows_pad = row_blocks * block_m
    rows = batch * num_kv_heads
    num_chunks = max(1, min(cdiv(num_slots, 8 * block_n), cdiv(2 * num_sms(keys.device), rows * row_blocks)))
    chunk = cdiv(cdiv(num_slots, num_chunks), block_n) * block_n
    num_chunks = cdiv(num_slots, chunk)
    scale_log2 = scaling * LOG2E
    stats = torch.empty((rows, num_chunks, 2, rows_pad), dtype=torch.float32, device=keys.device)
    strides = (*q_window.stride(), *keys.stride())
    _window_stats_launch[(rows, row_blocks, num_chunks)](
        q_window, keys, start, end, stats,
        *strides,
        num_kv_heads, group, window, head_dim, chunk, num_chunks, rows_pad,
        scale_log2,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, FP32=fp32,
        num_warps=4, num_stages=3,
    )
    _window_accum_launch[(rows, cdiv(num_slots, block_n))](
        q_window, keys, start, end, stats, out,
        *strides,
        num_kv_heads, group, window, head_dim, num_slots, num_chunks, rows_pad,
        scale_log2,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, FP32=fp32,
        num_warps=4, num_stages=2,
    )
    return out
