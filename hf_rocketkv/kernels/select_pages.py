"""Triton twins of ``stage2_pages.select_pages`` (top-k pages per KV head, sink / recent pages forced) and of
``stage2_pages.top_pages`` (page scoring + selection from the token counts, the decode step's fused path).

Shapes (B batch, Hkv KV heads, G query heads per KV head, NP pages, K = min(topk, NP)):
    probs:   [B, Hkv, NP] fp32   page probabilities (>= 0; NaN and negatives rank as 0; pages >= n ignored)
    n_pages: [B] or [B, Hkv]     pages in use (top_pages takes ``lengths`` in tokens instead, n = ceil(len / P))
    returns  page_idx [B, Hkv, K] int64, page_valid [B, Hkv, K] bool

Semantics: exactly the reference's, including its canonical order (forced pages ascending, then the others by
descending score with the lower page id first on ties, then the invalid slots holding n, n+1, ...), so kernel and
reference agree element for element.

How: every page of a (row, KV head) becomes one unique int64 key that orders like the selection rule,
    key = class_and_score << 31 | (2**31 - 1 - page)
    class_and_score = 0x7FFFFFFF for a forced page, fp32 bits of max(score, 0) + 1 for another page in use (the bits
                      of non-negative floats order like the floats), 0 for a page not in use; -1 (whole key) for
                      padding lanes past NP,
and a descending sort (``tl.sort``, a bitonic network in registers) puts the K selected pages first. Two stages,
chosen from the shapes only (no host sync, fixed grids: CUDA-graph safe, any number of pages):
    chunk  grid (B*Hkv, S): program s sorts the keys of pages [s*CHUNK, (s+1)*CHUNK) and keeps its best KB
           (KB = next power of two >= K); with S == 1 it writes the answer directly (one launch).
    merge  grid (B*Hkv, S'): program m sorts the FANIN*KB keys of lists [m*FANIN, (m+1)*FANIN) and keeps the best
           KB; repeated until one list remains (log_FANIN(S) launches, FANIN <= MERGE_BLOCK / KB), the last
           writes the answer. Given arrival counters (``arrivals.py``) and a plan of one merge level, the merge
           runs in the chunk launch instead: the row's last chunk program to finish sorts every list (one launch).
``top_pages`` runs page_scores' logits pass (``page_logits_launch``), then the chunk kernel computes each page's
group-mean probability itself from those logits and the softmax statistics, so the probabilities are never
written: 2 launches for up to CHUNK pages (vs num_pages + page_scores + select_pages: 4-5).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import TritonLaunch

from ..selection.stage2_pages import check_forcing, check_softcap
from ._triton_common import cdiv, count_strides, interpreting, load_count, next_pow2
from .arrivals import check_counters, last_arrival
from .page_scores import kt_pages_per_row, page_logits_launch

# Launch defaults, swept by benchmarks/probes/bench_kernels.py: pages sorted by one chunk program, keys sorted by one merge
# program, and the sort on the GPU (tl.sort, or this file's own network; the interpreter always uses the network).
# H100, 2026-11-23 (results/h100_2026-11-23_bench_kernels.json), CUDA-graph replay per call, 8 KV heads:
# chunk 256 vs 1024 vs the old one-CTA radix select: 6.9 / 12.5 / 10.0 us at batch 1 x 575 pages, 9.7 / 13.2 / 19.3
# at batch 1 x 2050 pages, 23.1 / 60.4 / 21.7 at batch 64 x 575 pages. The network sort does not compile on Triton
# 3.6 (GPU uses tl.sort; the network serves the CPU interpreter only).
SELECT_CHUNK = 256
MERGE_BLOCK = 512
TL_SORT_ON_GPU = True


@triton.jit
def _page_keys(score, pages, n, sink_pages, recent_pages, num_pages):
    """The packed int64 rank key of each page (see the module docstring); larger = selected first."""
    in_use = pages < n
    forced = in_use & ((pages < sink_pages) | (pages >= n - recent_pages))
    bits = tl.where(score > 0.0, score.to(tl.int32, bitcast=True), 0)  # NaN, -0.0 and negatives rank as 0
    high = tl.where(forced, 2147483647, tl.where(in_use, bits + 1, 0))
    key = (high.to(tl.int64) << 31) | (2147483647 - pages).to(tl.int64)  # high < 2**31: key < 2**62
    return tl.where(pages < num_pages, key, -1)


@triton.jit
def _bitonic_step(x, N: tl.constexpr, s: tl.constexpr, jl: tl.constexpr):
    """One compare-exchange step of stage ``s``: the elements ``2**jl`` apart (see ``_bitonic_sort_desc``)."""
    outer: tl.constexpr = N >> (jl + 1)
    inner: tl.constexpr = 1 << jl
    first, second = tl.split(tl.permute(tl.reshape(x, [outer, 2, inner]), [0, 2, 1]))
    big = tl.maximum(first, second)
    small = tl.minimum(first, second)
    # the pair's first element is (o * 2 + 0) * inner + i: bit s of it is bit (s - jl - 1) of o
    o = tl.arange(0, outer)[:, None]
    descending = ((o >> (s - jl - 1)) & 1) == 0
    pair = tl.join(tl.where(descending, big, small), tl.where(descending, small, big))
    return tl.reshape(tl.permute(pair, [0, 2, 1]), [N])


@triton.jit
def _bitonic_sort_desc(x, LOG_N: tl.constexpr):
    """``x`` ([2**LOG_N], any int or float dtype) sorted in descending order by a bitonic network.

    Stage s merges blocks of 2**s (alternately descending / ascending, the last one descending); its steps compare
    the elements 2**jl apart. A step views x as [outer, inner, 2] with each pair on the last axis (reshape, then
    permute), splits the pairs, keeps max / min per pair in the block's direction and joins them back. Only
    builtin ops (no reductions, which Triton's interpreter runs far slower), so the CPU tests stay fast; on the GPU
    ``tl.sort`` is the default (``_sort_desc``). Each step is its own function so that its shape constants are
    bound once per call: a constexpr name rebound inside the loop compiles under the interpreter but not on the GPU
    (Triton 3.6: "constexpr cannot be reassigned").
    """
    N: tl.constexpr = 1 << LOG_N
    for s in tl.static_range(1, LOG_N + 1):
        for t in tl.static_range(s):
            x = _bitonic_step(x, N, s, s - 1 - t)
    return x


@triton.jit
def _sort_desc(x, LOG_N: tl.constexpr, TL_SORT: tl.constexpr):
    if TL_SORT:
        out = tl.sort(x, descending=True)
    else:
        out = _bitonic_sort_desc(x, LOG_N)
    return out


@triton.jit
def _write_selection(keys, idx_row, valid_row, n, k_out, N: tl.constexpr):
    """Slots 0..K-1 from keys sorted in descending order: page id and whether it is in use."""
    t = tl.arange(0, N)
    page = 2147483647 - (keys & 2147483647)
    tl.store(idx_row + t, page, mask=t < k_out)
    tl.store(valid_row + t, (page < n).to(tl.int1), mask=t < k_out)


@triton.jit
def _merge_lists(row_lists, keys_in, first, n, idx_row, valid_row, k_out, LOG_M: tl.constexpr, TL_SORT: tl.constexpr,
                 FROM_L2: tl.constexpr):
    """The final merge: keys ``[first, first + 2**LOG_M)`` of a row's ``keys_in`` listed keys (padding past them),
    sorted, written as the selection. ``FROM_L2``: lists other programs of this launch wrote (``.cg`` loads)."""
    e = tl.arange(0, 1 << LOG_M)
    if FROM_L2:
        keys = tl.load(row_lists + first + e, mask=first + e < keys_in, other=-1, cache_modifier=".cg")
    else:
        keys = tl.load(row_lists + first + e, mask=first + e < keys_in, other=-1)
    _write_selection(_sort_desc(keys, LOG_M, TL_SORT), idx_row, valid_row, n, k_out, 1 << LOG_M)


@triton.jit
def _select_chunk_kernel(
    probs_ptr, logits_ptr, stats_ptr, count_ptr, idx_ptr, valid_ptr, scratch_ptr, counter_ptr,
    s_cb, s_ch,
    num_kv_heads, num_pages, k_out, num_chunks, sink_pages, recent_pages, group, score_splits,
    LOG_CHUNK: tl.constexpr, KB: tl.constexpr, FINAL: tl.constexpr, COUNT_DIV: tl.constexpr,
    FROM_LOGITS: tl.constexpr, LOGIT_G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    TL_SORT: tl.constexpr, MERGE_LAST: tl.constexpr, LOG_M: tl.constexpr,
):
    CHUNK: tl.constexpr = 1 << LOG_CHUNK
    bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    n = load_count(count_ptr, b, h, s_cb, s_ch, num_pages, COUNT_DIV)
    pages = chunk * CHUNK + tl.arange(0, CHUNK)
    if FROM_LOGITS:
        # the group-mean probability of each page, from page_scores' pass 1 (logits in log2 units, per-split max
        # and sum): the same arithmetic as page_scores' pass 2, without writing the probabilities
        g = tl.arange(0, BLOCK_G)
        g_ok = g < group
        sp = tl.arange(0, BLOCK_S)
        st = stats_ptr + ((bh * score_splits + sp) * 2 * LOGIT_G)[:, None] + g[None, :]
        s_ok = (sp < score_splits)[:, None] & g_ok[None, :]
        m_s = tl.load(st, mask=s_ok, other=float("-inf"))
        l_s = tl.load(st + LOGIT_G, mask=s_ok, other=0.0)
        m = tl.max(m_s, axis=0)
        m_safe = tl.where(m > float("-inf"), m, 0.0)
        l_i = tl.sum(l_s * tl.exp2(m_s - m_safe[None, :]), axis=0)
        inv = tl.where(g_ok & (l_i > 0), 1.0 / (tl.maximum(l_i, 1e-30) * group), 0.0)
        s = tl.load(logits_ptr + (bh * LOGIT_G + g).to(tl.int64)[:, None] * num_pages + pages[None, :],
                    mask=g_ok[:, None] & (pages < n)[None, :], other=float("-inf"))
        score = tl.sum(tl.exp2(s - m_safe[:, None]) * inv[:, None], axis=0)
    else:
        score = tl.load(probs_ptr + bh.to(tl.int64) * num_pages + pages, mask=pages < n, other=0.0)
    keys = _sort_desc(_page_keys(score, pages, n, sink_pages, recent_pages, num_pages), LOG_CHUNK, TL_SORT)
    if FINAL:
        _write_selection(keys, idx_ptr + bh.to(tl.int64) * k_out, valid_ptr + bh.to(tl.int64) * k_out, n, k_out, CHUNK)
    else:
        t = tl.arange(0, CHUNK)
        tl.store(scratch_ptr + (bh * num_chunks + chunk).to(tl.int64) * KB + t, keys, mask=t < KB)
        if MERGE_LAST:  # the row's last chunk program to finish merges every chunk's list (arrivals.py)
            if last_arrival(counter_ptr + bh, num_chunks):
                _merge_lists(scratch_ptr + bh.to(tl.int64) * num_chunks * KB, num_chunks * KB, 0, n,
                             idx_ptr + bh.to(tl.int64) * k_out, valid_ptr + bh.to(tl.int64) * k_out, k_out, LOG_M,
                             TL_SORT, True)

_select_chunk_launch = TritonLaunch(_select_chunk_kernel)


@triton.jit
def _select_merge_kernel(
    in_ptr, out_ptr, count_ptr, idx_ptr, valid_ptr,
    s_cb, s_ch,
    num_kv_heads, num_pages, k_out, lists_in, lists_out,
    KB: tl.constexpr, LOG_M: tl.constexpr, FINAL: tl.constexpr, COUNT_DIV: tl.constexpr, TL_SORT: tl.constexpr,
):
    M: tl.constexpr = 1 << LOG_M  # FANIN lists of KB keys
    bh = tl.program_id(0)
    m = tl.program_id(1)
    first = m * M  # the lists of one row are contiguous: element e of this program's FANIN lists
    row_lists = in_ptr + bh.to(tl.int64) * lists_in * KB
    if FINAL:
        b = (bh // num_kv_heads).to(tl.int64)
        h = (bh % num_kv_heads).to(tl.int64)
        n = load_count(count_ptr, b, h, s_cb, s_ch, num_pages, COUNT_DIV)
        _merge_lists(row_lists, lists_in * KB, first, n, idx_ptr + bh.to(tl.int64) * k_out,
                     valid_ptr + bh.to(tl.int64) * k_out, k_out, LOG_M, TL_SORT, False)
    else:
        e = tl.arange(0, M)
        keys = _sort_desc(tl.load(row_lists + first + e, mask=first + e < lists_in * KB, other=-1), LOG_M, TL_SORT)
        tl.store(out_ptr + (bh * lists_out + m).to(tl.int64) * KB + e, keys, mask=e < KB)

_select_merge_launch = TritonLaunch(_select_merge_kernel)


def select_plan(num_pages: int, k: int, chunk: int | None = None, merge_block: int | None = None) -> dict:
    """The launch plan from the shapes: chunk size, number of chunks, key-list width KB, and per merge level its
    fan-in (lists merged by one program: at most MERGE_BLOCK // KB, fewer when fewer lists remain, so no program
    sorts mostly padding) and the list count it leaves (no levels: one chunk, one launch)."""
    kb = next_pow2(k)
    chunk = min(max(next_pow2(chunk or SELECT_CHUNK), 2 * kb), next_pow2(num_pages))
    num_chunks = cdiv(num_pages, chunk)
    max_fanin = max(2, next_pow2(merge_block or MERGE_BLOCK) // kb)
    fanins, levels = [], []
    lists = num_chunks
    while lists > 1:
        fanin = min(max_fanin, next_pow2(lists))
        lists = cdiv(lists, fanin)
        fanins.append(fanin)
        levels.append(lists)
    return {"chunk": chunk, "num_chunks": num_chunks, "kb": kb, "fanins": fanins, "levels": levels}


def _sort_warps(n: int) -> int:
    return 4 if n <= 512 else 8


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _select(
    counts: torch.Tensor, count_div: int, topk: int, sink_pages: int, recent_pages: int,
    shape: tuple[int, int, int], device: torch.device, probs: torch.Tensor | None = None, logits=None,
    chunk: int | None = None, merge_block: int | None = None, num_warps: int | None = None,
    use_tl_sort: bool | None = None, counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk kernel (from ``probs``, or from ``logits`` = page_logits_launch's (logits, stats, S, BLOCK_G) and the
    group size), then the merge levels. ``counters`` (``arrivals.py``): a plan of one merge level runs it in the
    chunk launch, by each row's last chunk program (one launch instead of two)."""
    batch, num_kv_heads, num_pages = shape
    k = min(topk, num_pages)
    page_idx = torch.empty((batch, num_kv_heads, k), dtype=torch.long, device=device)
    page_valid = torch.empty((batch, num_kv_heads, k), dtype=torch.bool, device=device)
    if page_idx.numel() == 0:
        return page_idx, page_valid
    s_cb, s_ch = count_strides(counts, batch, num_kv_heads, "n_pages" if count_div == 1 else "lengths")
    rows = batch * num_kv_heads
    plan = select_plan(num_pages, k, chunk, merge_block)
    # tl.sort on the GPU; the kernel's own bitonic network under the interpreter (where tl.sort is very slow)
    tl_sort = (TL_SORT_ON_GPU and not interpreting()) if use_tl_sort is None else use_tl_sort
    kb, levels = plan["kb"], plan["levels"]
    check_counters(counters, rows, device, "top_pages")
    merge_last = counters is not None and len(levels) == 1
    log_m = _log2(plan["fanins"][0] * kb) if merge_last else 0
    # one scratch buffer for every level's key lists (rows x lists x KB), ping-ponged by offset
    sizes = [plan["num_chunks"]] + levels[:-1]
    # (one chunk: no key lists; page_idx stands in for the unused pointer, saving an allocation)
    scratch = torch.empty((rows * kb * sum(sizes),), dtype=torch.int64, device=device) if levels else page_idx
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + rows * kb * size)
    if logits is not None:
        logit_buf, stats, splits, logit_g, group = logits
    else:
        logit_buf = stats = probs
        splits, logit_g, group = 1, 1, 1
    _select_chunk_launch[(rows, plan["num_chunks"])](
        probs if probs is not None else logit_buf, logit_buf, stats, counts, page_idx, page_valid, scratch,
        counters if merge_last else counts,  # (unused without merge_last)
        s_cb, s_ch,
        num_kv_heads, num_pages, k, plan["num_chunks"], sink_pages, recent_pages, group, splits,
        LOG_CHUNK=_log2(plan["chunk"]), KB=kb, FINAL=not levels, COUNT_DIV=count_div,
        FROM_LOGITS=logits is not None, LOGIT_G=logit_g, BLOCK_G=next_pow2(group), BLOCK_S=next_pow2(splits),
        TL_SORT=tl_sort, MERGE_LAST=merge_last, LOG_M=log_m,
        num_warps=num_warps or _sort_warps(max(plan["chunk"], 1 << log_m)),
    )
    if merge_last:
        return page_idx, page_valid
    lists = plan["num_chunks"]
    for level, (fanin, lists_out) in enumerate(zip(plan["fanins"], levels)):
        src = scratch[offsets[level]:]
        dst = scratch[offsets[level + 1]:] if lists_out > 1 else scratch
        _select_merge_launch[(rows, lists_out)](
            src, dst, counts, page_idx, page_valid,
            s_cb, s_ch,
            num_kv_heads, num_pages, k, lists, lists_out,
            KB=kb, LOG_M=_log2(fanin * kb), FINAL=lists_out == 1, COUNT_DIV=count_div, TL_SORT=tl_sort,
            num_warps=num_warps or _sort_warps(fanin * kb),
        )
        lists = lists_out
    return page_idx, page_valid


def select_pages_launch(
    probs: torch.Tensor, n_pages: torch.Tensor, topk: int, sink_pages: int = 0, recent_pages: int = 1,
    chunk: int | None = None, merge_block: int | None = None, num_warps: int | None = None,
    use_tl_sort: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher; ``chunk``, ``merge_block`` (pages / keys per program, powers of two), ``num_warps`` and
    ``use_tl_sort`` (None: tl.sort on the GPU, the kernel's own network under the interpreter) exist for tests and
    benchmarks."""
    check_forcing(topk, sink_pages, recent_pages)
    if probs.stride(-1) != 1 or probs.stride(1) != probs.shape[2] or probs.stride(0) != probs.shape[1] * probs.shape[2]:
        probs = probs.contiguous()
    return _select(n_pages, 1, topk, sink_pages, recent_pages, tuple(probs.shape), probs.device, probs=probs,
                   chunk=chunk, merge_block=merge_block, num_warps=num_warps, use_tl_sort=use_tl_sort)


def select_pages_triton(
    probs: torch.Tensor, n_pages: torch.Tensor, topk: int, sink_pages: int = 0, recent_pages: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``stage2_pages.select_pages``."""
    return select_pages_launch(probs, n_pages, topk, sink_pages, recent_pages)


def top_pages_launch(
    q: torch.Tensor, kt: torch.Tensor, lengths: torch.Tensor, page_size: int, topr: int, topk: int,
    sink_pages: int = 0, recent_pages: int = 1, score_splits: int | None = None, chunk: int | None = None,
    merge_block: int | None = None, num_warps: int | None = None, use_tl_sort: bool | None = None,
    table: torch.Tensor | None = None, per_head_bound: bool = False, softcap: float | None = None,
    scaling: float | None = None, counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher of the fused decode selection; the knobs exist for tests and benchmarks. ``table`` [B, MP] int32:
    ``kt`` is paged ``[N, Hkv, R, 2, D]`` (kernels/paged.py); None: contiguous ``[B, Hkv, NP, 2, D]``.
    ``softcap`` / ``scaling``: page logits soft-capped at the model's scale (``stage2_pages.top_pages``).
    ``counters``: int32 [>= B * Hkv], all 0 (``arrivals.py``): the merge in the chunk launch where one level does."""
    check_forcing(topk, sink_pages, recent_pages)
    check_softcap(softcap, scaling)
    batch, num_kv_heads, group, _ = q.shape
    num_pages = kt_pages_per_row(kt, table)
    if batch * num_kv_heads * num_pages == 0:
        return _select(lengths, page_size, topk, sink_pages, recent_pages, (batch, num_kv_heads, num_pages), q.device)
    logits, stats, splits, logit_g = page_logits_launch(q, kt, lengths, page_size, topr, score_splits, table=table,
                                                        per_head_bound=per_head_bound, softcap=softcap,
                                                        scaling=scaling)
    return _select(lengths, page_size, topk, sink_pages, recent_pages, (batch, num_kv_heads, num_pages), q.device,
                   logits=(logits, stats, splits, logit_g, group), chunk=chunk, merge_block=merge_block,
                   num_warps=num_warps, use_tl_sort=use_tl_sort, counters=counters)


def top_pages_triton(
    q: torch.Tensor, kt: torch.Tensor, lengths: torch.Tensor, page_size: int, topr: int, topk: int,
    sink_pages: int = 0, recent_pages: int = 1, per_head_bound: bool = False, softcap: float | None = None,
    scaling: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``stage2_pages.top_pages``."""
    return top_pages_launch(q, kt, lengths, page_size, topr, topk, sink_pages, recent_pages,
                            per_head_bound=per_head_bound, softcap=softcap, scaling=scaling)


def paged_top_pages_triton(
    q: torch.Tensor, kt_pages: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, kt_page_size: int,
    topr: int, topk: int, sink_pages: int = 0, recent_pages: int = 1, per_head_bound: bool = False,
    softcap: float | None = None, scaling: float | None = None, counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``paged.paged_top_pages_torch`` (the decode step's selection over a paged KT); ``counters``:
    ``top_pages_launch``'s."""
    return top_pages_launch(q, kt_pages, lengths, kt_page_size, topr, topk, sink_pages, recent_pages, table=table,
                            per_head_bound=per_head_bound, softcap=softcap, scaling=scaling, counters=counters)
