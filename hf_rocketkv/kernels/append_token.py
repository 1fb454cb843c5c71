"""One decode token into the compressed cache, in place: K/V row, input column, KT page summary, length.

Shapes (B batch, Hkv KV heads, C slot capacity, P page_size, NP = C // P pages, D head_dim):
    keys, values:  [B, Hkv, C, D]      model dtype, written at slot lengths[b(, h)]
    positions:     [B, Hkv, C] int32   written with seen - 1 (the token's input column)
    kt:            [B, Hkv, NP, 2, D]  KT dtype; the key is folded into page slot // P (a fresh page when
                                       slot % P == 0, else element-wise min/max; rounding as ``update_kt``)
    lengths:       [B] or [B, Hkv]     int, tokens stored per row (or per row and KV head); incremented by 1
    seen:          0-d int64           logical tokens seen, already advanced past this token
    key_new, value_new: [B, Hkv, D]    any strides (e.g. ``key_states[:, :, 0]``)

The caller guarantees capacity (slot < C); the reference then matches RocketKVLayer's former multi-op decode
write exactly. Past the capacity the kernel drops the writes (never writes out of bounds) and still counts the
token; the reference raises an index error.

Triton: grid (B,), one program per row handles every KV head of its row ([BLOCK_H, D] tiles), so a [B] length
shared by the heads of a row is read and incremented by one program: no race, no second launch. One launch
replaces the eager path's arange + 3 index_put + update_kt + add (4-5 kernels plus index arithmetic). No host
sync; registered as ``torch.ops.hf_rocketkv.append_token`` (mutates keys, values, positions, kt, lengths).
"""

from __future__ import annotations

import torch

from ..selection.stage2_pages import per_head, update_kt


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
    """Reference: index writes at slot lengths[b(, h)], ``update_kt``, ``lengths += 1`` (all in place)."""
    batch, num_kv_heads = keys.shape[:2]
    slot = per_head(lengths, batch, num_kv_heads)
    rows = torch.arange(batch, device=keys.device)[:, None]
    heads = torch.arange(num_kv_heads, device=keys.device)[None, :]
    keys[rows, heads, slot] = key_new
    values[rows, heads, slot] = value_new
    positions[rows, heads, slot] = (seen - 1).to(torch.int32)
    update_kt(kt, key_new, slot, page_size)
    lengths.add_(1)


# ---------------------------------------------------------------------------------------------------- Triton twin
try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    from ._triton_common import cast_to, count_strides, dtype_code, next_pow2
except ImportError:  # triton is optional: the reference above works without it
    triton = None

if triton is not None:

    @triton.jit
    def _append_token_kernel(
        keys_ptr, values_ptr, pos_ptr, kt_ptr, len_ptr, seen_ptr, knew_ptr, vnew_ptr,
        s_kb, s_kh, s_kc, s_kd,
        s_vb, s_vh, s_vc, s_vd,
        s_pb, s_ph, s_pc,
        s_tb, s_th, s_tp, s_tm, s_td,
        s_lb, s_lh,
        s_nb, s_nh, s_nd,
        s_wb, s_wh, s_wd,
        num_kv_heads, capacity, num_pages, head_dim,
        P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KT_DT: tl.constexpr, PER_HEAD: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        column = (tl.load(seen_ptr) - 1).to(tl.int32)
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
            ok = h_ok & (slot >= 0) & (slot < capacity)
            m = ok[:, None] & d_ok[None, :]
            k = tl.load(knew_ptr + b * s_nb + hh[:, None] * s_nh + d[None, :] * s_nd, mask=m, other=0.0)
            v = tl.load(vnew_ptr + b * s_wb + hh[:, None] * s_wh + d[None, :] * s_wd, mask=m, other=0.0)
            tl.store(keys_ptr + b * s_kb + hh[:, None] * s_kh + slot[:, None] * s_kc + d[None, :] * s_kd, k, mask=m)
            tl.store(values_ptr + b * s_vb + hh[:, None] * s_vh + slot[:, None] * s_vc + d[None, :] * s_vd, v, mask=m)
            tl.store(pos_ptr + b * s_pb + hh * s_ph + slot * s_pc, column, mask=ok)
            # KT: fold the key into its page (every step of this is idempotent, so replicated lanes are harmless)
            page = slot // P
            fresh = ((slot % P) == 0)[:, None]
            mk = m & (page < num_pages)[:, None]
            kt_at = kt_ptr + b * s_tb + hh[:, None] * s_th + page[:, None] * s_tp + d[None, :] * s_td
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
        batch, num_kv_heads, capacity, head_dim = keys.shape
        if batch * num_kv_heads == 0:
            return
        s_lb, s_lh = count_strides(lengths, batch, num_kv_heads, "lengths")
        block_d = next_pow2(head_dim)
        block_h = min(next_pow2(num_kv_heads), max(1, 2048 // block_d))
        tile = block_h * block_d
        wrap_triton(_append_token_kernel)[(batch,)](
            keys, values, positions, kt, lengths, seen, key_new, value_new,
            *keys.stride(), *values.stride(), *positions.stride(), *kt.stride(), s_lb, s_lh,
            *key_new.stride(), *value_new.stride(),
            num_kv_heads, capacity, kt.shape[2], head_dim,
            P=page_size, BLOCK_H=block_h, BLOCK_D=block_d, KT_DT=dtype_code(kt.dtype), PER_HEAD=s_lh != 0,
            num_warps=4 if tile >= 2048 else (2 if tile >= 512 else 1),
        )
