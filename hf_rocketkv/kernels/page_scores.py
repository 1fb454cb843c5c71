"""Triton twin of ``stage2_pages.page_scores``: signed min/max page scoring, softmax over pages, mean over the group.

Shapes (B batch, Hkv KV heads, G query heads per KV head, NP pages, D head_dim):
    q:       [B, Hkv, G, D]      the decode query (any float dtype, any strides); rounded to the KT dtype first
    kt:      [B, Hkv, NP, 2, D]  KT summaries (fp32 / fp16 / bf16 / float8_e5m2): [..., 0, :] min, [..., 1, :] max
    n_pages: [B] or [B, Hkv]     int, pages in use per row (or per row and KV head); pages past it get probability 0
    topr:    int                 channels used (top ``topr`` of sum_g |q| per KV head); >= D means all
    returns  probs [B, Hkv, NP] fp32

Per (row, KV head), fused in one kernel: the top-r channel mask (rank of each channel's group-summed |q|, ties to
the lower channel index; torch.topk leaves tie order unspecified), the per-channel sign of the group-summed q
(Kmax where > 0, else Kmin, chosen in registers after contiguous loads of both), the scores of all G heads
as one [G, D] x [D, pages] dot (G padded to 16; fp8 KT is widened to fp16 exactly), softmax over the row's pages at
1/sqrt(D) and the mean over the G heads.

Two schedules, chosen from the shapes only (no host sync, CUDA-graph safe):
    fused  (one launch)   grid (B*Hkv,): each program loops over all its pages twice; pass 1 writes the logits to
                          a small fp32 scratch [B, Hkv, G, NP] and keeps the online softmax max/sum, pass 2 reads
                          them back and writes the group mean. Used when a row has at most PAGES_PER_PROGRAM pages.
    split  (two launches) grid (B*Hkv, S): S programs of ~PAGES_PER_PROGRAM pages per row (fewer when the batch
                          fills the GPU); pass 1 also writes each program's (max, sum) per head, a second kernel
                          combines the S partial statistics and writes the probabilities. Measured on an H100
                          (2026-11-22, fp8 KT, batch 1, 576 pages): fused 50 us, split in 3: 20 us (CUDA graphs).
                          S = min(pages / 128, 2 * SMs / (B * Hkv)), 2 pipeline stages: swept on an H100
                          (2026-11-23, benchmarks/probes/tune_decode_kernels.py, 575 of 640 pages, paged): batch 1 8.9 us
                          (5 splits; 13.8 with the former 3 splits and 3 stages), batch 32 28.2 us (2 splits;
                          33.0), batch 64 55.4 us (1; 60.1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import TritonLaunch

from .paged import check_table
from ._triton_common import (
    DT_BF16,
    DT_FP16,
    DT_FP32,
    DT_FP8E5,
    cdiv,
    count_strides,
    dtype_code,
    interpreting,
    load_count,
    next_pow2,
    num_sms,
    round_to,
    tanh_f32,
)

LOG2E = 1.4426950408889634
PAGES_PER_PROGRAM = 128  # target pages scored by one program (2 blocks of 64); fewer pages -> the fused schedule
PROGRAMS_PER_SM = 2  # splits stop once the batch's (row, KV head) programs reach this many per SM


@triton.jit
def _channel_mask(q_ptr, s_qg, s_qd, group, head_dim, a_rows, d_rows,
                  TOPR: tl.constexpr, KT_DT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  CHUNK: tl.constexpr):
    """True for the TOPR channels with the largest sum_g |q| (ties: lower index first). ``a_rows`` = those sums."""
    g = tl.arange(0, BLOCK_G)
    rank = tl.zeros((BLOCK_D,), tl.int32)
    for c0 in range(0, BLOCK_D, CHUNK):
        dc = c0 + tl.arange(0, CHUNK)
        qc = tl.load(q_ptr + g[:, None] * s_qg + dc[None, :] * s_qd,
                     mask=(g < group)[:, None] & (dc < head_dim)[None, :], other=0.0).to(tl.float32)
        ac = tl.sum(tl.abs(round_to(qc, KT_DT)), axis=0)
        ac = tl.where(dc < head_dim, ac, -1.0)
        ahead = (ac[None, :] > a_rows[:, None]) | ((ac[None, :] == a_rows[:, None]) & (dc[None, :] < d_rows[:, None]))
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    return (rank < TOPR) & (d_rows < head_dim)


@triton.jit
def _as_dot(x, DOT_DT: tl.constexpr):
    """``x`` in the score dot's operand dtype (``_dot_code``): fp32 (0), fp16 (1) or bf16 (2)."""
    if DOT_DT == 0:
        out = x.to(tl.float32)
    elif DOT_DT == 1:
        out = x.to(tl.float16)
    else:
        out = x.to(tl.bfloat16)
    return out


@triton.jit
def _dot_t(a, b, DOT_DT: tl.constexpr):
    """``a @ b.T``, ``a`` already in the operand dtype (``_as_dot``, once per program), ``b`` cast here; fp32 with
    exact (ieee) products."""
    if DOT_DT == 0:
        out = tl.dot(a, tl.trans(_as_dot(b, DOT_DT)), input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(_as_dot(b, DOT_DT)))
    return out


@triton.jit
def _page_logits_kernel(
    q_ptr, kt_ptr, count_ptr, logits_ptr, stats_ptr, probs_ptr, table_ptr,
    s_qb, s_qh, s_qg, s_qd,
    s_tb, s_th, s_tp, s_tm, s_td,
    s_cb, s_ch,
    s_ab, s_ap,
    num_kv_heads, group, num_pages, head_dim, pages_per_prog, num_splits, kt_per_page,
    scale_log2, cap_log2,
    TOPR: tl.constexpr, USE_TOPR: tl.constexpr, KT_DT: tl.constexpr, DOT_DT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, FUSED: tl.constexpr,
    COUNT_DIV: tl.constexpr, PAGED: tl.constexpr, HEAD_BOUND: tl.constexpr, SOFTCAP: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    n = load_count(count_ptr, b, h, s_cb, s_ch, num_pages, COUNT_DIV)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < group
    d_ok = d < head_dim
    q_base = q_ptr + b * s_qb + h * s_qh
    q = tl.load(q_base + g[:, None] * s_qg + d[None, :] * s_qd, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = round_to(q.to(tl.float32), KT_DT)
    if USE_TOPR:
        a = tl.sum(tl.abs(q), axis=0)
        a = tl.where(d_ok, a, -1.0)
        keep = _channel_mask(q_base, s_qg, s_qd, group, head_dim, a, d, TOPR, KT_DT, BLOCK_G, BLOCK_D, 32)
        q = tl.where(keep[None, :], q, 0.0)
    use_max = tl.sum(q, axis=0) > 0.0
    # HEAD_BOUND (stage2_score="head_bound"): each head's own sign, max(q Kmax, q Kmin) = max(q,0) Kmax + min(q,0) Kmin
    qd = _as_dot(q, DOT_DT)
    qd_pos = _as_dot(tl.maximum(q, 0.0), DOT_DT)
    qd_neg = _as_dot(tl.minimum(q, 0.0), DOT_DT)
    # both summaries of a page are read with contiguous (vectorised) loads and the signed choice is made in
    # registers: a per-channel gather of one of them would read the same sectors with byte-wide loads
    # contiguous KT: the row's pages follow each other; paged: KT page j lives in pool page table[b, j // R] at
    # position j % R (kernels/paged.py), so s_tb is the pool-page stride and the row offset comes from the table
    if PAGED:
        kt_base = kt_ptr + h * s_th + (d * s_td)[None, :]
    else:
        kt_base = kt_ptr + b * s_tb + h * s_th + (d * s_td)[None, :]
    logit_base = logits_ptr + (bh * BLOCK_G + g).to(tl.int64)[:, None] * num_pages

    p_start = split * pages_per_prog
    p_end = tl.minimum(p_start + pages_per_prog, n)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    for p0 in range(p_start, p_end, BLOCK_P):
        pages = p0 + tl.arange(0, BLOCK_P)
        p_ok = pages < p_end
        if PAGED:
            pool_page = tl.load(table_ptr + b * s_ab + (pages // kt_per_page) * s_ap, mask=p_ok, other=-1).to(tl.int64)
            p_ok = p_ok & (pool_page >= 0)
            kt_page = kt_base + (tl.where(p_ok, pool_page, 0) * s_tb + (pages % kt_per_page) * s_tp)[:, None]
        else:
            kt_page = kt_base + pages.to(tl.int64)[:, None] * s_tp
        kt_mask = p_ok[:, None] & d_ok[None, :]
        kmin = tl.load(kt_page, mask=kt_mask, other=0.0)
        kmax = tl.load(kt_page + s_tm, mask=kt_mask, other=0.0)
        if HEAD_BOUND:
            s = _dot_t(qd_pos, kmax, DOT_DT) + _dot_t(qd_neg, kmin, DOT_DT)
        else:
            s = _dot_t(qd, tl.where(use_max[None, :], kmax, kmin), DOT_DT)
        s = (s * scale_log2).to(tl.float32)
        if SOFTCAP:  # scale_log2 = scaling / softcap: tanh, then softcap * log2(e) (Gemma 2's capped logits)
            s = (tanh_f32(s) * cap_log2).to(tl.float32)  # fp64 under inductor otherwise, as above
        s = tl.where(p_ok[None, :], s, float("-inf"))
        tl.store(logit_base + pages[None, :], s, mask=g_ok[:, None] & p_ok[None, :])
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new
    if FUSED:
        tl.debug_barrier()  # the logits written above are read back below by other threads of this program
        m_safe = tl.where(l_i > 0, m_i, 0.0)
        inv = tl.where(g_ok & (l_i > 0), 1.0 / (tl.maximum(l_i, 1e-30) * group), 0.0)
        for p0 in range(0, num_pages, BLOCK_P):
            pages = p0 + tl.arange(0, BLOCK_P)
            valid = pages < n
            s = tl.load(logit_base + pages[None, :], mask=g_ok[:, None] & valid[None, :], other=float("-inf"))
            p = tl.exp2(s - m_safe[:, None]) * inv[:, None]
            tl.store(probs_ptr + bh.to(tl.int64) * num_pages + pages, tl.sum(p, axis=0), mask=pages < num_pages)
    else:
        st = stats_ptr + ((bh * num_splits + split) * 2 * BLOCK_G + g)
        tl.store(st, m_i)
        tl.store(st + BLOCK_G, l_i)

_page_logits_launch = TritonLaunch(_page_logits_kernel)


@triton.jit
def _page_probs_kernel(
    count_ptr, logits_ptr, stats_ptr, probs_ptr,
    s_cb, s_ch,
    num_kv_heads, group, num_pages, num_splits,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    n = load_count(count_ptr, b, h, s_cb, s_ch, num_pages, 1)
    g = tl.arange(0, BLOCK_G)
    sp = tl.arange(0, BLOCK_S)
    st = stats_ptr + ((bh * num_splits + sp) * 2 * BLOCK_G)[:, None] + g[None, :]
    s_ok = (sp < num_splits)[:, None]
    m_s = tl.load(st, mask=s_ok, other=float("-inf"))
    l_s = tl.load(st + BLOCK_G, mask=s_ok, other=0.0)
    m = tl.max(m_s, axis=0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    l_i = tl.sum(l_s * tl.exp2(m_s - m_safe[None, :]), axis=0)
    inv = tl.where((g < group) & (l_i > 0), 1.0 / (tl.maximum(l_i, 1e-30) * group), 0.0)
    pages = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = pages < n
    s = tl.load(logits_ptr + (bh * BLOCK_G + g).to(tl.int64)[:, None] * num_pages + pages[None, :],
                mask=(g < group)[:, None] & valid[None, :], other=float("-inf"))
    p = tl.exp2(s - m_safe[:, None]) * inv[:, None]
    tl.store(probs_ptr + bh.to(tl.int64) * num_pages + pages, tl.sum(p, axis=0), mask=pages < num_pages)

_page_probs_launch = TritonLaunch(_page_probs_kernel)


def _dot_code(kt_dtype: torch.dtype) -> int:
    """Operand dtype of the score dot: 0 fp32 (exact products), 1 fp16 (fp16 and fp8 KT), 2 bf16."""
    code = dtype_code(kt_dtype)
    if code == DT_FP32 or (code == DT_BF16 and interpreting()):  # the interpreter's dot cannot take bf16
        return 0
    if code in (DT_FP16, DT_FP8E5):
        return 1
    return 2


def score_splits(rows: int, num_pages: int, block_p: int, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    """(programs per row, pages per program) of the logits kernel, from the shapes only."""
    if num_splits is None:
        # a program walks its pages block after block, so rows of many pages are split over several programs
        # (~PAGES_PER_PROGRAM each) unless the rows alone fill the GPU
        sms = num_sms(device)
        num_splits = max(1, min(cdiv(num_pages, PAGES_PER_PROGRAM), cdiv(PROGRAMS_PER_SM * sms, rows)))
    pages_per_prog = cdiv(cdiv(num_pages, num_splits), block_p) * block_p
    return cdiv(num_pages, pages_per_prog), pages_per_prog


def kt_pages_per_row(kt: torch.Tensor, table: torch.Tensor | None) -> int:
    """NP, KT pages per row: ``kt.shape[2]`` for a contiguous KT, MP * R for a paged one (``kernels/paged.py``)."""
    return kt.shape[2] if table is None else table.shape[1] * kt.shape[2]


def page_logits_launch(
    q: torch.Tensor, kt: torch.Tensor, counts: torch.Tensor, count_div: int, topr: int, num_splits: int | None,
    probs: torch.Tensor | None = None, table: torch.Tensor | None = None, num_warps: int = 4, num_stages: int = 2,
    per_head_bound: bool = False, block_p: int | None = None, softcap: float | None = None,
    scaling: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Pass 1 of the page scoring: logits (log2 units, ``[B*Hkv*BLOCK_G, NP]`` fp32) and per-split softmax
    statistics (``[B*Hkv, S, 2, BLOCK_G]``: max, sum). ``counts`` are pages in use (count_div 1) or tokens
    (count_div = page_size). With ``probs`` given and one split the kernel also writes the probabilities (fused
    schedule) and the statistics are not written. ``table`` [B, MP] int32: ``kt`` is paged ``[N, Hkv, R, 2, D]``
    (None: contiguous ``[B, Hkv, NP, 2, D]``). ``softcap`` (with the model's ``scaling``): the logits are
    ``tanh(x * scaling / softcap) * softcap`` instead of ``x / sqrt(D)`` (``stage2_pages.capped_page_scores``).
    Returns (logits, stats, S, BLOCK_G)."""
    batch, num_kv_heads, group, head_dim = q.shape
    num_pages = kt_pages_per_row(kt, table)
    s_cb, s_ch = count_strides(counts, batch, num_kv_heads, "n_pages" if count_div == 1 else "lengths")
    block_g = max(16, next_pow2(group))
    block_d = next_pow2(head_dim)
    block_p = block_p or (64 if block_d <= 128 else 32)
    rows = batch * num_kv_heads
    num_splits, pages_per_prog = score_splits(rows, num_pages, block_p, q.device, num_splits)
    fused = probs is not None and num_splits == 1
    logits = torch.empty((rows * block_g, num_pages), dtype=torch.float32, device=q.device)
    stats = torch.empty((rows, num_splits, 2, block_g) if not fused else (1,), dtype=torch.float32, device=q.device)
    paged = table is not None
    if paged:
        check_table(table, batch)
    _page_logits_launch[(rows, num_splits)](
        q, kt, counts, logits, stats, probs if fused else logits, table if paged else counts,
        *q.stride(), *kt.stride(), s_cb, s_ch, *(table.stride() if paged else (0, 0)),
        num_kv_heads, group, num_pages, head_dim, pages_per_prog, num_splits, kt.shape[2],
        head_dim**-0.5 * LOG2E if softcap is None else scaling / softcap, (softcap or 0.0) * LOG2E,
        TOPR=min(topr, head_dim), USE_TOPR=topr < head_dim, KT_DT=dtype_code(kt.dtype), DOT_DT=_dot_code(kt.dtype),
        BLOCK_G=block_g, BLOCK_P=block_p, BLOCK_D=block_d, FUSED=fused, COUNT_DIV=count_div, PAGED=paged,
        HEAD_BOUND=per_head_bound, SOFTCAP=softcap is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return logits, stats, num_splits, block_g


def page_scores_launch(
    q: torch.Tensor, kt: torch.Tensor, n_pages: torch.Tensor, topr: int, num_splits: int | None = None,
    table: torch.Tensor | None = None, num_warps: int = 4, num_stages: int = 2, per_head_bound: bool = False,
    block_p: int | None = None,
) -> torch.Tensor:
    """Launcher; ``num_splits`` (None = heuristic, 1 = fused) and the tile knobs (``block_p``: pages per tile, a
    power of two) exist for tests and benchmarks; ``table``: paged KT."""
    batch, num_kv_heads, group, head_dim = q.shape
    num_pages = kt_pages_per_row(kt, table)
    probs = torch.empty((batch, num_kv_heads, num_pages), dtype=torch.float32, device=q.device)
    if probs.numel() == 0:
        return probs
    logits, stats, num_splits, block_g = page_logits_launch(q, kt, n_pages, 1, topr, num_splits, probs=probs,
                                                            table=table, num_warps=num_warps, num_stages=num_stages,
                                                            per_head_bound=per_head_bound, block_p=block_p)
    if num_splits > 1:
        block_p2 = 128
        s_cb, s_ch = count_strides(n_pages, batch, num_kv_heads, "n_pages")
        _page_probs_launch[(batch * num_kv_heads, cdiv(num_pages, block_p2))](
            n_pages, logits, stats, probs,
            s_cb, s_ch,
            num_kv_heads, group, num_pages, num_splits,
            BLOCK_G=block_g, BLOCK_S=next_pow2(num_splits), BLOCK_P=block_p2,
            num_warps=4,
        )
    return probs


def page_scores_triton(
    q: torch.Tensor, kt: torch.Tensor, n_pages: torch.Tensor, topr: int, per_head_bound: bool = False
) -> torch.Tensor:
    """Same contract as ``stage2_pages.page_scores``."""
    return page_scores_launch(q, kt, n_pages, topr, per_head_bound=per_head_bound)


def paged_page_scores_triton(
    q: torch.Tensor, kt_pages: torch.Tensor, table: torch.Tensor, n_pages: torch.Tensor, topr: int,
    per_head_bound: bool = False,
) -> torch.Tensor:
    """Same contract as ``paged_page_scores_torch``."""
    return page_scores_launch(q, kt_pages, n_pages, topr, table=table, per_head_bound=per_head_bound)
