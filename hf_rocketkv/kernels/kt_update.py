"""Triton twin of ``stage2_pages.update_kt``: fold one new key per row into its KT page, in place (every decode step).

Shapes (B batch, Hkv KV heads, NP pages, D head_dim, P page_size):
    kt:      [B, Hkv, NP, 2, D]  KT dtype (fp32 / fp16 / bf16 / float8_e5m2), updated in place
    key_new: [B, Hkv, D]         the key just written at ``slot[b]`` (any strides, e.g. ``key_states[:, :, 0]``)
    slot:    [B] or [B, Hkv]     int, its slot (per row, or per row and KV head); page = slot // P. ``slot % P == 0``
                                 starts a fresh page (overwrite), otherwise min/max with the stored summary. Slots
                                 past the KT are ignored.

Grid (B*Hkv,): one program per (row, KV head) reads 2*D summary values and D key values. No host syncs, so it is
safe inside CUDA graphs; registered as ``torch.ops.hf_rocketkv.update_kt`` (mutates ``kt``) for torch.compile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import TritonLaunch

from ._triton_common import cast_to, count_strides, dtype_code, next_pow2


@triton.jit
def _update_kt_kernel(
    kt_ptr, key_ptr, slot_ptr,
    s_tb, s_th, s_tp, s_tm, s_td,
    s_kb, s_kh, s_kd,
    s_sb, s_sh,
    num_kv_heads, num_pages, head_dim,
    P: tl.constexpr, BLOCK_D: tl.constexpr, KT_DT: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // num_kv_heads).to(tl.int64)
    h = (bh % num_kv_heads).to(tl.int64)
    slot = tl.load(slot_ptr + b * s_sb + h * s_sh).to(tl.int64)
    page = slot // P
    fresh = (slot % P) == 0
    d = tl.arange(0, BLOCK_D)
    in_range = (page < num_pages) & (slot >= 0)
    m = d < tl.where(in_range, head_dim, 0)
    k = tl.load(key_ptr + b * s_kb + h * s_kh + d * s_kd, mask=m, other=0.0).to(tl.float32)
    base = kt_ptr + b * s_tb + h * s_th + page * s_tp + d * s_td
    cur_min = tl.load(base, mask=m, other=0.0).to(tl.float32)
    cur_max = tl.load(base + s_tm, mask=m, other=0.0).to(tl.float32)
    new_min = tl.where(fresh, k, tl.minimum(cur_min, k))
    new_max = tl.where(fresh, k, tl.maximum(cur_max, k))
    tl.store(base, cast_to(new_min, KT_DT), mask=m)
    tl.store(base + s_tm, cast_to(new_max, KT_DT), mask=m)

_update_kt_launch = TritonLaunch(_update_kt_kernel)


def update_kt_triton(kt: torch.Tensor, key_new: torch.Tensor, slot: torch.Tensor, page_size: int) -> None:
    """Same contract as ``stage2_pages.update_kt``."""
    batch, num_kv_heads, num_pages, _, head_dim = kt.shape
    if batch * num_kv_heads == 0:
        return
    _update_kt_launch[(batch * num_kv_heads,)](
        kt, key_new, slot,
        *kt.stride(), *key_new.stride(), *count_strides(slot, batch, num_kv_heads, "slot"),
        num_kv_heads, num_pages, head_dim,
        P=page_size, BLOCK_D=next_pow2(head_dim), KT_DT=dtype_code(kt.dtype),
        num_warps=1 if head_dim <= 128 else 2,
    )
