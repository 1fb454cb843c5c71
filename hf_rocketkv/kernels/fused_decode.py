"""Stage 2 of a decode step in one op: KT page scoring on the top-r channels, top-k page selection and exact
attention over the selected pages, read through a block table (``kernels/paged.py``).

Shapes (B batch, Hkv KV heads, G query heads per KV head, D head_dim, KP = kt_page_size tokens per KT page):
    q            [B, Hkv, G, D]          the decode query
    kt_pages     [N, Hkv, PP // KP, 2, D] KT summaries (fp32 / fp16 / bf16 / float8_e5m2)
    k/v_pages    [N, Hkv, PP, D]          K/V pages (fp32 / fp16 / bf16, or float8_e4m3fn with k_scale / v_scale)
    table        [B, MP] int32            the rows' pool pages (-1: none)
    lengths      [B] or [B, Hkv]          tokens stored per row (or per row and KV head)
    returns      [B, Hkv, G, D] in q's dtype

Semantics: exactly ``paged_top_pages`` followed by ``paged_sparse_decode_attention`` (``paged_fused_decode_torch``,
the twin, is that composition): the same page probabilities, the same selection rule (sink / recent pages forced,
then the best scores, ties to the lower page id) and exact attention over the selected pages' tokens.

Triton schedule (shapes only: no host sync, CUDA-graph safe), S programs per (row, KV head):
    1. (S > 1) page_scores' logits pass (``page_logits_launch``: per page and query head, split over pages when a row
       has many) writes the logits and per-split softmax statistics; the softmax over all of a row's pages needs
       every split's statistics before any page can be ranked, so this is its own launch. With S == 1 (the rows
       alone fill the GPU) and the scoring pass would not split a row's pages either (``page_scores.score_splits``:
       2 programs per SM from the rows alone), the select-and-attend kernel runs that pass itself first
       (``_row_logits``: the logits kernel's arithmetic with one split), so the whole stage 2 is one launch.
    2. grid (B*Hkv, S): program (row, KV head, split) forms the group-mean probability of every page of its row
       (the arithmetic of the selection kernel's), packs each into a 31-bit rank value (forced pages highest, then
       the fp32 bits of the probability, pages not in use 0), finds the K-th largest by a radix search (a 3-bit
       round, then seven 4-bit rounds counting 16 candidates at once; no sort), takes ties at that value in
       ascending page order, lists the selected pages in ascending order (an exclusive prefix sum gives each its
       place) and attends over its share of the list: pages [s * ceil(K / S), (s + 1) * ceil(K / S)) of it,
       flash-decoding style. With S == 1 it writes the output; otherwise each split writes its normalised partial
       output and log-sum-exp.
    3. (S > 1 only) the combine: one program per (row, query head) merges the S partials.
So a step's stage 2 takes 3 launches at small batches, 2 in between and 1 at large ones, against 3-4 for
``paged_top_pages`` + ``paged_sparse_decode_attention`` over arrival counters (logits, selection chunks, attention
splits; the merge and the combine inside those launches, ``arrivals.py``; 4-6 without the counters).
Every split of a row repeats the selection (a few microseconds of arithmetic on the row's logits) so that the
attention work can be spread over the GPU at batch 1.

What the Triton op does not serve (``fused_decode_supported`` says why, from host-side shapes): rows of more than
``FUSED_MAX_PAGES`` KT pages (the selection keeps a row's rank values in registers); callers run the two-op path
for those.
"""

from __future__ import annotations

import torch

from .paged import paged_top_pages_torch
from .sparse_decode_attention import paged_sparse_decode_attention_torch

FUSED_MAX_PAGES = 4096  # KT pages per row (MP * PP // KP) the selection holds in registers


def paged_fused_decode_torch(
    q: torch.Tensor, kt_pages: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
    lengths: torch.Tensor, kt_page_size: int, topr: int, topk: int, scaling: float, sink_pages: int = 0,
    recent_pages: int = 1, per_head_bound: bool = False, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: ``paged_top_pages_torch`` then ``paged_sparse_decode_attention_torch`` -> [B, Hkv, G, D]."""
    page_idx, page_valid = paged_top_pages_torch(q, kt_pages, table, lengths, kt_page_size, topr, topk, sink_pages,
                                                 recent_pages, per_head_bound)
    return paged_sparse_decode_attention_torch(q, k_pages, v_pages, table, page_idx, page_valid, lengths,
                                               kt_page_size, scaling, k_scale=k_scale, v_scale=v_scale)


def fused_decode_supported(kt_pages: torch.Tensor, table: torch.Tensor) -> str | None:
    """None when the fused Triton op serves these shapes, else why not (host-side shapes only)."""
    pages = table.shape[1] * kt_pages.shape[2]
    if pages > FUSED_MAX_PAGES:
        return f"{pages} KT pages per row > FUSED_MAX_PAGES={FUSED_MAX_PAGES}"
    return None


try:
    import triton
    import triton.language as tl

    from ..selection.stage2_pages import check_forcing
    from ._triton_common import (
        cast_to,
        cdiv,
        count_strides,
        dtype_code,
        interpreting,
        load_count,
        next_pow2,
        num_sms,
        round_to,
        scale_strides,
    )
    from .launch import TritonLaunch
    from .page_scores import (
        LOG2E,
        _as_dot,
        _channel_mask,
        _dot_code,
        _dot_t,
        page_logits_launch,
    )
    from .page_scores import score_splits as scoring_splits
    from .paged import check_fp8_scales, check_table
except ImportError:  # triton is optional: the reference above works without it
    triton = None

if triton is not None:

    @triton.jit
    def _softmax_from_stats(stats_ptr, bh, group, score_splits, LOGIT_G: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_S: tl.constexpr):
        """(max, 1 / (sum * G)) of each query head's softmax over the row's pages, from the scoring pass's
        per-split statistics: the selection kernel's arithmetic (select_pages.py, FROM_LOGITS)."""
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
        return m_safe, inv

    @triton.jit
    def _rank_values(logits_ptr, m_safe, inv, rank_base, bh, n, group, num_pages, sink_pages, recent_pages,
                     LOGIT_G: tl.constexpr, BLOCK_G: tl.constexpr, NPB: tl.constexpr, CH: tl.constexpr):
        """Writes each page's 31-bit rank value to ``rank_base[page]`` (-1 past the row's NP pages): 0x7FFFFFFF for
        a forced page, the fp32 bits of its group-mean probability + 1 for another page in use, 0 for a page not in
        use. The probability is the selection kernel's (select_pages.py, FROM_LOGITS), operation for operation:
        ``m_safe`` / ``inv`` [BLOCK_G] the softmax statistics of the first BLOCK_G query heads (rows of the
        logits, LOGIT_G apart per (row, KV head))."""
        g = tl.arange(0, BLOCK_G)
        g_ok = g < group
        for c0 in range(0, NPB, CH):
            pages = c0 + tl.arange(0, CH)
            in_use = pages < n
            s = tl.load(logits_ptr + (bh * LOGIT_G + g).to(tl.int64)[:, None] * num_pages + pages[None, :],
                        mask=g_ok[:, None] & in_use[None, :], other=float("-inf"))
            score = tl.sum(tl.exp2(s - m_safe[:, None]) * inv[:, None], axis=0)
            forced = in_use & ((pages < sink_pages) | (pages >= n - recent_pages))
            bits = tl.where(score > 0.0, score.to(tl.int32, bitcast=True), 0)  # NaN, -0.0 and negatives rank as 0
            value = tl.where(forced, 2147483647, tl.where(in_use, bits + 1, 0))
            tl.store(rank_base + pages, tl.where(pages < num_pages, value, -1), mask=pages < NPB)

    @triton.jit
    def _row_logits(q_ptr, kt_ptr, table_ptr, logits_ptr, bh, b, h, n, s_qb, s_qh, s_qg, s_qd, s_tb, s_th, s_tp,
                    s_tm, s_td, s_ab, s_ap, group, head_dim, num_pages, kt_per_page, kt_scale_log2,
                    TOPR: tl.constexpr, USE_TOPR: tl.constexpr, KT_DT: tl.constexpr, DOT_DT: tl.constexpr,
                    HEAD_BOUND: tl.constexpr, LOGIT_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
        """The scoring pass of one (row, KV head) over all its pages in use, in this program (the one-launch
        schedule): the arithmetic of page_scores' logits kernel with one split, which writes the logits (log2
        units) and returns each query head's softmax (max, sum)."""
        g = tl.arange(0, LOGIT_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < group
        d_ok = d < head_dim
        q_base = q_ptr + b * s_qb + h * s_qh
        q = tl.load(q_base + g[:, None] * s_qg + d[None, :] * s_qd, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        q = round_to(q.to(tl.float32), KT_DT)
        if USE_TOPR:
            a = tl.sum(tl.abs(q), axis=0)
            a = tl.where(d_ok, a, -1.0)
            keep = _channel_mask(q_base, s_qg, s_qd, group, head_dim, a, d, TOPR, KT_DT, LOGIT_G, BLOCK_D, 32)
            q = tl.where(keep[None, :], q, 0.0)
        use_max = tl.sum(q, axis=0) > 0.0
        qd = _as_dot(q, DOT_DT)
        qd_pos = _as_dot(tl.maximum(q, 0.0), DOT_DT)
        qd_neg = _as_dot(tl.minimum(q, 0.0), DOT_DT)
        kt_base = kt_ptr + h * s_th + (d * s_td)[None, :]
        logit_base = logits_ptr + (bh * LOGIT_G + g).to(tl.int64)[:, None] * num_pages
        m_i = tl.full((LOGIT_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((LOGIT_G,), tl.float32)
        for p0 in range(0, n, BLOCK_P):
            pages = p0 + tl.arange(0, BLOCK_P)
            p_ok = pages < n
            pool_page = tl.load(table_ptr + b * s_ab + (pages // kt_per_page) * s_ap, mask=p_ok, other=-1).to(tl.int64)
            p_ok = p_ok & (pool_page >= 0)
            kt_page = kt_base + (tl.where(p_ok, pool_page, 0) * s_tb + (pages % kt_per_page) * s_tp)[:, None]
            kt_mask = p_ok[:, None] & d_ok[None, :]
            kmin = tl.load(kt_page, mask=kt_mask, other=0.0)
            kmax = tl.load(kt_page + s_tm, mask=kt_mask, other=0.0)
            if HEAD_BOUND:
                s = _dot_t(qd_pos, kmax, DOT_DT) + _dot_t(qd_neg, kmin, DOT_DT)
            else:
                s = _dot_t(qd, tl.where(use_max[None, :], kmax, kmin), DOT_DT)
            s = tl.where(p_ok[None, :], (s * kt_scale_log2).to(tl.float32), float("-inf"))
            tl.store(logit_base + pages[None, :], s, mask=g_ok[:, None] & p_ok[None, :])
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
            m_i = m_new
        return m_i, l_i

    @triton.jit
    def _radix_round(t, rank_base, k, SHIFT: tl.constexpr, TOP: tl.constexpr, NPB: tl.constexpr,
                     CH: tl.constexpr):
        """t + d * 2**SHIFT for the largest digit d <= TOP with at least k rank values at or above it: the 16
        candidates counted at once, the values read chunk by chunk (CH at a time) so that registers do not grow
        with the row's pages."""
        digit = tl.arange(0, 16)
        cand = t + (tl.minimum(digit, TOP) << SHIFT)
        counts = tl.zeros((16, CH), tl.int32)
        for c0 in range(0, NPB, CH):
            value = tl.load(rank_base + c0 + tl.arange(0, CH))
            counts += (value[None, :] >= cand[:, None]).to(tl.int32)
        reach = (tl.sum(counts, axis=1) >= k) & (digit <= TOP)
        return t + ((tl.sum(reach.to(tl.int32), axis=0) - 1) << SHIFT)

    @triton.jit
    def _kth_largest(rank_base, k, NPB: tl.constexpr, CH: tl.constexpr):
        """The largest t with ``#(value >= t) >= k`` over the row's rank values (``rank_base[:NPB]``, int32 >= -1,
        at least k of them >= 0): the k-th largest value, by a radix search from the top, 3 bits then 7 rounds of
        4 (t + 15 * 2**shift stays below 2**31 in int32), no sort. Each round's constants are bound as arguments of
        ``_radix_round``: a constexpr rebound inside the loop does not compile on the GPU (Triton 3.6)."""
        t = _radix_round(tl.program_id(0) * 0, rank_base, k, 28, 7, NPB, CH)
        for r in tl.static_range(7):
            t = _radix_round(t, rank_base, k, 24 - 4 * r, 15, NPB, CH)
        return t

    @triton.jit
    def _list_selected(rank_base, list_base, t, k, n, NPB: tl.constexpr, CH: tl.constexpr, KB: tl.constexpr):
        """Writes the selected pages in use to ``list_base`` in ascending order (-1 after them) and returns their
        number: every page whose rank value is above t, then the pages at t in ascending page order until k are
        taken (exactly ``select_pages``' set: the rank values order like its keys, ties to the lower page)."""
        above = tl.zeros((CH,), tl.int32)
        for c0 in range(0, NPB, CH):
            above += (tl.load(rank_base + c0 + tl.arange(0, CH)) > t).to(tl.int32)
        tie_budget = k - tl.sum(above, axis=0)
        tie_base = tl.sum(above, axis=0) * 0
        sel_base = tie_base
        for c0 in range(0, NPB, CH):
            pages = c0 + tl.arange(0, CH)
            value = tl.load(rank_base + pages)
            tie = (value == t).to(tl.int32)
            tie_rank = tie_base + tl.cumsum(tie, axis=0) - tie
            sel = (((value > t) | ((tie != 0) & (tie_rank < tie_budget))) & (pages < n)).to(tl.int32)
            place = sel_base + tl.cumsum(sel, axis=0) - sel
            tl.store(list_base + place, pages, mask=sel != 0)
            tie_base += tl.sum(tie, axis=0)
            sel_base += tl.sum(sel, axis=0)
        e = tl.arange(0, KB)
        tl.store(list_base + e, tl.full((KB,), -1, tl.int32), mask=e >= sel_base)
        return sel_base

    @triton.jit
    def _fused_select_attend_kernel(
        q_ptr, k_ptr, v_ptr, kt_ptr, table_ptr, len_ptr, logits_ptr, stats_ptr, rank_ptr, list_ptr,
        out_ptr, part_o_ptr, part_lse_ptr, ks_ptr, vs_ptr,
        s_qb, s_qh, s_qg, s_qd,
        s_kb, s_kh, s_kc, s_kd,
        s_vb, s_vh, s_vc, s_vd,
        s_tb, s_th, s_tp, s_tm, s_td,
        s_ob, s_oh, s_og, s_od,
        s_lb, s_lh,
        s_ab, s_ap,
        s_ksn, s_ksh, s_vsn, s_vsh,
        num_kv_heads, group, head_dim, num_pages, k_out, sink_pages, recent_pages, score_splits,
        pages_per_split, num_splits, page_tokens, kt_per_page, scale_log2, kt_scale_log2,
        P: tl.constexpr, LOGIT_G: tl.constexpr, BLOCK_GS: tl.constexpr, BLOCK_S: tl.constexpr, NPB: tl.constexpr,
        CH: tl.constexpr, KB: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        QK_FP32: tl.constexpr, PV_FP32: tl.constexpr, OUT_DT: tl.constexpr, DIRECT: tl.constexpr,
        KV_FP8: tl.constexpr, SCORE: tl.constexpr, TOPR: tl.constexpr, USE_TOPR: tl.constexpr,
        KT_DT: tl.constexpr, DOT_DT: tl.constexpr, HEAD_BOUND: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        prog = (bh * num_splits + split).to(tl.int64)
        b = (bh // num_kv_heads).to(tl.int64)
        h = (bh % num_kv_heads).to(tl.int64)
        length = tl.load(len_ptr + b * s_lb + h * s_lh)
        n = load_count(len_ptr, b, h, s_lb, s_lh, num_pages, P)

        # --- selection: the row's rank values (through a per-program scratch row), the K-th largest, ties in
        # ascending page order, then the selected pages in use listed in ascending order
        rank_base = rank_ptr + prog * NPB
        if SCORE:  # one launch (one program per (row, KV head)): the scoring pass first, in this program
            row_max, row_sum = _row_logits(
                q_ptr, kt_ptr, table_ptr, logits_ptr, bh, b, h, n, s_qb, s_qh, s_qg, s_qd, s_tb, s_th, s_tp, s_tm,
                s_td, s_ab, s_ap, group, head_dim, num_pages, kt_per_page, kt_scale_log2, TOPR, USE_TOPR, KT_DT,
                DOT_DT, HEAD_BOUND, LOGIT_G, BLOCK_P, BLOCK_D)
            tl.debug_barrier()  # the logits written above are read back by other threads of this program
            g_s = tl.arange(0, LOGIT_G)
            p_max = tl.where(row_max > float("-inf"), row_max, 0.0)
            l_s = row_sum * tl.exp2(row_max - p_max)
            p_inv = tl.where((g_s < group) & (l_s > 0), 1.0 / (tl.maximum(l_s, 1e-30) * group), 0.0)
            _rank_values(logits_ptr, p_max, p_inv, rank_base, bh, n, group, num_pages, sink_pages, recent_pages,
                         LOGIT_G, LOGIT_G, NPB, CH)
        else:
            p_max, p_inv = _softmax_from_stats(stats_ptr, bh, group, score_splits, LOGIT_G, BLOCK_GS, BLOCK_S)
            _rank_values(logits_ptr, p_max, p_inv, rank_base, bh, n, group, num_pages, sink_pages, recent_pages,
                         LOGIT_G, BLOCK_GS, NPB, CH)
        tl.debug_barrier()  # the rank values written above are read back by other threads of this program
        list_base = list_ptr + prog * KB
        t = _kth_largest(rank_base, k_out, NPB, CH)
        num_sel = _list_selected(rank_base, list_base, t, k_out, n, NPB, CH, KB)
        tl.debug_barrier()  # the list is read back below by other threads of this program

        # --- exact attention over this split's share of the list (tokens of pages [split * pps, ...))
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < group
        d_ok = d < head_dim
        q = tl.load(q_ptr + b * s_qb + h * s_qh + g[:, None] * s_qg + d[None, :] * s_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if QK_FP32:
            q = q.to(tl.float32)
        k_base = k_ptr + h * s_kh + d[None, :] * s_kd
        v_base = v_ptr + h * s_vh + d[None, :] * s_vd
        t_start = split * pages_per_split * P
        t_end = tl.minimum(t_start + pages_per_split * P, num_sel * P)
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        for t0 in range(t_start, t_end, BLOCK_N):
            tok = t0 + tl.arange(0, BLOCK_N)
            t_ok = tok < t_end
            page = tl.load(list_base + tok // P, mask=t_ok, other=0)
            slot = page * P + (tok % P)
            ok = t_ok & (slot < length) & (slot >= 0)
            slot = tl.where(ok, slot, 0).to(tl.int64)
            pool_page = tl.load(table_ptr + b * s_ab + (slot // page_tokens) * s_ap, mask=ok, other=-1).to(tl.int64)
            present = ok & (pool_page >= 0)  # (a separate mask: see sparse_decode_attention.py on Triton 3.6)
            pool_page = tl.maximum(pool_page, 0)
            k_off = pool_page * s_kb + (slot % page_tokens) * s_kc
            v_off = pool_page * s_vb + (slot % page_tokens) * s_vc
            kv_mask = present[:, None] & d_ok[None, :]
            k = tl.load(k_base + k_off[:, None], mask=kv_mask, other=0.0)
            v = tl.load(v_base + v_off[:, None], mask=kv_mask, other=0.0)
            if KV_FP8:  # each token's page scale; s_ksh = 0: one per page
                k_sc = tl.load(ks_ptr + pool_page * s_ksn + h * s_ksh, mask=present, other=0.0)
                v_sc = tl.load(vs_ptr + pool_page * s_vsn + h * s_vsh, mask=present, other=0.0)
            if QK_FP32:
                if KV_FP8:
                    s = tl.dot(q, tl.trans(k.to(tl.float32) * k_sc[:, None]), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif KV_FP8:  # e4m3 is exact in q's half type; the scale multiplies each logit column afterwards
                s = tl.dot(q, tl.trans(k.to(q_ptr.dtype.element_ty))) * k_sc[None, :]
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(present[None, :], (s * scale_log2).to(tl.float32), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PV_FP32:
                if KV_FP8:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32) * v_sc[:, None], input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif KV_FP8:  # probabilities and dequantized V in q's half type
                half = q_ptr.dtype.element_ty
                acc = acc * alpha[:, None] + tl.dot(p.to(half), (v.to(tl.float32) * v_sc[:, None]).to(half))
            else:  # probabilities rounded to V's half type, fp32 accumulation
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
        o = acc * inv[:, None]
        if DIRECT:
            tl.store(out_ptr + b * s_ob + h * s_oh + g[:, None] * s_og + d[None, :] * s_od, cast_to(o, OUT_DT),
                     mask=g_ok[:, None] & d_ok[None, :])
        else:
            row = prog * BLOCK_G + g
            tl.store(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], o)
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
            tl.store(part_lse_ptr + row, lse)

    _fused_select_attend_launch = TritonLaunch(_fused_select_attend_kernel)

    @triton.jit
    def _fused_combine_kernel(
        part_o_ptr, part_lse_ptr, out_ptr,
        s_ob, s_oh, s_og, s_od,
        num_kv_heads, group, head_dim, num_splits,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, OUT_DT: tl.constexpr,
    ):
        """One program per (row, query head): the S partial outputs weighted by their share of the softmax."""
        pid = tl.program_id(0)
        bh = pid // group
        gi = pid % group
        b = (bh // num_kv_heads).to(tl.int64)
        h = (bh % num_kv_heads).to(tl.int64)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_ok = sp < num_splits
        row = (bh * num_splits + sp).to(tl.int64) * BLOCK_G + gi
        lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0))
        w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
        o = tl.sum(tl.load(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
                   * w[:, None], axis=0)
        tl.store(out_ptr + b * s_ob + h * s_oh + gi * s_og + d * s_od, cast_to(o, OUT_DT), mask=d < head_dim)

    _fused_combine_launch = TritonLaunch(_fused_combine_kernel)

    def fused_splits(rows: int, k_pages: int, page_size: int, device: torch.device) -> int:
        """Programs per (row, KV head) of the select-and-attend kernel: one when the rows alone fill the GPU
        (2 programs per SM), else enough to reach that, each attending at least 32 tokens."""
        sms = num_sms(device)
        if 2 * rows > sms:
            return 1
        return max(1, min(cdiv(k_pages * page_size, 32), cdiv(2 * sms, rows), k_pages))

    def fused_decode_launch(
        q: torch.Tensor, kt_pages: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
        lengths: torch.Tensor, kt_page_size: int, topr: int, topk: int, scaling: float, sink_pages: int = 0,
        recent_pages: int = 1, per_head_bound: bool = False, k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
        num_warps: int | None = None, score_splits: int | None = None, one_launch: bool | None = None,
        return_pages: bool = False,
    ):
        """Launcher; ``num_splits`` (None: ``fused_splits``), ``block_n``, ``num_warps``, ``score_splits`` (the
        separate scoring pass's) and ``one_launch`` (None: the scoring pass inside the select-and-attend kernel
        when both would run one program per (row, KV head); False: always a separate pass) exist for tests and benchmarks. ``return_pages``:
        also return the selected pages in use of each (row, KV head), ascending, int32 [B, Hkv, KB] padded with -1
        (split 0's list; KB = next_pow2(K))."""
        check_forcing(topk, sink_pages, recent_pages)
        batch, num_kv_heads, group, head_dim = q.shape
        check_table(table, batch)
        fp8 = check_fp8_scales(k_pages, v_pages, k_scale, v_scale, "paged_fused_decode")
        reason = fused_decode_supported(kt_pages, table)
        if reason is not None:
            raise ValueError(f"paged_fused_decode: {reason}; use paged_top_pages + paged_sparse_decode_attention")
        num_pages = table.shape[1] * kt_pages.shape[2]
        k_out = min(topk, num_pages)
        rows = batch * num_kv_heads
        out = torch.empty((batch, num_kv_heads, group, head_dim), dtype=q.dtype, device=q.device)
        kb = next_pow2(k_out)
        if out.numel() == 0 or num_pages == 0:
            out.zero_()
            empty = torch.full((batch, num_kv_heads, kb), -1, dtype=torch.int32, device=q.device)
            return (out, empty) if return_pages else out
        splits = num_splits or fused_splits(rows, k_out, kt_page_size, q.device)
        splits = max(1, min(splits, k_out))
        pages_per_split = cdiv(k_out, splits)
        splits = cdiv(k_out, pages_per_split)
        block_d = next_pow2(head_dim)
        if one_launch is None:  # the separate pass would split the pages over programs: keep that parallelism
            block_p = 64 if block_d <= 128 else 32
            one_launch = scoring_splits(rows, num_pages, block_p, q.device, score_splits)[0] == 1
        score = splits == 1 and one_launch
        if score:  # the scoring pass runs in the select-and-attend kernel: its logits scratch only
            logit_g, s1 = max(16, next_pow2(group)), 1
            logits = torch.empty((rows * logit_g, num_pages), dtype=torch.float32, device=q.device)
            stats = logits  # unused
        else:
            logits, stats, s1, logit_g = page_logits_launch(q, kt_pages, lengths, kt_page_size, topr, score_splits,
                                                            table=table, per_head_bound=per_head_bound)
        npb = next_pow2(num_pages)
        ch = min(npb, 256)
        rank = torch.empty((rows * splits * npb,), dtype=torch.int32, device=q.device)
        page_list = torch.empty((rows * splits * kb,), dtype=torch.int32, device=q.device)
        block_g = max(16, next_pow2(group))
        wide = not fp8 and k_pages.dtype in (torch.bfloat16, torch.float16)
        tokens = pages_per_split * kt_page_size
        block_n = block_n or min((128 if wide else 64) if block_d <= 128 else (64 if wide else 32),
                                 max(16, next_pow2(tokens)))
        num_warps = num_warps or (8 if npb >= 2048 or (not wide and block_n * block_d >= 64 * 128) else 4)
        direct = splits == 1
        if direct:
            part_o = part_lse = out  # unused
        else:
            part_o = torch.empty((rows * splits * block_g, block_d), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((rows * splits * block_g,), dtype=torch.float32, device=q.device)
        if fp8:
            qk_fp32 = pv_fp32 = interpreting() or q.dtype == torch.float32
        else:
            code = dtype_code(k_pages.dtype)
            qk_fp32 = code == 0 or interpreting() or q.dtype != k_pages.dtype
            pv_fp32 = code == 0 or interpreting() or v_pages.dtype != k_pages.dtype
        _fused_select_attend_launch[(rows, splits)](
            q, k_pages, v_pages, kt_pages, table, lengths, logits, stats, rank, page_list,
            out, part_o, part_lse, k_scale if fp8 else q, v_scale if fp8 else q,
            *q.stride(), *k_pages.stride(), *v_pages.stride(), *kt_pages.stride(), *out.stride(),
            *count_strides(lengths, batch, num_kv_heads, "lengths"), *table.stride(),
            *scale_strides(k_scale if fp8 else None), *scale_strides(v_scale if fp8 else None),
            num_kv_heads, group, head_dim, num_pages, k_out, sink_pages, recent_pages, s1,
            pages_per_split, splits, k_pages.shape[2], kt_pages.shape[2], scaling * LOG2E, head_dim**-0.5 * LOG2E,
            P=kt_page_size, LOGIT_G=logit_g, BLOCK_GS=next_pow2(group), BLOCK_S=next_pow2(s1), NPB=npb, CH=ch,
            KB=kb, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, QK_FP32=qk_fp32, PV_FP32=pv_fp32,
            OUT_DT=dtype_code(q.dtype), DIRECT=direct, KV_FP8=fp8, SCORE=score, TOPR=min(topr, head_dim),
            USE_TOPR=topr < head_dim, KT_DT=dtype_code(kt_pages.dtype), DOT_DT=_dot_code(kt_pages.dtype),
            HEAD_BOUND=per_head_bound, BLOCK_P=64 if block_d <= 128 else 32, num_warps=num_warps, num_stages=2,
        )
        if not direct:
            _fused_combine_launch[(rows * group,)](
                part_o, part_lse, out, *out.stride(), num_kv_heads, group, head_dim, splits,
                BLOCK_G=block_g, BLOCK_S=next_pow2(splits), BLOCK_D=block_d, OUT_DT=dtype_code(q.dtype),
                num_warps=4 if block_d >= 128 else 2,
            )
        if return_pages:
            return out, page_list.view(batch, num_kv_heads, splits, kb)[:, :, 0]
        return out

    def paged_fused_decode_triton(
        q: torch.Tensor, kt_pages: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
        table: torch.Tensor, lengths: torch.Tensor, kt_page_size: int, topr: int, topk: int, scaling: float,
        sink_pages: int = 0, recent_pages: int = 1, per_head_bound: bool = False,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same contract as ``paged_fused_decode_torch`` (registered as a triton_op in ``triton_ops``)."""
        return fused_decode_launch(q, kt_pages, k_pages, v_pages, table, lengths, kt_page_size, topr, topk, scaling,
                                   sink_pages, recent_pages, per_head_bound, k_scale, v_scale)
