"""Exact attention of one decode query over a sliding-window layer's ring, read in place.

A sliding-window layer decodes into a ring of ``W`` slots per row and KV head: logical position ``p`` lives in slot
``p % W`` (``cache/sliding_layer.py``). After this step's token is written, a row that has seen ``n`` tokens (the new
one included) holds positions ``max(0, n - W) .. n - 1``, all of them visible to the new query (its window is the
last ``W`` positions, itself included): slot ``s`` is filled iff ``s < min(n, W)``.

Shapes (B batch, Hkv KV heads, G query heads per KV head, W window, D head_dim, N store rows):
    q:         [B, Hkv, G, D]
    keys/values: [N, Hkv, W, D] the rings (any strides); batch row b reads store row ``rows[b]``
    seen:      [B] or [] int64: tokens row b has seen, this step's included (a 0-d tensor: every row the same)
    rows:      [B] int64 store rows, or None (N == B, row b reads ring b): the engine's rows are slots of the
               pool's slab, read where they lie (no per-step gather)
    mask:      [B or 1, W] bool, or None: transformers' decode mask for the row, in column order (column ``c`` is
               position ``max(0, n - W) + c``, the columns of ``get_mask_sizes(1)``); it hides left padding that
               is still inside the window. Slot s is column ``(s - max(0, n - W)) % W``.
    returns    [B, Hkv, G, D] in q's dtype

Logit features as in ``sparse_decode_attention``: ``softcap`` c, ``l = tanh(q.k * scaling / c) * c``; ``sinks``
``[Hq]`` (query head ``h * G + g``) join each head's softmax denominator. A row with nothing visible attends to
nothing (zeros).

The Triton kernel is flash-decoding over the ring's slots: grid (B*Hkv, S), program (row, KV head, split) reads its
share of the W slots once for all G query heads of the group (no ``repeat_kv``), the mask reordered in the kernel
from the row's count (no per-step index ops), and the splits are combined by ``sparse_decode_attention``'s reduce
kernel. ``ring_decode_attention_triton`` is registered as torch.ops.hf_rocketkv.ring_decode_attention by
triton_ops.
"""

from __future__ import annotations

import torch

from ..selection.logit_features import soft_cap, softmax_with_sinks
from .sparse_decode_attention import checked_softcap, grouped_sinks


def check_ring_arguments(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor,
                         rows: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    """ValueError naming the argument whose shape or dtype does not fit the module docstring's contract."""
    if q.dim() != 4 or keys.dim() != 4 or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"ring_decode_attention: q must be [B, Hkv, G, D] and keys / values [N, Hkv, W, D] with the "
                         f"same first three sizes, got {list(q.shape)}, {list(keys.shape)}, {list(values.shape)}")
    batch, heads, _, dim = q.shape
    if keys.shape[1] != heads or keys.shape[3] != dim or values.shape[3] != dim:
        raise ValueError(f"ring_decode_attention: keys / values {list(keys.shape)} must have q's {heads} KV heads "
                         f"and head_dim {dim}")
    if seen.dtype != torch.long or seen.shape not in ((), (batch,)):
        raise ValueError(f"ring_decode_attention: seen must be int64 of shape [] or [{batch}], got {seen.dtype} "
                         f"{list(seen.shape)}")
    if rows is None and keys.shape[0] != batch:
        raise ValueError(f"ring_decode_attention: without rows the store must have the batch's {batch} rows, got "
                         f"{keys.shape[0]}")
    if rows is not None and (rows.dtype != torch.long or rows.shape != (batch,)):
        raise ValueError(f"ring_decode_attention: rows must be int64 of shape [{batch}], got {rows.dtype} "
                         f"{list(rows.shape)}")
    window = keys.shape[2]
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] not in (1, batch)
                             or mask.shape[1] != window):
        raise ValueError(f"ring_decode_attention: mask must be bool [{batch} or 1, {window}] or None, got "
                         f"{mask.dtype} {list(mask.shape)}")


def ring_slots_visible(seen: torch.Tensor, batch: int, window: int, mask: torch.Tensor | None) -> torch.Tensor:
    """``[B, W]`` bool: the slots row b's new query attends (filled, and allowed by the mask in column order)."""
    count = seen.reshape(-1, 1).expand(batch, 1)
    slot = torch.arange(window, device=seen.device)[None, :]
    visible = slot < count.clamp(max=window)
    if mask is not None:
        first = (count - window).clamp(min=0)  # the position in column 0
        column = torch.remainder(slot - first, window)
        visible = visible & mask.expand(batch, window).gather(1, column)
    return visible


def ring_decode_attention_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seen: torch.Tensor,
    scaling: float,
    rows: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: the rows' rings, fp32 (soft-capped) logits over the visible slots, softmax with the sinks in the
    denominator, weighted sum of the values."""
    check_ring_arguments(q, keys, values, seen, rows, mask)
    batch, heads, group, _ = q.shape
    if rows is not None:
        keys, values = keys.index_select(0, rows), values.index_select(0, rows)
    visible = ring_slots_visible(seen, batch, keys.shape[2], mask)
    logits = soft_cap(torch.einsum("bhgd,bhnd->bhgn", q.float(), keys.float()) * scaling, checked_softcap(softcap))
    logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
    grouped = grouped_sinks(sinks, heads, group)
    probs = softmax_with_sinks(logits, grouped[None, :, :, None] if grouped is not None else None)
    return torch.einsum("bhgn,bhnd->bhgd", probs, values.float()).to(q.dtype)


# ---------------------------------------------------------------------------------------------------- Triton twin
try:
    import triton
    import triton.language as tl

    from ._triton_common import cdiv, dtype_code, interpreting, next_pow2, num_sms, tanh_f32
    from .flash_decoding import finish_split, online_softmax_step
    from .launch import TritonLaunch
    from .sparse_decode_attention import combine_splits
except ImportError:  # triton is optional: the reference above works without it
    triton = None

if triton is not None:
    @triton.jit
    def _ring_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, seen_ptr, rows_ptr, mask_ptr, out_ptr, part_o_ptr, part_lse_ptr, sink_ptr,
        s_qb, s_qh, s_qg, s_qd,
        s_kn, s_kh, s_kw, s_kd,
        s_vn, s_vh, s_vw, s_vd,
        s_sb, s_mb, s_mw,
        s_ob, s_oh, s_og, s_od,
        num_kv_heads, group, head_dim, window, slots_per_split, num_splits,
        scale_log2, cap_log2,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        QK_FP32: tl.constexpr, PV_FP32: tl.constexpr, OUT_DT: tl.constexpr, DIRECT: tl.constexpr,
        ROWS: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (bh // num_kv_heads).to(tl.int64)
        h = (bh % num_kv_heads).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < group
        d_ok = d < head_dim
        count = tl.load(seen_ptr + b * s_sb).to(tl.int64)
        filled = tl.minimum(count, window)
        first = tl.maximum(count - window, 0)  # the position in mask column 0
        shift = window - first % window  # column of slot s: (s + shift) % window
        if ROWS:
            r = tl.load(rows_ptr + b).to(tl.int64)
        else:
            r = b
        q = tl.load(q_ptr + b * s_qb + h * s_qh + g[:, None] * s_qg + d[None, :] * s_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if QK_FP32:
            q = q.to(tl.float32)
        k_base = k_ptr + r * s_kn + h * s_kh + d[None, :] * s_kd
        v_base = v_ptr + r * s_vn + h * s_vh + d[None, :] * s_vd
        s_start = split * slots_per_split
        s_end = tl.minimum(s_start + slots_per_split, filled.to(tl.int32))  # loop bounds of one type

        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        for s0 in range(s_start, s_end, BLOCK_N):
            s = s0 + tl.arange(0, BLOCK_N)
            ok = s < s_end
            if MASK:
                column = (s + shift) % window
                ok = ok & (tl.load(mask_ptr + b * s_mb + column * s_mw, mask=ok, other=0) != 0)
            slot = tl.where(ok, s, 0).to(tl.int64)
            kv_mask = ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + slot[:, None] * s_kw, mask=kv_mask, other=0.0)
            v = tl.load(v_base + slot[:, None] * s_vw, mask=kv_mask, other=0.0)
            if QK_FP32:
                logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                logits = tl.dot(q, tl.trans(k))
            # scale_log2: scaling * log2(e), or scaling / softcap with SOFTCAP (then tanh, times softcap * log2(e))
            logits = (logits.to(tl.float32) * scale_log2).to(tl.float32)
            if SOFTCAP:
                logits = (tanh_f32(logits) * cap_log2).to(tl.float32)
            logits = tl.where(ok[None, :], logits, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(logits, m_i, l_i)
            if PV_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:  # probabilities rounded to V's half type, fp32 accumulation (as flash attention does)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        finish_split(acc, m_i, l_i, sink_ptr, out_ptr, part_o_ptr, part_lse_ptr, b, h, bh, split, num_splits,
                     group, head_dim, s_ob, s_oh, s_og, s_od, BLOCK_G, BLOCK_D, OUT_DT, DIRECT, SINKS)

    _ring_decode_split_launch = TritonLaunch(_ring_decode_split_kernel)

    def ring_decode_attention_launch(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        seen: torch.Tensor,
        scaling: float,
        rows: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        num_splits: int | None = None,
        block_n: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
    ) -> torch.Tensor:
        """Launcher; ``num_splits`` (None = heuristic from the shapes, 1 = one kernel, no reduce) and the tile knobs
        (None = the defaults below) exist for tests and benchmarks. Launch sizes come from shapes only: no host sync,
        CUDA-graph safe.

        Defaults (``benchmarks/probes/tune_ring_attention.py``, H200, bf16): splits so that the (row, KV head,
        split) programs make about four waves of the GPU (a program reads its slots serially: one program per
        (row, KV head) over a 1024-slot window of head_dim 256 took 92 us at 16 rows, four splits 47 us); head_dim
        above 128 with 16-bit K/V takes tiles of 64 slots on 8 warps in one stage while the (row, KV head) programs
        are under a quarter of the SMs (Gemma 3 at batch 1: 9.0 us against 11.1 with 4 warps and 2 stages) and of
        32 slots on 4 warps in two stages beyond (16 rows: 47 us)."""
        check_ring_arguments(q, keys, values, seen, rows, mask)
        batch, num_kv_heads, group, head_dim = q.shape
        softcap = checked_softcap(softcap)
        if sinks is not None:
            grouped_sinks(sinks, num_kv_heads, group)  # shape check only: the kernels read [Hq] as it is
            sinks = sinks.contiguous()
        out = torch.empty((batch, num_kv_heads, group, head_dim), dtype=q.dtype, device=q.device)
        if out.numel() == 0:
            return out
        window = keys.shape[2]
        block_g = max(16, next_pow2(group))
        block_d = next_pow2(head_dim)
        wide = keys.dtype in (torch.bfloat16, torch.float16)
        programs = batch * num_kv_heads
        sms = num_sms(q.device)
        few = 4 * programs <= sms  # few (row, KV head) programs: batch 1-4 at 8 KV heads on an H200
        if block_d <= 128:
            block_n = block_n or (128 if wide else 64)
            num_warps = num_warps or (4 if wide else (8 if block_n * block_d >= 64 * 128 else 4))
            num_stages = num_stages or 2
        elif wide:
            block_n = block_n or (64 if few else 32)
            num_warps = num_warps or (8 if few else 4)
            num_stages = num_stages or (1 if few else 2)
        else:
            block_n, num_warps, num_stages = block_n or 32, num_warps or 8, num_stages or 2
        max_splits = max(1, cdiv(window, block_n))
        if num_splits is None:  # about four waves of (row, KV head, split) programs
            num_splits = min(max_splits, max(1, cdiv(4 * sms, programs)))
        num_splits = max(1, min(num_splits, max_splits))
        slots_per_split = cdiv(cdiv(window, num_splits), block_n) * block_n
        num_splits = max(1, cdiv(window, slots_per_split))
        direct = num_splits == 1
        if direct:
            part_o = part_lse = out  # unused
        else:
            part_o = torch.empty((programs * num_splits * block_g, block_d), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((programs * num_splits * block_g,), dtype=torch.float32, device=q.device)
        code = dtype_code(keys.dtype)
        qk_fp32 = code == 0 or interpreting() or q.dtype != keys.dtype
        pv_fp32 = code == 0 or interpreting() or values.dtype != keys.dtype
        _ring_decode_split_launch[(programs, num_splits)](
            q, keys, values, seen, rows if rows is not None else seen, mask if mask is not None else seen,
            out, part_o, part_lse, sinks if sinks is not None else q,  # unused pointers: any tensor
            *q.stride(), *keys.stride(), *values.stride(),
            seen.stride(0) if seen.dim() else 0,
            *((mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1)) if mask is not None else (0, 0)),
            *out.stride(),
            num_kv_heads, group, head_dim, window, slots_per_split, num_splits,
            scaling * 1.4426950408889634 if softcap is None else scaling / softcap,
            (softcap or 0.0) * 1.4426950408889634,
            BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
            QK_FP32=qk_fp32, PV_FP32=pv_fp32, OUT_DT=dtype_code(q.dtype), DIRECT=direct,
            ROWS=rows is not None, MASK=mask is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
            num_warps=num_warps, num_stages=num_stages,
        )
        if not direct:
            combine_splits(part_o, part_lse, out, sinks, num_splits, block_g, block_d)
        return out

    def ring_decode_attention_triton(
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        seen: torch.Tensor,
        scaling: float,
        rows: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same contract as ``ring_decode_attention_torch`` (registered as a triton_op in ``triton_ops``)."""
        return ring_decode_attention_launch(q, keys, values, seen, scaling, rows, mask, softcap, sinks)
