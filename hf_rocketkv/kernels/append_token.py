"""One decode token into the compressed cache, in place: K/V row, input column, KT page summary, length.

Two entry points, one Triton kernel:

``paged_append_token`` (what RocketKVLayer uses; shapes in ``kernels/paged.py``):
    k_pages, v_pages:  [N, Hkv, PP, D]     written at page table[b, s // PP], offset s % PP, s = lengths[b(, h)]
    kt_pages:          [N, Hkv, R, 2, D]   the key is folded into KT page (s % PP) // KP of that page (a fresh KT
                                           page when s % KP == 0, else element-wise min/max; rounding as
                                           ``update_kt``); None: K/V only (the keep_all history)
    table:             [B, MP] int32       the rows' pages (-1 = none)
    positions:         [B, Hkv, C] int32   written at slot s with seen - 1 (the token's input column), C = MP * PP
    lengths:           [B] or [B, Hkv]     int, tokens stored per row (or per row and KV head); incremented by 1
    seen:              0-d or [B] int64    logical tokens seen, already advanced past this token (one count for the
                                           batch, or one per row: rows of several requests decoding together);
                                           with ``advance_seen=True`` the count before this token, advanced by 1
                                           here (inside the launch where its programs own their counts: a count
                                           per row, or one row; else one ``add_`` first)
    key_new, value_new: [B, Hkv, D]        any strides (e.g. ``key_states[:, :, 0]``)
    kt_page_size:      KP, tokens per KT page (PP must be a multiple of it)

``append_token`` (contiguous store, the special case N = B, PP = C, table = rows):
    keys, values [B, Hkv, C, D], positions [B, Hkv, C], kt [B, Hkv, C // KP, 2, D], lengths, seen, key_new,
    value_new, page_size (= KP)

The caller guarantees room (a page for slot s); the references then raise on a slot past the table or a missing
page, while the kernel drops those writes (never writes out of bounds or into another row's page) and still
counts the token.

Triton: grid (B,), one program per row handles every KV head of its row ([BLOCK_H, D] tiles), so a [B] length
shared by the heads of a row is read and incremented by one program: no race, no second launch. The same holds for
``seen`` when ``advance_seen`` is set and the program owns its count (``[B]`` counts, or a 0-d count and one row): a
decode step's count then costs no launch of its own. No host sync;
registered as ``torch.ops.hf_rocketkv.append_token`` / ``paged_append_token`` / ``paged_append_kv``.

fp8 pages (paged entry points only): ``k_scale`` / ``v_scale`` float32 [N] (one scale per pool page) or [N, Hkv]
(per page and KV head), trailing keyword arguments, given exactly when k_pages / v_pages are float8_e4m3fn
(``paged.check_fp8_scales``). The K/V slot is written by the decode append rule (``fp8_append_torch``: a page's
first slot resets its scale and zeroes the page's later slots; a token whose amax exceeds the scale grows it and
re-quantizes the slots below; otherwise the stored bytes stay and the token is quantized with the page's scale); KT,
positions and lengths as for float pages, the KT from the unquantized key. [N] scales need one length per row ([B]);
[B, Hkv] lengths need [N, Hkv] scales (ValueError otherwise). The kernel does the same in place: for [N] scales a
first pass over the row's KV heads takes the token's amax, then each head tile re-quantizes its slots of the page
only where the scale grows (masked loads and stores: no traffic otherwise), with PyTorch's e4m3 rounding
(``_triton_common.quantize_e4m3``), so its bytes equal the twin's.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE, FP8_MAX, scale_from_amax
from ..selection.stage2_pages import per_head, update_kt
from .paged import check_fp8_scales, check_table


def append_token_torch(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    kt: torch.Tensor,
    lengths: torch.Tensor,
    seen: torch.Tensor,
    key_new: torch.Tensor,
    value_new: torch.Tensor,
    page_size: int,
) -> None:
    """Reference (contiguous): index writes at slot lengths[b(, h)], ``update_kt``, ``lengths += 1`` (in place)."""
    batch, num_kv_heads = keys.shape[:2]
    slot = per_head(lengths, batch, num_kv_heads)
    rows = torch.arange(batch, device=keys.device)[:, None]
    heads = torch.arange(num_kv_heads, device=keys.device)[None, :]
    keys[rows, heads, slot] = key_new
    values[rows, heads, slot] = value_new
    positions[rows, heads, slot] = (seen.reshape(-1, 1) - 1).to(torch.int32)
    update_kt(kt, key_new, slot, page_size)
    lengths.add_(1)


def _page_of(table: torch.Tensor, slot: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """Page id of each ``slot`` ``[B, Hkv]`` through ``table`` ``[B, MP]``; raises (eager) for a missing page."""
    rows = torch.arange(table.shape[0], device=table.device)[:, None]
    column = slot // page_tokens
    if _can_sync(column) and bool((column >= table.shape[1]).any()):
        raise IndexError("paged_append_token: a row's next slot lies past its block table")
    # clamped, so that a slot past the table never becomes a device-side assert (which would poison the CUDA
    # context): where the host cannot check (graph capture, compile), the runner's bookkeeping has checked already
    page = table.long()[rows, column.clamp(max=table.shape[1] - 1)]
    if _can_sync(page) and bool((page < 0).any()):
        raise IndexError("paged_append_token: a row has no page for its next slot (table entry -1)")
    return page


def _can_sync(tensor: torch.Tensor) -> bool:
    """Whether a host check may read ``tensor``: not while compiling or capturing a CUDA graph (there the runner's
    host bookkeeping, ``count_decode_step``, has already checked the capacity before the step)."""
    if torch.compiler.is_compiling():
        return False
    return not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def check_advanceable(seen: torch.Tensor, batch: int, advance_seen: bool, op: str) -> None:
    """ValueError, before anything is written, for ``advance_seen`` on a ``[B]`` count that is one value broadcast
    over several rows (stride 0): it cannot advance in place, and the rows sharing it is what a 0-d count says."""
    if advance_seen and batch > 1 and seen.dim() == 1 and seen.stride(0) == 0:
        raise ValueError(f"{op}: seen is one count broadcast over {batch} rows (stride 0), which advance_seen cannot "
                         f"advance in place; pass the 0-d count (rows that share it) or one count per row")


def check_fp8_append(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    lengths: torch.Tensor,
    op: str,
) -> bool:
    """``check_fp8_scales`` plus the append's own rule: a page scale ([N]) is shared by every KV head of a page, so
    it needs one length per row ([B]); per-KV-head lengths ([B, Hkv], heads at different fill levels) need per-head
    scales ([N, Hkv]). Host-side shape checks only."""
    fp8 = check_fp8_scales(k_pages, v_pages, k_scale, v_scale, op)
    if fp8 and lengths.dim() == 2:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale.dim() == 1:
                raise ValueError(
                    f"{op}: per-KV-head lengths {list(lengths.shape)} need per-head scales; {name} is one scale per "
                    f"page ([N]), which KV heads at different fill levels cannot share. Use granularity \"head\" "
                    f"([N, Hkv] scales) or one length per row ([B])"
                )
    return fp8


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``kernels/fp8.quantize_fp8``'s arithmetic with a scale already shaped to broadcast over ``x`` (float32)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_append_torch(pages: torch.Tensor, scale: torch.Tensor, page: torch.Tensor, offset: torch.Tensor,
                     new: torch.Tensor) -> None:
    """The decode append rule for fp8 pages, in place: token ``new`` [B, Hkv, D] into slot ``offset`` [B, Hkv] of
    pool page ``page`` [B, Hkv] of ``pages`` [N, Hkv, PP, D], scales ``scale`` [N] or [N, Hkv].

    Per scale group (a row's page for [N] scales, where every KV head of the row shares the page and the offset; a
    row's page and KV head for [N, Hkv]): fresh = offset == 0; amax = the token's largest |value| over the group;
    s_new = max(0 if fresh else s_old, amax / 448), 1 if that is 0; grow = fresh or s_new > s_old. Where grow, the
    slots below the offset are dequantized with s_old and re-quantized with s_new, and a fresh page's slots after the
    offset are zeroed (stale bytes of an earlier owner never enter a scale); elsewhere the stored bytes stay bit for
    bit. The token is written as quantize(new, s_new), and s_new as the group's scale.

    Graph-safe: no host sync, no data-dependent branch (every group's page slice is read and written back, selected
    with ``torch.where`` on byte views). The pages written must differ between rows (each row appends into its own
    page).
    """
    batch, heads = page.shape
    page_tokens = pages.shape[2]
    head_ids = torch.arange(heads, device=pages.device)[None, :]
    x = new.to(torch.float32)  # [B, Hkv, D]
    amax = x.abs().amax(dim=-1)  # [B, Hkv]
    by_page = scale.dim() == 1
    if by_page:  # one scale per page: the token's amax over all its KV heads
        amax = amax.amax(dim=1, keepdim=True).expand(batch, heads)
        s_old = scale[page]
    else:
        s_old = scale[page, head_ids]
    s_old = s_old.to(torch.float32)  # [B, Hkv]
    fresh = offset == 0
    s_new = torch.maximum(torch.where(fresh, 0.0, s_old), scale_from_amax(amax))
    s_new = torch.where(s_new > 0, s_new, 1.0)  # an all-zero page keeps scale 1
    grow = fresh | (s_new > s_old)
    block = pages[page, head_ids]  # [B, Hkv, PP, D] e4m3 (plain indexing: fp8 has no gather kernel on CPU)
    requantized = _quantize(block.to(torch.float32) * s_old[..., None, None], s_new[..., None, None])
    token = _quantize(x, s_new[..., None])  # [B, Hkv, D]
    slots = torch.arange(page_tokens, device=pages.device)[None, None, :]
    below = (grow[..., None] & (slots < offset[..., None]))[..., None]  # [B, Hkv, PP, 1]
    after = (fresh[..., None] & (slots > offset[..., None]))[..., None]
    at = (slots == offset[..., None])[..., None]
    out = torch.where(below, requantized.view(torch.uint8), block.view(torch.uint8))
    out = torch.where(after, torch.zeros((), dtype=torch.uint8, device=pages.device), out)
    out = torch.where(at, token.view(torch.uint8)[:, :, None, :], out)
    pages[page, head_ids] = out.view(FP8_DTYPE)  # index_put_ (index_copy_ has no float8 kernel on CPU)
    if by_page:
        scale[page[:, 0]] = s_new[:, 0]
    else:
        scale[page, head_ids] = s_new


def paged_append_token_torch(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kt_pages: torch.Tensor | None,
    table: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    seen: torch.Tensor,
    key_new: torch.Tensor,
    value_new: torch.Tensor,
    kt_page_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    advance_seen: bool = False,
) -> None:
    """Reference (paged): the contiguous reference's writes, addressed through the table. fp8 pages (``k_scale`` /
    ``v_scale`` given): K/V follow ``fp8_append_torch``'s rule; the KT (from the unquantized key), positions and
    lengths as for float pages. ``advance_seen``: ``seen`` is the count before this token; it advances first."""
    fp8 = check_fp8_append(k_pages, v_pages, k_scale, v_scale, lengths, "paged_append_token")
    check_advanceable(seen, table.shape[0], advance_seen, "paged_append_token")
    if advance_seen:
        seen.add_(1)
    _paged_append_torch(k_pages, v_pages, kt_pages, table, positions, lengths, seen, key_new, value_new,
                        kt_page_size, k_scale if fp8 else None, v_scale if fp8 else None)


def _paged_append_torch(k_pages, v_pages, kt_pages, table, positions, lengths, seen, key_new, value_new,
                        kt_page_size, k_scale, v_scale) -> None:
    batch, num_kv_heads = positions.shape[:2]
    page_tokens = k_pages.shape[2]
    slot = per_head(lengths, batch, num_kv_heads).long()
    page = _page_of(table, slot, page_tokens)
    offset = slot % page_tokens
    rows = torch.arange(batch, device=k_pages.device)[:, None]
    heads = torch.arange(num_kv_heads, device=k_pages.device)[None, :]
    if k_scale is not None:
        fp8_append_torch(k_pages, k_scale, page, offset, key_new)
        fp8_append_torch(v_pages, v_scale, page, offset, value_new)
    else:
        k_pages[page, heads, offset] = key_new.to(k_pages.dtype)
        v_pages[page, heads, offset] = value_new.to(v_pages.dtype)
    positions[rows, heads, slot] = (seen.reshape(-1, 1) - 1).to(torch.int32)  # 0-d, or one count per row
    if kt_pages is not None:
        kt_page = offset // kt_page_size
        fresh = (offset % kt_page_size == 0)[..., None]
        current = kt_pages[page, heads, kt_page].float()  # [B, Hkv, 2, D]
        k = key_new.float()
        new_min = torch.where(fresh, k, torch.minimum(current[:, :, 0], k))
        new_max = torch.where(fresh, k, torch.maximum(current[:, :, 1], k))
        kt_pages[page, heads, kt_page] = torch.stack([new_min, new_max], dim=2).to(kt_pages.dtype)
    lengths.add_(1)


def paged_append_kv_torch(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    seen: torch.Tensor,
    key_new: torch.Tensor,
    value_new: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference: ``paged_append_token_torch`` without a KT (keep_all's full history); fp8 pages as there."""
    fp8 = check_fp8_append(k_pages, v_pages, k_scale, v_scale, lengths, "paged_append_kv")
    _paged_append_torch(k_pages, v_pages, None, table, positions, lengths, seen, key_new, value_new, 1,
                        k_scale if fp8 else None, v_scale if fp8 else None)


# ---------------------------------------------------------------------------------------------------- Triton twin
try:
    import triton
    import triton.language as tl
    from .launch import TritonLaunch

    from ._triton_common import (cast_to, count_strides, dtype_code, kernel_owns_count, next_pow2, quantize_e4m3,
                                 scale_strides)
except ImportError:  # triton is optional: the references above work without it
    triton = None

if triton is not None:

    @triton.jit
    def _fp8_scale_update(s_old, amax, fresh):
        """The append rule's scale: max(0 if fresh else s_old, amax / 448), 1 for an all-zero page; and grow."""
        s_new = tl.maximum(tl.where(fresh, 0.0, s_old), tl.math.div_rn(amax, 448.0))
        s_new = tl.where(s_new > 0, s_new, 1.0)
        return s_new, fresh | (s_new > s_old)

    @triton.jit
    def _fp8_write_token(pages_ptr, page, hh, offset, d, d_ok, x, ok, s_old, s_new, grow, fresh, page_tokens,
                         s_n, s_h, s_c, s_d, BLOCK_T: tl.constexpr):
        """One [BLOCK_H, BLOCK_D] tile of the fp8 append rule (``fp8_append_torch``): where grow, the slots below
        the offset re-quantized from s_old to s_new and (fresh) the slots after it zeroed, as one [BLOCK_H, BLOCK_T,
        BLOCK_D] tile of the page; the token quantized with s_new. Most steps neither open a page nor grow its scale:
        then the page tile is skipped as a whole (its IEEE divisions are most of an fp8 append's cost)."""
        base = pages_ptr + page[:, None] * s_n + hh[:, None] * s_h + d[None, :] * s_d  # [BLOCK_H, BLOCK_D]
        rewrite = ok & (grow | fresh)
        if tl.max(rewrite.to(tl.int32), axis=0) > 0:
            t = tl.arange(0, BLOCK_T)
            at = base[:, None, :] + t[None, :, None] * s_c  # [BLOCK_H, BLOCK_T, BLOCK_D]
            below = (ok & grow)[:, None] & (t[None, :] < offset[:, None])  # [BLOCK_H, BLOCK_T]
            zero = (ok & fresh)[:, None] & (t[None, :] > offset[:, None]) & (t[None, :] < page_tokens)
            stored = tl.load(at, mask=below[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
            requantized = quantize_e4m3(stored * s_old[:, None, None], s_new[:, None, None])
            tl.debug_barrier()  # every lane has read the page before any lane overwrites it (replicated lanes)
            tl.store(at, tl.where(zero[:, :, None], 0.0, requantized.to(tl.float32)).to(tl.float8e4nv),
                     mask=(below | zero)[:, :, None] & d_ok[None, None, :])
        tl.store(base + offset[:, None] * s_c, quantize_e4m3(x.to(tl.float32), s_new[:, None]),
                 mask=ok[:, None] & d_ok[None, :])

    @triton.jit
    def _append_token_kernel(
        keys_ptr, values_ptr, pos_ptr, kt_ptr, len_ptr, seen_ptr, knew_ptr, vnew_ptr, table_ptr, ks_ptr, vs_ptr,
        s_kn, s_kh, s_kc, s_kd,
        s_vn, s_vh, s_vc, s_vd,
        s_pb, s_ph, s_pc,
        s_tn, s_th, s_tp, s_tm, s_td,
        s_lb, s_lh,
        s_nb, s_nh, s_nd,
        s_wb, s_wh, s_wd,
        s_ab, s_ap, s_sb,
        s_ksn, s_ksh, s_vsn, s_vsh,
        num_kv_heads, capacity, page_tokens, kt_per_page, table_pages, head_dim,
        P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, KT_DT: tl.constexpr,
        PER_HEAD: tl.constexpr,
        PAGED: tl.constexpr, HAS_KT: tl.constexpr, KV_FP8: tl.constexpr, K_BY_PAGE: tl.constexpr,
        V_BY_PAGE: tl.constexpr, ADVANCE: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        seen = tl.load(seen_ptr + b * s_sb)  # s_sb = 0: one count for the batch
        if ADVANCE:  # the count before this token (this program owns it: advanced at the end)
            column = seen.to(tl.int32)
        else:  # already advanced past it
            column = (seen - 1).to(tl.int32)
        if not PER_HEAD:
            row_slot = tl.load(len_ptr + b * s_lb).to(tl.int64)
        if KV_FP8:  # (PAGED only)
            if K_BY_PAGE or V_BY_PAGE:
                # one scale per page (one length per row: the heads share the page and the offset): the token's
                # amax over every KV head first, then the row's scale update, read before any head writes it
                r_in = (row_slot >= 0) & (row_slot < capacity)
                r_safe = tl.where(r_in, row_slot, 0)
                r_page = tl.load(table_ptr + b * s_ab + (r_safe // page_tokens) * s_ap,
                                 mask=r_in & (r_safe // page_tokens < table_pages), other=-1).to(tl.int64)
                r_ok = r_in & (r_page >= 0)
                r_page = tl.where(r_ok, r_page, 0)
                r_fresh = (r_safe % page_tokens) == 0
                k_amax = 0.0
                v_amax = 0.0
                for a0 in range(0, num_kv_heads, BLOCK_H):
                    ha = (a0 + tl.arange(0, BLOCK_H)).to(tl.int64)
                    ma = (ha < num_kv_heads)[:, None] & d_ok[None, :]
                    ka = tl.load(knew_ptr + b * s_nb + ha[:, None] * s_nh + d[None, :] * s_nd, mask=ma, other=0.0)
                    va = tl.load(vnew_ptr + b * s_wb + ha[:, None] * s_wh + d[None, :] * s_wd, mask=ma, other=0.0)
                    k_amax = tl.maximum(k_amax, tl.max(tl.max(tl.abs(ka.to(tl.float32)), axis=1), axis=0))
                    v_amax = tl.maximum(v_amax, tl.max(tl.max(tl.abs(va.to(tl.float32)), axis=1), axis=0))
                k_row_old = tl.load(ks_ptr + r_page * s_ksn, mask=r_ok, other=1.0)
                v_row_old = tl.load(vs_ptr + r_page * s_vsn, mask=r_ok, other=1.0)
                k_row_new, k_row_grow = _fp8_scale_update(k_row_old, k_amax, r_fresh)
                v_row_new, v_row_grow = _fp8_scale_update(v_row_old, v_amax, r_fresh)
        for h0 in range(0, num_kv_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < num_kv_heads
            hh = h.to(tl.int64)
            if PER_HEAD:
                slot = tl.load(len_ptr + b * s_lb + hh * s_lh, mask=h_ok, other=0).to(tl.int64)
            else:
                slot = tl.zeros((BLOCK_H,), tl.int64) + row_slot
            in_range = h_ok & (slot >= 0) & (slot < capacity)
            safe = tl.where(in_range, slot, 0)
            if PAGED:
                # the row's page holding this slot (-1: no page, the write is dropped)
                page = tl.load(table_ptr + b * s_ab + (safe // page_tokens) * s_ap,
                               mask=in_range & (safe // page_tokens < table_pages), other=-1).to(tl.int64)
                offset = safe % page_tokens
            else:  # contiguous: the row is its own page
                page = tl.zeros((BLOCK_H,), tl.int64) + b
                offset = safe
            ok = in_range & (page >= 0)
            page = tl.where(ok, page, 0)
            m = ok[:, None] & d_ok[None, :]
            k = tl.load(knew_ptr + b * s_nb + hh[:, None] * s_nh + d[None, :] * s_nd, mask=m, other=0.0)
            v = tl.load(vnew_ptr + b * s_wb + hh[:, None] * s_wh + d[None, :] * s_wd, mask=m, other=0.0)
            if KV_FP8:
                fresh = offset == 0
                zero_h = tl.zeros((BLOCK_H,), tl.float32)
                if K_BY_PAGE:
                    k_old, k_new = zero_h + k_row_old, zero_h + k_row_new
                    k_grow = (zero_h + k_row_grow.to(tl.float32)) != 0  # (interpreter: no 0-d bool & vector)
                else:
                    k_old = tl.load(ks_ptr + page * s_ksn + hh * s_ksh, mask=ok, other=1.0)
                    k_new, k_grow = _fp8_scale_update(k_old, tl.max(tl.abs(k.to(tl.float32)), axis=1), fresh)
                if V_BY_PAGE:
                    v_old, v_new = zero_h + v_row_old, zero_h + v_row_new
                    v_grow = (zero_h + v_row_grow.to(tl.float32)) != 0  # (interpreter: no 0-d bool & vector)
                else:
                    v_old = tl.load(vs_ptr + page * s_vsn + hh * s_vsh, mask=ok, other=1.0)
                    v_new, v_grow = _fp8_scale_update(v_old, tl.max(tl.abs(v.to(tl.float32)), axis=1), fresh)
                _fp8_write_token(keys_ptr, page, hh, offset, d, d_ok, k, ok, k_old, k_new, k_grow, fresh,
                                 page_tokens, s_kn, s_kh, s_kc, s_kd, BLOCK_T)
                _fp8_write_token(values_ptr, page, hh, offset, d, d_ok, v, ok, v_old, v_new, v_grow, fresh,
                                 page_tokens, s_vn, s_vh, s_vc, s_vd, BLOCK_T)
                if not K_BY_PAGE:  # each (page, KV head) scale is its lane's own
                    tl.store(ks_ptr + page * s_ksn + hh * s_ksh, k_new, mask=ok)
                if not V_BY_PAGE:
                    tl.store(vs_ptr + page * s_vsn + hh * s_vsh, v_new, mask=ok)
            else:
                tl.store(keys_ptr + page[:, None] * s_kn + hh[:, None] * s_kh + offset[:, None] * s_kc
                         + d[None, :] * s_kd, k, mask=m)
                tl.store(values_ptr + page[:, None] * s_vn + hh[:, None] * s_vh + offset[:, None] * s_vc
                         + d[None, :] * s_vd, v, mask=m)
            tl.store(pos_ptr + b * s_pb + hh * s_ph + safe * s_pc, column, mask=ok)
            if HAS_KT:
                # KT: fold the key into its KT page (every step is idempotent, so replicated lanes are harmless)
                kt_page = offset // P
                fresh = ((offset % P) == 0)[:, None]
                mk = m & (kt_page < kt_per_page)[:, None]
                kt_at = kt_ptr + page[:, None] * s_tn + hh[:, None] * s_th + kt_page[:, None] * s_tp + d[None, :] * s_td
                kf = k.to(tl.float32)
                cur_min = tl.load(kt_at, mask=mk, other=0.0).to(tl.float32)
                cur_max = tl.load(kt_at + s_tm, mask=mk, other=0.0).to(tl.float32)
                tl.store(kt_at, cast_to(tl.where(fresh, kf, tl.minimum(cur_min, kf)), KT_DT), mask=mk)
                tl.store(kt_at + s_tm, cast_to(tl.where(fresh, kf, tl.maximum(cur_max, kf)), KT_DT), mask=mk)
            if PER_HEAD:
                tl.debug_barrier()  # every lane has read these lengths before any lane overwrites them
                tl.store(len_ptr + b * s_lb + hh * s_lh, slot + 1, mask=h_ok)
        if KV_FP8:
            if K_BY_PAGE:  # the row's page scale: every head chunk has used the old one
                tl.store(ks_ptr + r_page * s_ksn, k_row_new, mask=r_ok)
            if V_BY_PAGE:
                tl.store(vs_ptr + r_page * s_vsn, v_row_new, mask=r_ok)
        if not PER_HEAD:
            tl.debug_barrier()  # the row's length was read by every lane above: only now increment it
            tl.store(len_ptr + b * s_lb, row_slot + 1)
        if ADVANCE:
            tl.debug_barrier()  # likewise the count
            tl.store(seen_ptr + b * s_sb, seen + 1)

    _append_token_launch = TritonLaunch(_append_token_kernel)

    def _seen_stride(seen: torch.Tensor, batch: int) -> int:
        """0 for one count shared by the rows (0-d), the row stride for one count per row ([B])."""
        if seen.dim() == 0:
            return 0
        if seen.shape != (batch,):
            raise ValueError(f"seen must be 0-d or [batch={batch}], got shape {tuple(seen.shape)}")
        return seen.stride(0)

    def _launch(k_pages, v_pages, kt_pages, table, positions, lengths, seen, key_new, value_new, kt_page_size,
                paged: bool, k_scale=None, v_scale=None, advance_seen: bool = False) -> None:
        batch, num_kv_heads, capacity = positions.shape
        head_dim = k_pages.shape[3]
        s_sb = _seen_stride(seen, batch)
        check_advanceable(seen, batch, advance_seen, "paged_append_token")
        advance = advance_seen and batch * num_kv_heads > 0 and kernel_owns_count(seen, batch)
        if advance_seen and not advance:
            seen.add_(1)  # a count shared by several rows' programs (or no launch): advanced before they read it
        if batch * num_kv_heads == 0:
            return
        s_lb, s_lh = count_strides(lengths, batch, num_kv_heads, "lengths")
        fp8 = k_scale is not None
        block_d = next_pow2(head_dim)
        block_t = next_pow2(k_pages.shape[2]) if fp8 else 1  # fp8: a page's slots as one tile (a scale grows)
        # fp8: every KV head's page slots in one tile (16k elements at 8B shapes), spread over up to 16 warps: the
        # heads in chunks would each wait for their own chain of dependent loads, and the slowest row sets the time
        block_h = min(next_pow2(num_kv_heads), max(1, (16384 if fp8 else 2048) // (block_t * block_d)))
        tile = block_h * block_t * block_d
        has_kt = kt_pages is not None
        kt = kt_pages if has_kt else k_pages  # an unused pointer without a KT
        kt_strides = kt_pages.stride() if has_kt else (0, 0, 0, 0, 0)
        table_arg = table if paged else lengths  # an unused pointer for the contiguous store
        table_strides = table.stride() if paged else (0, 0)
        _append_token_launch[(batch,)](
            k_pages, v_pages, positions, kt, lengths, seen, key_new, value_new, table_arg,
            k_scale if fp8 else lengths, v_scale if fp8 else lengths,  # unused pointers without fp8
            *k_pages.stride(), *v_pages.stride(), *positions.stride(), *kt_strides, s_lb, s_lh,
            *key_new.stride(), *value_new.stride(), *table_strides, s_sb,
            *scale_strides(k_scale), *scale_strides(v_scale),  # (check_fp8_append: paged; [N] needs [B] lengths)
            num_kv_heads, capacity, k_pages.shape[2], kt_pages.shape[2] if has_kt else 1,
            table.shape[1] if paged else 1, head_dim,
            P=kt_page_size, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_T=block_t,
            KT_DT=dtype_code(kt.dtype) if has_kt else 0,
            PER_HEAD=s_lh != 0, PAGED=paged, HAS_KT=has_kt, KV_FP8=fp8,
            K_BY_PAGE=fp8 and k_scale.dim() == 1, V_BY_PAGE=fp8 and v_scale.dim() == 1, ADVANCE=advance,
            num_warps=min(16, tile // 512) if tile >= 4096 else (4 if tile >= 2048 else (2 if tile >= 512 else 1)),
        )

    def append_token_triton(
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        kt: torch.Tensor,
        lengths: torch.Tensor,
        seen: torch.Tensor,
        key_new: torch.Tensor,
        value_new: torch.Tensor,
        page_size: int,
    ) -> None:
        """Same contract as ``append_token_torch`` (registered as a triton_op in ``triton_ops``)."""
        _launch(keys, values, kt, None, positions, lengths, seen, key_new, value_new, page_size, paged=False)

    def paged_append_token_triton(
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        kt_pages: torch.Tensor,
        table: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        seen: torch.Tensor,
        key_new: torch.Tensor,
        value_new: torch.Tensor,
        kt_page_size: int,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        advance_seen: bool = False,
    ) -> None:
        """Same contract as ``paged_append_token_torch`` (registered as a triton_op in ``triton_ops``). fp8 pages:
        the same kernel applies the append rule (``fp8_append_torch``) in place, bit for bit."""
        check_table(table, positions.shape[0])
        fp8 = check_fp8_append(k_pages, v_pages, k_scale, v_scale, lengths, "paged_append_token")
        _launch(k_pages, v_pages, kt_pages, table, positions, lengths, seen, key_new, value_new, kt_page_size,
                paged=True, k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None,
                advance_seen=advance_seen)

    def paged_append_kv_triton(
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        table: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        seen: torch.Tensor,
        key_new: torch.Tensor,
        value_new: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Same contract as ``paged_append_kv_torch`` (fp8 pages: the append rule in the kernel)."""
        check_table(table, positions.shape[0])
        fp8 = check_fp8_append(k_pages, v_pages, k_scale, v_scale, lengths, "paged_append_kv")
        _launch(k_pages, v_pages, None, table, positions, lengths, seen, key_new, value_new, 1, paged=True,
                k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None)
