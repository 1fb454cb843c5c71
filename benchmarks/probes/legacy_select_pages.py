"""Frozen copy of the select_pages radix kernel as it was before the sort-based rewrite (commit c8996cc), kept only
so that bench_kernels.py and decode_ops_scaling.py can time old against new. Not part of the package."""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from hf_rocketkv.selection import stage2_pages
from hf_rocketkv.kernels._triton_common import next_pow2

# Above this many pages per row torch.topk (the reference) is faster than one program per row scanning the row
# 5 times (H100, 2026-11-22: 8.3k pages 53 vs 59 us, 25k pages 156 vs 71 us; 576 pages 6.4 vs 29 us).
TORCH_TOPK_ABOVE_PAGES = 8192


@triton.jit
def _select_pages_kernel(
    probs_ptr, npages_ptr, idx_ptr, valid_ptr,
    num_kv_heads, num_pages, k_out,
    BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr, USE_HISTOGRAM: tl.constexpr,
):
    NBINS: tl.constexpr = 1 << DIGIT_BITS
    ROUNDS: tl.constexpr = 32 // DIGIT_BITS
    bh = tl.program_id(0)
    b = bh // num_kv_heads
    probs_row = probs_ptr + bh.to(tl.int64) * num_pages
    idx_row = idx_ptr + bh.to(tl.int64) * k_out
    valid_row = valid_ptr + bh.to(tl.int64) * k_out
    n = tl.minimum(tl.load(npages_ptr + b).to(tl.int32), num_pages)
    n = tl.maximum(n, 0)
    kk = tl.minimum(k_out, n)  # pages taken
    cand = n - 1  # candidates by probability: pages 0 .. n-2 (page n-1 is forced)
    need = kk - 1  # how many candidates to take
    bins = tl.arange(0, NBINS)
    offs = tl.arange(0, BLOCK)

    # radix select, most significant digit first: prefix = bit pattern of the need-th largest candidate key,
    # remaining = how many candidates equal to it are still to take
    prefix = 0
    remaining = need
    for it in tl.static_range(ROUNDS):
        shift = 32 - DIGIT_BITS * (it + 1)  # constexpr: `it` is a static_range index
        hist = tl.zeros((NBINS,), tl.int32)
        for p0 in range(0, cand, BLOCK):
            pages = p0 + offs
            x = tl.load(probs_row + pages, mask=pages < cand, other=0.0)
            key = tl.where(x > 0.0, x.to(tl.int32, bitcast=True), 0)  # NaN and -0.0 rank as 0
            if it == 0:
                match = pages < cand
            else:
                match = (pages < cand) & (((key ^ prefix) >> (shift + DIGIT_BITS)) == 0)
            digit = (key >> shift) & (NBINS - 1)
            if USE_HISTOGRAM:
                hist += tl.histogram(digit, NBINS, mask=match)
            else:
                hist += tl.sum(((digit[:, None] == bins[None, :]) & match[:, None]).to(tl.int32), axis=0)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # candidates with digit >= d
        d_star = tl.sum((at_or_above >= remaining).to(tl.int32), axis=0) - 1
        remaining -= tl.sum(tl.where(bins > d_star, hist, 0), axis=0)
        prefix = prefix | (d_star << shift)

    # compaction: keys above the threshold, the first `remaining` ties, and the newest page, in page order
    taken = 0
    ties_seen = 0
    for p0 in range(0, n, BLOCK):
        pages = p0 + offs
        is_cand = pages < cand
        x = tl.load(probs_row + pages, mask=is_cand, other=0.0)
        key = tl.where(x > 0.0, x.to(tl.int32, bitcast=True), 0)
        tie = is_cand & (key == prefix)
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1 + ties_seen
        take = (is_cand & (key > prefix)) | (tie & (tie_rank < remaining)) | (pages == n - 1)
        pos = tl.cumsum(take.to(tl.int32), axis=0) - 1 + taken
        tl.store(idx_row + pos, pages.to(tl.int64), mask=take)
        tl.store(valid_row + pos, tl.full((BLOCK,), 1, tl.int1), mask=take)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        taken += tl.sum(take.to(tl.int32), axis=0)
    # invalid tail: slots kk .. K-1 get the unused page ids n, n+1, ...
    for t0 in range(kk, k_out, BLOCK):
        t = t0 + offs
        tl.store(idx_row + t, (n + t - kk).to(tl.int64), mask=t < k_out)
        tl.store(valid_row + t, tl.full((BLOCK,), 0, tl.int1), mask=t < k_out)


# tl.histogram takes a mask in recent Triton releases; older ones get the one-hot sum instead
HAS_MASKED_HISTOGRAM = "mask" in inspect.signature(tl.histogram).parameters


def select_pages_launch(
    probs: torch.Tensor, n_pages: torch.Tensor, topk: int, digit_bits: int = 8, use_histogram: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher; ``digit_bits`` (4 or 8) and ``use_histogram`` exist for tests and benchmarks."""
    batch, num_kv_heads, num_pages = probs.shape
    k = min(topk, num_pages)
    page_idx = torch.empty((batch, num_kv_heads, k), dtype=torch.long, device=probs.device)
    page_valid = torch.empty((batch, num_kv_heads, k), dtype=torch.bool, device=probs.device)
    if page_idx.numel() == 0:
        return page_idx, page_valid
    block = min(next_pow2(num_pages), 512)
    wrap_triton(_select_pages_kernel)[(batch * num_kv_heads,)](
        probs.contiguous(), n_pages, page_idx, page_valid,
        num_kv_heads, num_pages, k,
        BLOCK=block, DIGIT_BITS=digit_bits,
        USE_HISTOGRAM=HAS_MASKED_HISTOGRAM if use_histogram is None else use_histogram,
        num_warps=4 if block <= 256 else 8,
    )
    return page_idx, page_valid


def select_pages_triton(probs: torch.Tensor, n_pages: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``stage2_pages.select_pages``."""
    if probs.shape[-1] > TORCH_TOPK_ABOVE_PAGES:
        return stage2_pages.select_pages(probs, n_pages, topk)
    return select_pages_launch(probs, n_pages, topk)
