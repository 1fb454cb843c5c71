"""Triton twin of ``paged.paged_compact_row_torch``: stage 1's compaction of one row in one launch.

After stage 1 a row keeps ``n`` slots per KV head. Its K/V are gathered from the dense store into the row's pages,
the KT min/max of every KT page is built, and the kept slots' positions are written. The PyTorch path issues about
fifteen launches per row and layer for this (zero-filled buffers, gathers, copies, the KT build, one indexed copy per
paged tensor); on a slow host those launches set the pace of a prefill and of a prefix hit (docs/benchmarks.md,
"Compaction in one launch"). Here each program handles BLOCK_J KT pages of one KV head:

    keys, values [Hkv, S, D]   the row's dense store (any strides)
    slots        [Hkv, n]      kept slots, ascending        columns [Hkv, S] or None (positions of the dense slots)
    counts       [Hkv] or None kept slots per KV head (AdaKV's per-head budgets: head h keeps slots[h, :counts[h]],
                               the rest of its row is empty); None: every head keeps n
    k_pages, v_pages [N, Hkv, PP, D]; kt_pages [N, Hkv, R, 2, D] with R = PP // KP, or None
    table        [MP] int32    the row's pages; the first ``row_pages`` are written
    positions    [Hkv, MP * PP] int32 (written whole; -1 after the kept slots)

Grid (Hkv, cdiv(MP * R, BLOCK_J)). For each of its KT pages j a program walks the KP slots ``j * KP + t``: slot i <
n_h (n, or counts[h]) loads dense slot ``slots[h, i]``, every other slot stores zeros, and the min/max runs in fp32
over the kept slots only (rounded once to the KT dtype, as ``build_kt``). Slots, K/V and KT bytes are copied, never
computed, so the result is bit-identical to the reference (tested on CPU under the interpreter and on the GPU).

fp8 pages (``k_scale`` / ``v_scale``): the same launch writes the row's pages into float32 staging pages (and its KT
into a staging KT, through a staging table 0..row_pages-1), then PyTorch quantizes the staged pages
(``kernels/fp8.quantize_pages``, granularity from the scale's shape) and writes pages, scales and KT into the pool
pages: bit-identical to the reference, which quantizes its own float staging of the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import cast_to, cdiv, dtype_code, next_pow2
from .paged import check_counts, check_fp8_scales, store_pages


# the counts and the head strides follow the prompt length and max_new_tokens: Triton would compile a variant per
# divisibility by 16 of each (a first request of a new length would wait for a compile); they only index and mask
@triton.jit(do_not_specialize=["n", "row_pages", "num_kt_pages", "s_kh", "s_vh", "s_sh", "s_ch", "s_oh", "s_nh"])
def _compact_row_kernel(
    keys_ptr, values_ptr, slots_ptr, columns_ptr, k_pages_ptr, v_pages_ptr, kt_ptr, table_ptr, positions_ptr,
    counts_ptr, s_nh,
    s_kh, s_ks, s_kd,
    s_vh, s_vs, s_vd,
    s_sh, s_sn,
    s_ch, s_cs,
    s_pn, s_ph, s_pp, s_pd,
    s_qn, s_qh, s_qp, s_qd,
    s_tn, s_th, s_tr, s_tm, s_td,
    s_oh, s_oc,
    n, row_pages, num_kt_pages, head_dim,
    KP: tl.constexpr, R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_COLUMNS: tl.constexpr, HAS_KT: tl.constexpr, KT_DT: tl.constexpr, HAS_COUNTS: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    if HAS_COUNTS:  # per-head counts (AdaKV): this head keeps its first counts[h] slots
        n_h = tl.minimum(tl.load(counts_ptr + h * s_nh).to(tl.int64), n)
    else:
        n_h = n
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)  # KT pages of the row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    j_ok = j < num_kt_pages
    page_no = j // R
    present = j_ok & (page_no < row_pages)  # the row owns this page: write it whole
    page_id = tl.load(table_ptr + page_no, mask=present, other=0).to(tl.int64)
    write = present[:, None] & d_ok[None, :]
    kmin = tl.full((BLOCK_J, BLOCK_D), float("inf"), tl.float32)
    kmax = tl.full((BLOCK_J, BLOCK_D), float("-inf"), tl.float32)
    for t in tl.static_range(KP):
        slot = j * KP + t
        kept = j_ok & (slot < n_h)
        index = tl.load(slots_ptr + h * s_sh + slot.to(tl.int64) * s_sn, mask=kept, other=0).to(tl.int64)
        m = kept[:, None] & d_ok[None, :]
        k = tl.load(keys_ptr + h * s_kh + index[:, None] * s_ks + d[None, :] * s_kd, mask=m, other=0.0)
        v = tl.load(values_ptr + h * s_vh + index[:, None] * s_vs + d[None, :] * s_vd, mask=m, other=0.0)
        offset = ((j % R) * KP + t).to(tl.int64)  # slot within the store page
        tl.store(k_pages_ptr + page_id[:, None] * s_pn + h * s_ph + offset[:, None] * s_pp + d[None, :] * s_pd,
                 k, mask=write)
        tl.store(v_pages_ptr + page_id[:, None] * s_qn + h * s_qh + offset[:, None] * s_qp + d[None, :] * s_qd,
                 v, mask=write)
        if HAS_COLUMNS:
            position = tl.load(columns_ptr + h * s_ch + index * s_cs, mask=kept, other=-1)
        else:
            position = index
        position = tl.where(kept, position, -1)
        tl.store(positions_ptr + h * s_oh + slot.to(tl.int64) * s_oc, position.to(tl.int32), mask=j_ok)
        if HAS_KT:
            kf = k.to(tl.float32)
            kmin = tl.minimum(kmin, tl.where(m, kf, float("inf")))
            kmax = tl.maximum(kmax, tl.where(m, kf, float("-inf")))
    if HAS_KT:
        kmin = tl.where(tl.abs(kmin) == float("inf"), 0.0, kmin)
        kmax = tl.where(tl.abs(kmax) == float("inf"), 0.0, kmax)
        out = kt_ptr + page_id[:, None] * s_tn + h * s_th + (j % R).to(tl.int64)[:, None] * s_tr + d[None, :] * s_td
        tl.store(out, cast_to(kmin, KT_DT), mask=write)
        tl.store(out + s_tm, cast_to(kmax, KT_DT), mask=write)


def paged_compact_row_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    columns: torch.Tensor | None,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kt_pages: torch.Tensor | None,
    table: torch.Tensor,
    row_pages: int,
    positions: torch.Tensor,
    kt_page_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> None:
    """Same contract as ``paged.paged_compact_row_torch`` (in place, one launch; fp8 pages: the launch stages the
    row's pages in float32, then PyTorch quantizes them into the pool pages)."""
    fp8 = check_fp8_scales(k_pages, v_pages, k_scale, v_scale, "paged_compact_row")
    heads, n = slots.shape
    check_counts(counts, heads)
    page = k_pages.shape[2]
    if page % kt_page_size:
        raise ValueError(f"paged_compact_row: page tokens ({page}) must be a multiple of kt_page_size ({kt_page_size})")
    if not 0 <= row_pages <= table.shape[0]:
        raise ValueError(f"paged_compact_row: row_pages={row_pages} must lie in [0, {table.shape[0]}] (table entries)")
    capacity = table.shape[0] * page
    if tuple(positions.shape) != (heads, capacity):
        raise ValueError(f"paged_compact_row: positions must be [Hkv, MP * PP] = {[heads, capacity]}, got "
                         f"{list(positions.shape)}")
    if n > row_pages * page:
        raise ValueError(f"paged_compact_row: {n} kept slots do not fit the row's {row_pages} pages of {page}")
    if capacity // kt_page_size == 0 or heads == 0:
        return
    if fp8:
        _compact_row_fp8(keys, values, slots, columns, k_pages, v_pages, kt_pages, table, row_pages, positions,
                         kt_page_size, k_scale, v_scale, counts)
        return
    head_dim = keys.shape[-1]
    per_page = page // kt_page_size
    num_kt_pages = capacity // kt_page_size
    block_d = next_pow2(head_dim)
    block_j = max(1, min(next_pow2(num_kt_pages), 4096 // (block_d * kt_page_size) or 1))
    has_kt = kt_pages is not None
    kt = kt_pages if has_kt else k_pages  # a placeholder pointer, never read or written
    kt_strides = kt_pages.stride() if has_kt else (0,) * 5
    cols = columns if columns is not None else slots
    grid = (heads, cdiv(num_kt_pages, block_j))
    _compact_row_kernel[grid](
        keys, values, slots, cols, k_pages, v_pages, kt, table, positions,
        counts if counts is not None else slots, counts.stride(0) if counts is not None else 0,
        *keys.stride(), *values.stride(), *slots.stride(), *cols.stride()[:2],
        *k_pages.stride(), *v_pages.stride(), *kt_strides, *positions.stride(),
        n, row_pages, num_kt_pages, head_dim,
        KP=kt_page_size, R=per_page, BLOCK_J=block_j, BLOCK_D=block_d,
        HAS_COLUMNS=columns is not None, HAS_KT=has_kt, KT_DT=dtype_code(kt_pages.dtype) if has_kt else 0,
        HAS_COUNTS=counts is not None, num_warps=4,
    )


def _compact_row_fp8(keys, values, slots, columns, k_pages, v_pages, kt_pages, table, row_pages, positions,
                     kt_page_size, k_scale, v_scale, counts) -> None:
    """fp8 pages: the launch into float32 staging pages, then quantize and write pages, scales and KT."""
    _, heads, page, dim = k_pages.shape
    device = k_pages.device
    staged = max(row_pages, 1)  # a real buffer even for a row without pages (nothing is written into it)
    k_stage = torch.empty((staged, heads, page, dim), dtype=torch.float32, device=device)
    v_stage = torch.empty_like(k_stage)
    kt_stage = None
    if kt_pages is not None:
        kt_stage = torch.empty((staged, *kt_pages.shape[1:]), dtype=kt_pages.dtype, device=device)
    stage_table = torch.arange(table.shape[0], dtype=torch.int32, device=device)  # page j of the row -> staged j
    paged_compact_row_triton(keys, values, slots, columns, k_stage, v_stage, kt_stage, stage_table, row_pages,
                             positions, kt_page_size, counts=counts)  # float pages: the one launch
    if row_pages == 0:
        return
    pages = table[:row_pages].long()
    store_pages(k_pages, pages, k_stage, k_scale)
    store_pages(v_pages, pages, v_stage, v_scale)
    if kt_pages is not None:
        kt_pages[pages] = kt_stage

