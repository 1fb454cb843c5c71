"""Exact attention of one decode query over the tokens of the selected pages (stage 2, step 3).

Shapes (B batch, Hkv KV heads, G query heads per KV head, C slot capacity, P page_size, K pages, D head_dim):
    q:          [B, Hkv, G, D]
    keys/values:[B, Hkv, C, D]
    page_idx:   [B, Hkv, K] long, page_valid: [B, Hkv, K] bool, lengths: [B] or [B, Hkv] (tokens per row or per
                row and KV head)
    returns     [B, Hkv, G, D] in q's dtype

``paged_sparse_decode_attention`` takes the K/V of a paged store instead (kernels/paged.py): k_pages, v_pages
[N, Hkv, PP, D] and table [B, MP] int32; slot s of row b is page table[b, s // PP], offset s % PP. Same kernel:
the contiguous store is the case N = B, PP = C, page = row.

fp8 pages (paged only): k_pages / v_pages float8_e4m3fn with ``k_scale`` / ``v_scale`` float32 [N] (one scale per
pool page) or [N, Hkv] (per page and KV head); every read dequantizes, k = float(k_fp8) * k_scale[page(, head)]
(``kernels/fp8.py``). The twin dequantizes the rows' pages while gathering them (``gather_pages(..., scale)``); the
kernel loads each selected token's scale with the same mask as its K/V row and widens the tile to fp32.

The G query heads of one KV head share its pages, so every selected K/V row is read once per group.

Logit features (every op here takes them as trailing optional arguments; ``selection/logit_features.py`` states
them): ``softcap`` c soft-caps the scaled logits, ``l = tanh(q.k * scaling / c) * c`` (Gemma 2); ``sinks`` fp32-able
``[Hq]`` (query head ``h * G + g``, transformers' order) joins each head's softmax denominator and is dropped after
it, ``p_j = exp(l_j) / (sum_i exp(l_i) + exp(sink))`` (gpt-oss ``s_aux``). The kernel applies the cap to each logit
tile and the sink once per head at the end: in the one-split case on the running (max, sum), with splits in the
reduce kernel as one more log-sum-exp term whose output is zero.
"""

from __future__ import annotations

import torch

from ..selection.logit_features import soft_cap, softmax_with_sinks
from ..selection.stage2_pages import per_head
from .paged import check_fp8_scales, check_table, gather_pages


def selected_slots(
    page_idx: torch.Tensor, page_valid: torch.Tensor, lengths: torch.Tensor, page_size: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of the selected pages ``[B, Hkv, K*P]`` (clamped into range) and whether each holds a token."""
    offsets = torch.arange(page_size, device=page_idx.device)
    slots = (page_idx[..., None] * page_size + offsets).flatten(-2)
    valid = page_valid[..., None].expand(*page_valid.shape, page_size).flatten(-2)
    valid = valid & (slots < per_head(lengths, *page_idx.shape[:2])[..., None])
    return slots.clamp(max=capacity - 1), valid


def sparse_decode_attention_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    page_idx: torch.Tensor,
    page_valid: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: gather the selected tokens, fp32 (soft-capped) logits, softmax (with the sinks in the
    denominator), weighted sum of their values."""
    head_dim = q.shape[-1]
    slots, valid = selected_slots(page_idx, page_valid, lengths, page_size, keys.shape[2])
    gather_idx = slots[..., None].expand(-1, -1, -1, head_dim)
    k = keys.gather(2, gather_idx).float()
    v = values.gather(2, gather_idx).float()
    logits = soft_cap(torch.einsum("bhgd,bhnd->bhgn", q.float(), k) * scaling, checked_softcap(softcap))
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    grouped = grouped_sinks(sinks, q.shape[1], q.shape[2])
    probs = softmax_with_sinks(logits, grouped[None, :, :, None] if grouped is not None else None)
    return torch.einsum("bhgn,bhnd->bhgd", probs, v).to(q.dtype)


def checked_softcap(softcap: float | None) -> float | None:
    """``softcap`` as a float (None: no cap); ValueError unless positive."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"sparse_decode_attention: softcap must be a positive number or None, got {softcap!r}")
    return float(softcap)


def grouped_sinks(sinks: torch.Tensor | None, num_kv_heads: int, group: int) -> torch.Tensor | None:
    """``sinks`` ``[Hq]`` as fp32 ``[Hkv, G]`` (None: none); ValueError for another shape."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (num_kv_heads * group,):
        got = list(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sparse_decode_attention: sinks must be a 1-D tensor of {num_kv_heads * group} query "
                         f"heads (Hkv * G) or None, got {got}")
    return sinks.float().reshape(num_kv_heads, group)


def paged_sparse_decode_attention_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    page_idx: torch.Tensor,
    page_valid: torch.Tensor,
    lengths: torch.Tensor,
    kt_page_size: int,
    scaling: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference (paged): gather the rows' pages (fp8: dequantized with their scales, float32), then
    ``sparse_decode_attention_torch``. ``counters``: the Triton twin's arrival counters (``arrivals.py``); the
    reference has one pass and leaves them alone."""
    check_table(table, q.shape[0])
    check_fp8_scales(k_pages, v_pages, k_scale, v_scale, "paged_sparse_decode_attention")
    keys, values = gather_pages(k_pages, table, k_scale), gather_pages(v_pages, table, v_scale)
    return sparse_decode_attention_torch(q, keys, values, page_idx, page_valid, lengths, kt_page_size, scaling,
                                         softcap, sinks)


# ---------------------------------------------------------------------------------------------------- Triton twin
# Flash-decoding over the selected pages. Grid (B*Hkv, S): program (row, KV head, split) walks its share of the
# K*P selected token slots in blocks of BLOCK_N, gathering K/V rows by page id (each row is D contiguous values),
# and keeps an online softmax for all G query heads of the group at once: logits = q[G, D] @ K^T[D, BLOCK_N] (G
# padded to 16 for the tensor cores), so every selected K/V row is read ONCE per group. With S > 1 each split writes
# its normalised partial output and log-sum-exp (fp32, [B*Hkv, S, G, D] and [B*Hkv, S, G]); a second kernel
# (grid B*Hkv*G) combines the splits, or, given arrival counters (kernels/arrivals.py), the last split of each
# (row, KV head) to finish combines them in the same launch (same arithmetic, ``_combine_head``). With S == 1 the
# output is written directly. S is chosen from the shapes only
# (enough programs to fill the GPU, at least one block each), so the op never syncs with the host.
# ``sparse_decode_attention_triton`` is registered as torch.ops.hf_rocketkv.sparse_decode_attention by triton_ops.
try:
    import triton
    import triton.language as tl

    from ._triton_common import (
        cast_to,
        cdiv,
        count_strides,
        dtype_code,
        interpreting,
        next_pow2,
        num_sms,
        scale_strides,
        tanh_f32,
    )
    from .arrivals import check_counters, last_arrival
    from .flash_decoding import finish_split, online_softmax_step
    from .launch import TritonLaunch
except ImportError:  # triton is optional: the reference above works without it
    triton = None

if triton is not None:
    @triton.jit
    def _combine_head(part_o_ptr, part_lse_ptr, out_ptr, sink_ptr, bh, gi, b, h, s_ob, s_oh, s_og, s_od, group,
                      head_dim, num_splits, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                      OUT_DT: tl.constexpr, SINKS: tl.constexpr, FROM_L2: tl.constexpr):
        """Query head ``gi`` of (row ``b``, KV head ``h``): its ``num_splits`` partials combined into ``out``.
        ``FROM_L2``: partials other programs of this launch wrote (``.cg`` loads, ``arrivals.py``)."""
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_ok = sp < num_splits
        row = (bh * num_splits + sp).to(tl.int64) * BLOCK_G + gi
        if FROM_L2:
            lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
        else:
            lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        if SINKS:  # one more log-sum-exp term whose output is zero: it only enlarges the denominator
            sink = tl.load(sink_ptr + h * group + gi).to(tl.float32) * 1.4426950408889634  # log2(e), literal
            m = tl.maximum(m, sink)
        m_safe = tl.where(m > float("-inf"), m, 0.0)
        w = tl.exp2(lse - m_safe)
        total = tl.sum(w, axis=0)
        if SINKS:
            total += tl.exp2(sink - m_safe)
        # a head without tokens: every w is 0 and so is its output (the sink alone attends nothing)
        w = w / tl.maximum(total, 1e-30)
        if FROM_L2:
            o = tl.load(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0,
                        cache_modifier=".cg")
        else:
            o = tl.load(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
        o = tl.sum(o * w[:, None], axis=0)
        tl.store(out_ptr + b * s_ob + h * s_oh + gi * s_og + d * s_od, cast_to(o, OUT_DT), mask=d < head_dim)

    @triton.jit
    def _sparse_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, valid_ptr, len_ptr, out_ptr, part_o_ptr, part_lse_ptr, table_ptr,
        ks_ptr, vs_ptr, sink_ptr, counter_ptr,
        s_qb, s_qh, s_qg, s_qd,
        s_kb, s_kh, s_kc, s_kd,
        s_vb, s_vh, s_vc, s_vd,
        s_ib, s_ih, s_ik,
        s_mb, s_mh, s_mk,
        s_ob, s_oh, s_og, s_od,
        s_lb, s_lh,
        s_ab, s_ap,
        s_ksn, s_ksh, s_vsn, s_vsh,
        num_kv_heads, group, head_dim, num_sel, tokens_per_split, num_splits, page_tokens, capacity,
        scale_log2, cap_log2,
        P: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        QK_FP32: tl.constexpr, PV_FP32: tl.constexpr, OUT_DT: tl.constexpr, DIRECT: tl.constexpr,
        PAGED: tl.constexpr, KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
        REDUCE_LAST: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (bh // num_kv_heads).to(tl.int64)
        h = (bh % num_kv_heads).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < group
        d_ok = d < head_dim
        length = tl.load(len_ptr + b * s_lb + h * s_lh)
        q = tl.load(q_ptr + b * s_qb + h * s_qh + g[:, None] * s_qg + d[None, :] * s_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if QK_FP32:
            q = q.to(tl.float32)
        if PAGED:  # the row offset comes from the table, page by page
            k_base = k_ptr + h * s_kh + d[None, :] * s_kd
            v_base = v_ptr + h * s_vh + d[None, :] * s_vd
        else:
            k_base = k_ptr + b * s_kb + h * s_kh + d[None, :] * s_kd
            v_base = v_ptr + b * s_vb + h * s_vh + d[None, :] * s_vd
        idx_base = idx_ptr + b * s_ib + h * s_ih
        valid_base = valid_ptr + b * s_mb + h * s_mh
        total = num_sel * P
        t_start = split * tokens_per_split
        t_end = tl.minimum(t_start + tokens_per_split, total)

        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        for t0 in range(t_start, t_end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_ok = t < t_end
            sel = t // P
            page = tl.load(idx_base + sel * s_ik, mask=t_ok, other=0)
            page_ok = tl.load(valid_base + sel * s_mk, mask=t_ok, other=0) != 0
            slot = page * P + (t % P)
            ok = t_ok & page_ok & (slot < length) & (slot >= 0) & (slot < capacity)
            slot = tl.where(ok, slot, 0).to(tl.int64)
            if PAGED:
                pool_page = tl.load(table_ptr + b * s_ab + (slot // page_tokens) * s_ap, mask=ok, other=-1).to(tl.int64)
                # a slot without a page (-1) is masked in the loads and logits through `present`, never by folding
                # it back into `ok`: that form (ok = ok & ..., then tl.where(ok, pool_page, 0)) crashes Triton 3.6's
                # TritonGPURemoveLayoutConversions pass on sm_90 (tests/kernels/triton_compile_check.py reproduces it)
                present = pool_page >= 0
                pool_page = tl.maximum(pool_page, 0)
                k_off = pool_page * s_kb + (slot % page_tokens) * s_kc
                v_off = pool_page * s_vb + (slot % page_tokens) * s_vc
            else:
                k_off = slot * s_kc
                v_off = slot * s_vc
            if PAGED:
                kv_mask = (ok & present)[:, None] & d_ok[None, :]
            else:
                kv_mask = ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + k_off[:, None], mask=kv_mask, other=0.0)
            v = tl.load(v_base + v_off[:, None], mask=kv_mask, other=0.0)
            if KV_FP8:  # (PAGED only) each token's page scale, masked as its K/V row; s_ksh = 0: one per page
                k_sc = tl.load(ks_ptr + pool_page * s_ksn + h * s_ksh, mask=ok & present, other=0.0)
                v_sc = tl.load(vs_ptr + pool_page * s_vsn + h * s_vsh, mask=ok & present, other=0.0)
            if QK_FP32:
                if KV_FP8:
                    s = tl.dot(q, tl.trans(k.to(tl.float32) * k_sc[:, None]), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif KV_FP8:
                # e4m3 values are exact in q's half type: half operands on the tensor cores, exact products, fp32
                # accumulation; each token's scale multiplies its logit column afterwards
                s = tl.dot(q, tl.trans(k.to(q_ptr.dtype.element_ty))) * k_sc[None, :]
            else:
                s = tl.dot(q, tl.trans(k))
            # scale_log2: scaling * log2(e), or scaling / softcap with SOFTCAP (then tanh, times softcap * log2(e))
            # products with a float argument cast back: torch.compile's inductor passes Python floats as fp64
            s = (s.to(tl.float32) * scale_log2).to(tl.float32)
            if SOFTCAP:
                s = (tanh_f32(s) * cap_log2).to(tl.float32)
            if PAGED:
                s = tl.where((ok & present)[None, :], s, float("-inf"))
            else:
                s = tl.where(ok[None, :], s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            if PV_FP32:
                if KV_FP8:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32) * v_sc[:, None], input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif KV_FP8:  # never p.to(v.dtype) here (fp8): probabilities and dequantized V in q's half type
                half = q_ptr.dtype.element_ty
                acc = acc * alpha[:, None] + tl.dot(p.to(half), (v.to(tl.float32) * v_sc[:, None]).to(half))
            else:  # probabilities rounded to V's half type, fp32 accumulation (as flash attention does)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        finish_split(acc, m_i, l_i, sink_ptr, out_ptr, part_o_ptr, part_lse_ptr, b, h, bh, split, num_splits,
                     group, head_dim, s_ob, s_oh, s_og, s_od, BLOCK_G, BLOCK_D, OUT_DT, DIRECT, SINKS)
        if REDUCE_LAST:  # the (row, KV head)'s last split to finish combines them all (arrivals.py)
            if last_arrival(counter_ptr + bh, num_splits):
                for gi in range(group):
                    _combine_head(part_o_ptr, part_lse_ptr, out_ptr, sink_ptr, bh, gi, b, h, s_ob, s_oh, s_og, s_od,
                                  group, head_dim, num_splits, BLOCK_G, BLOCK_S, BLOCK_D, OUT_DT, SINKS, True)

    _sparse_decode_split_launch = TritonLaunch(_sparse_decode_split_kernel)

    @triton.jit
    def _sparse_decode_reduce_kernel(
        part_o_ptr, part_lse_ptr, out_ptr, sink_ptr,
        s_ob, s_oh, s_og, s_od,
        num_kv_heads, group, head_dim, num_splits,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, OUT_DT: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        bh = pid // group
        b = (bh // num_kv_heads).to(tl.int64)
        h = (bh % num_kv_heads).to(tl.int64)
        _combine_head(part_o_ptr, part_lse_ptr, out_ptr, sink_ptr, bh, pid % group, b, h, s_ob, s_oh, s_og, s_od,
                      group, head_dim, num_splits, BLOCK_G, BLOCK_S, BLOCK_D, OUT_DT, SINKS, False)

    _sparse_decode_reduce_launch = TritonLaunch(_sparse_decode_reduce_kernel)

    def sparse_decode_attention_launch(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        page_idx: torch.Tensor,
        page_valid: torch.Tensor,
        lengths: torch.Tensor,
        page_size: int,
        scaling: float,
        num_splits: int | None = None,
        block_n: int | None = None,
        num_warps: int | None = None,
        num_stages: int = 2,
        table: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        counters: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Launcher; ``num_splits`` (None = heuristic, 1 = one kernel, no reduce) and the tile knobs exist for tests
        and benchmarks. Default tile: 128 gathered tokens x head_dim, 4 warps for bf16/fp16 K/V (see the comment at
        the choice); 64 tokens, 8 warps for fp32 and fp8 K/V (on an H100, 2026-11-22, 4 warps or 32-token tiles
        timed within noise of that; results/h100_2026-11-22.md). 2 pipeline stages: on an
        H100 (2026-11-23, benchmarks/probes/tune_decode_kernels.py, paged, 256 tokens per head) 8.0 / 19.0 / 42.4 us at
        batch 1 / 32 / 64 against 11.5 / 27.2 / 55.9 with 3 (the page-id loads feed the K/V gathers, so a deeper
        pipeline only costs registers and shared memory). ``table`` [B, MP] int32:
        ``keys``/``values`` are paged ``[N, Hkv, PP, D]`` (None: contiguous ``[B, Hkv, C, D]``). ``k_scale`` /
        ``v_scale`` (paged only): fp8 pages and their float32 [N] or [N, Hkv] scales.

        fp8: the tiles are widened to fp32 and scaled. fp32 queries and the interpreter take fp32 dots (K and V
        dequantized before them); half queries (on the GPU) take q's half type: K in e4m3 is exact in it and the
        logits are scaled per token after the dot, V is dequantized then rounded to q's type, probabilities too.

        ``softcap`` / ``sinks``: the logit features of the module docstring (None: none).

        ``counters``: int32 [>= B * Hkv], all 0 (``arrivals.py``): with several splits, each (row, KV head)'s last
        split to finish combines them in the split launch (no reduce launch); None: the reduce kernel."""
        batch, num_kv_heads, group, head_dim = q.shape
        check_counters(counters, batch * num_kv_heads, q.device, "sparse_decode_attention")
        softcap = checked_softcap(softcap)
        if sinks is not None:
            grouped_sinks(sinks, num_kv_heads, group)  # shape check only: the kernels read [Hq] as it is
            if sinks.device != q.device:
                raise ValueError(f"sparse_decode_attention: sinks must be on the query's device {q.device}, got "
                                 f"{sinks.device}")
            sinks = sinks.contiguous()
        paged = table is not None
        if paged:
            check_table(table, batch)
            fp8 = check_fp8_scales(keys, values, k_scale, v_scale, "paged_sparse_decode_attention")
        elif k_scale is not None or v_scale is not None:
            raise ValueError("sparse_decode_attention: k_scale / v_scale apply to paged K/V only (pass table)")
        else:
            fp8 = False
        capacity = table.shape[1] * keys.shape[2] if paged else keys.shape[2]
        num_sel = page_idx.shape[-1]
        out = torch.empty((batch, num_kv_heads, group, head_dim), dtype=q.dtype, device=q.device)
        if out.numel() == 0:
            return out
        block_g = max(16, next_pow2(group))
        block_d = next_pow2(head_dim)
        # half K/V: 128 gathered tokens x head_dim per tile, 4 warps (H200, 2026-11-26, tune_decode_kernels.py
        # --wide, paged, 256 tokens per head: 6.7 / 11.6 / 26.5 us at batch 1 / 32 / 64 against 7.9 / 18.9 / 41.3
        # with the former 64 tokens and 8 warps: half the dependent index-load rounds per program); fp32 and fp8
        # K/V (widened to fp32 in registers) keep the 64-token, 8-warp tile
        wide = not fp8 and keys.dtype in (torch.bfloat16, torch.float16)
        block_n = block_n or ((128 if wide else 64) if block_d <= 128 else (64 if wide else 32))
        num_warps = num_warps or (4 if wide else (8 if block_n * block_d >= 64 * 128 else 4))
        total = num_sel * page_size
        rows = batch * num_kv_heads
        max_splits = max(1, cdiv(total, block_n))
        if num_splits is None:
            # one split when the (row, KV head) programs alone fill the GPU (H100, 2026-11-22, 256 tokens per head:
            # batch 16: 10 us with 1 split vs 14 us with 4; batch 1: 6 us with 4 splits vs 9 us with 1)
            sms = num_sms(q.device)
            num_splits = 1 if 2 * rows > sms else min(max_splits, cdiv(2 * sms, rows))
        num_splits = max(1, min(num_splits, max_splits))
        tokens_per_split = cdiv(cdiv(total, num_splits), block_n) * block_n
        num_splits = max(1, cdiv(total, tokens_per_split))
        direct = num_splits == 1
        reduce_last = counters is not None and not direct
        if direct:
            part_o = part_lse = out  # unused
        else:
            part_o = torch.empty((rows * num_splits * block_g, block_d), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((rows * num_splits * block_g,), dtype=torch.float32, device=q.device)
        # logits: half-precision operands on the tensor cores (exact products, fp32 accumulation); fp32 K/V and the
        # interpreter (whose dot cannot take bf16) use fp32. Probabilities x V: probabilities rounded to V's half
        # type, fp32 accumulation, as flash attention does (half the registers of an fp32 operand); fp32 V: fp32.
        # fp8 K/V: fp32 for fp32 queries and the interpreter, else q's half type (see the docstring)
        if fp8:
            qk_fp32 = pv_fp32 = interpreting() or q.dtype == torch.float32
        else:
            code = dtype_code(keys.dtype)
            qk_fp32 = code == 0 or interpreting() or q.dtype != keys.dtype
            pv_fp32 = code == 0 or interpreting() or values.dtype != keys.dtype
        _sparse_decode_split_launch[(rows, num_splits)](
            q, keys, values, page_idx, page_valid, lengths, out, part_o, part_lse, table if paged else lengths,
            k_scale if fp8 else q, v_scale if fp8 else q,  # unused pointers without fp8
            sinks if sinks is not None else q,  # unused without sinks
            counters if reduce_last else lengths,  # unused without reduce_last
            *q.stride(), *keys.stride(), *values.stride(), *page_idx.stride(), *page_valid.stride(), *out.stride(),
            *count_strides(lengths, batch, num_kv_heads, "lengths"), *(table.stride() if paged else (0, 0)),
            *scale_strides(k_scale if fp8 else None), *scale_strides(v_scale if fp8 else None),
            num_kv_heads, group, head_dim, num_sel, tokens_per_split, num_splits, keys.shape[2], capacity,
            scaling * 1.4426950408889634 if softcap is None else scaling / softcap,
            (softcap or 0.0) * 1.4426950408889634,
            P=page_size, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
            QK_FP32=qk_fp32, PV_FP32=pv_fp32, OUT_DT=dtype_code(q.dtype), DIRECT=direct, PAGED=paged, KV_FP8=fp8,
            SOFTCAP=softcap is not None, SINKS=sinks is not None, REDUCE_LAST=reduce_last,
            BLOCK_S=next_pow2(num_splits),
            num_warps=num_warps, num_stages=num_stages,
        )
        if not direct and not reduce_last:
            combine_splits(part_o, part_lse, out, sinks, num_splits, block_g, block_d)
        return out

    def combine_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None,
                       num_splits: int, block_g: int, block_d: int) -> None:
        """The reduce kernel: each (row, KV head, query head)'s ``num_splits`` normalised partial outputs
        ``part_o`` [B*Hkv*S*BLOCK_G, BLOCK_D] and log2-sum-exps ``part_lse`` (fp32, the split kernels' layout)
        combined into ``out`` [B, Hkv, G, D] (any strides), the sinks ``[Hq]`` joining each denominator. Shared by
        every flash-decoding kernel of this folder (``ring_attention.py`` too)."""
        _, num_kv_heads, group, head_dim = out.shape
        _sparse_decode_reduce_launch[(out.shape[0] * num_kv_heads * group,)](
            part_o, part_lse, out, sinks if sinks is not None else part_lse,
            *out.stride(),
            num_kv_heads, group, head_dim, num_splits,
            BLOCK_G=block_g, BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, OUT_DT=dtype_code(out.dtype),
            SINKS=sinks is not None,
            num_warps=4 if block_d >= 128 else 2,
        )

    def sparse_decode_attention_triton(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        page_idx: torch.Tensor,
        page_valid: torch.Tensor,
        lengths: torch.Tensor,
        page_size: int,
        scaling: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same contract as ``sparse_decode_attention_torch`` (registered as a triton_op in ``triton_ops``)."""
        return sparse_decode_attention_launch(q, keys, values, page_idx, page_valid, lengths, page_size, scaling,
                                              softcap=softcap, sinks=sinks)

    def paged_sparse_decode_attention_triton(
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        table: torch.Tensor,
        page_idx: torch.Tensor,
        page_valid: torch.Tensor,
        lengths: torch.Tensor,
        kt_page_size: int,
        scaling: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        counters: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same contract as ``paged_sparse_decode_attention_torch`` (registered as a triton_op; fp8 pages read and
        dequantized in the kernel); ``counters``: ``sparse_decode_attention_launch``'s."""
        return sparse_decode_attention_launch(q, k_pages, v_pages, page_idx, page_valid, lengths, kt_page_size,
                                              scaling, table=table, k_scale=k_scale, v_scale=v_scale,
                                              softcap=softcap, sinks=sinks, counters=counters)
