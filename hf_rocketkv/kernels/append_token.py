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
                                           batch, or one per row: rows of several requests decoding together)
    key_new, value_new: [B, Hkv, D]        any strides (e.g. ``key_states[:, :, 0]``)
    kt_page_size:      KP, tokens per KT page (PP must be a multiple of it)

``append_token`` (contiguous store, the special case N = B, PP = C, table = rows):
    keys, values [B, Hkv, C, D], positions [B, Hkv, C], kt [B, Hkv, C // KP, 2, D], lengths, seen, key_new,
    value_new, page_size (= KP)

The caller guarantees room (a page for slot s); the references then raise on a slot past the table or a missing
page, while the kernel drops those writes (never writes out of bounds or into another row's page) and still
counts the token.

Triton: grid (B,), one program per row handles every KV head of its row ([BLOCK_H, D] tiles), so a [B] length
shared by the heads of a row is read and incremented by one program: no race, no second launch. No host sync;
registered as ``torch.ops.hf_rocketkv.append_token`` / ``paged_append_token`` / ``paged_append_kv``.
"""

from __future__ import annotations

import torch

from ..selection.stage2_pages import per_head, update_kt
from .paged import check_table


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
) -> None:
    """Reference (paged): the contiguous reference's writes, addressed through the table."""
    batch, num_kv_heads = positions.shape[:2]
    page_tokens = k_pages.shape[2]
    slot = per_head(lengths, batch, num_kv_heads).long()
    page = _page_of(table, slot, page_tokens)
    offset = slot % page_tokens
    rows = torch.arange(batch, device=k_pages.device)[:, None]
    heads = torch.arange(num_kv_heads, device=k_pages.device)[None, :]
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
) -> None:
    """Reference: ``paged_append_token_torch`` without a KT (keep_all's full history)."""
    paged_append_token_torch(k_pages, v_pages, None, table, positions, lengths, seen, key_new, value_new, 1)


# ---------------------------------------------------------------------------------------------------- Triton twin
try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    from ._triton_common import cast_to, count_strides, dtype_code, next_pow2
except ImportError:  # triton is optional: the references above work without it
    triton = None

if triton is not None:

    @triton.jit
    def _append_token_kernel(
        keys_ptr, values_ptr, pos_ptr, kt_ptr, len_ptr, seen_ptr, knew_ptr, vnew_ptr, table_ptr,
        s_kn, s_kh, s_kc, s_kd,
        s_vn, s_vh, s_vc, s_vd,
        s_pb, s_ph, s_pc,
        s_tn, s_th, s_tp, s_tm, s_td,
        s_lb, s_lh,
        s_nb, s_nh, s_nd,
        s_wb, s_wh, s_wd,
        s_ab, s_ap, s_sb,
        num_kv_heads, capacity, page_tokens, kt_per_page, table_pages, head_dim,
        P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KT_DT: tl.constexpr, PER_HEAD: tl.constexpr,
        PAGED: tl.constexpr, HAS_KT: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        column = (tl.load(seen_ptr + b * s_sb) - 1).to(tl.int32)  # s_sb = 0: one count for the batch
        if not PER_HEAD:
            row_slot = tl.load(len_ptr + b * s_lb).to(tl.int64)
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
            tl.store(keys_ptr + page[:, None] * s_kn + hh[:, None] * s_kh + offset[:, None] * s_kc + d[None, :] * s_kd,
                     k, mask=m)
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
        if not PER_HEAD:
            tl.debug_barrier()  # the row's length was read by every lane above: only now increment it
            tl.store(len_ptr + b * s_lb, row_slot + 1)

    def _seen_stride(seen: torch.Tensor, batch: int) -> int:
        """0 for one count shared by the rows (0-d), the row stride for one count per row ([B])."""
        if seen.dim() == 0:
            return 0
        if seen.shape != (batch,):
            raise ValueError(f"seen must be 0-d or [batch={batch}], got shape {tuple(seen.shape)}")
        return seen.stride(0)

    def _launch(k_pages, v_pages, kt_pages, table, positions, lengths, seen, key_new, value_new, kt_page_size,
                paged: bool) -> None:
        batch, num_kv_heads, capacity = positions.shape
        head_dim = k_pages.shape[3]
        if batch * num_kv_heads == 0:
            return
        s_lb, s_lh = count_strides(lengths, batch, num_kv_heads, "lengths")
        block_d = next_pow2(head_dim)
        block_h = min(next_pow2(num_kv_heads), max(1, 2048 // block_d))
        tile = block_h * block_d
        has_kt = kt_pages is not None
        kt = kt_pages if has_kt else k_pages  # an unused pointer without a KT
        kt_strides = kt_pages.stride() if has_kt else (0, 0, 0, 0, 0)
        table_arg = table if paged else lengths  # an unused pointer for the contiguous store
        table_strides = table.stride() if paged else (0, 0)
        wrap_triton(_append_token_kernel)[(batch,)](
            k_pages, v_pages, positions, kt, lengths, seen, key_new, value_new, table_arg,
            *k_pages.stride(), *v_pages.stride(), *positions.stride(), *kt_strides, s_lb, s_lh,
            *key_new.stride(), *value_new.stride(), *table_strides, _seen_stride(seen, batch),
            num_kv_heads, capacity, k_pages.shape[2], kt_pages.shape[2] if has_kt else 1,
            table.shape[1] if paged else 1, head_dim,
            P=kt_page_size, BLOCK_H=block_h, BLOCK_D=block_d, KT_DT=dtype_code(kt.dtype) if has_kt else 0,
            PER_HEAD=s_lh != 0, PAGED=paged, HAS_KT=has_kt,
            num_warps=4 if tile >= 2048 else (2 if tile >= 512 else 1),
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
    ) -> None:
        """Same contract as ``paged_append_token_torch`` (registered as a triton_op in ``triton_ops``)."""
        check_table(table, positions.shape[0])
        _launch(k_pages, v_pages, kt_pages, table, positions, lengths, seen, key_new, value_new, kt_page_size,
                paged=True)

    def paged_append_kv_triton(
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        table: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        seen: torch.Tensor,
        key_new: torch.Tensor,
        value_new: torch.Tensor,
    ) -> None:
        """Same contract as ``paged_append_kv_torch``."""
        check_table(table, positions.shape[0])
        _launch(k_pages, v_pages, None, table, positions, lengths, seen, key_new, value_new, 1, paged=True)
