"""One decode token per row into a sliding-window layer's ring, in place.

Shapes (B batch, Hkv KV heads, W window, D head_dim, N store rows):
    keys/values:         [N, Hkv, W, D] the rings (any strides), written in place
    seen:                [B] or [] int64: tokens row b has seen before this one (its position); advanced by 1 here
                         with ``advance_seen=True``, else left to the caller
    key_new / value_new: [B, Hkv, 1, D] this step's token
    rows:                [B] int64 store rows, or None (N == B)
    kept_keys / kept_values: [B, Hkv, 1, D] or None: where given (both), row b's slot as it was before this write
                         is copied there first (generate()'s deferred stop check can then take the step back:
                         ``cache/ring.py``, ``Ring.undo_append``); no launch of its own

Row b's token goes to ``keys[rows[b], :, seen[b] % W]`` (``cache/sliding_layer.py``: position p lives in slot
``p % W``). The Triton kernel is one program per row copying its KV heads' D values of K and of V as one tile: one
launch where the PyTorch form takes a remainder and two index writes. A program owns its row's count (``[B]``
counts, or a 0-d count and one row), so with ``advance_seen`` it advances it after every lane has read it, and a
decode step's count costs no launch of its own; a 0-d count shared by several rows is advanced by one ``add_`` after
the launch.
"""

from __future__ import annotations

import torch

from .append_token import check_advanceable


def check_append_arguments(keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, key_new: torch.Tensor,
                           value_new: torch.Tensor, rows: torch.Tensor | None) -> None:
    """ValueError naming the argument whose shape or dtype does not fit the module docstring's contract."""
    batch = key_new.shape[0]
    if key_new.dim() != 4 or key_new.shape[2] != 1 or value_new.shape != key_new.shape:
        raise ValueError(f"ring_append: key_new / value_new must be [B, Hkv, 1, D] of the same shape, got "
                         f"{list(key_new.shape)}, {list(value_new.shape)}")
    if keys.dim() != 4 or values.shape[:3] != keys.shape[:3] or keys.shape[1] != key_new.shape[1] \
            or keys.shape[3] != key_new.shape[3] or values.shape[3] != value_new.shape[3]:
        raise ValueError(f"ring_append: keys / values must be [N, Hkv, W, D] with key_new's heads and head_dim, got "
                         f"{list(keys.shape)}, {list(values.shape)} for key_new {list(key_new.shape)}")
    if seen.dtype != torch.long or seen.shape not in ((), (batch,)):
        raise ValueError(f"ring_append: seen must be int64 of shape [] or [{batch}], got {seen.dtype} "
                         f"{list(seen.shape)}")
    if rows is None and keys.shape[0] != batch:
        raise ValueError(f"ring_append: without rows the store must have the batch's {batch} rows, got "
                         f"{keys.shape[0]}")
    if rows is not None and (rows.dtype != torch.long or rows.shape != (batch,)):
        raise ValueError(f"ring_append: rows must be int64 of shape [{batch}], got {rows.dtype} {list(rows.shape)}")


def check_kept(keys: torch.Tensor, values: torch.Tensor, key_new: torch.Tensor, kept_keys: torch.Tensor | None,
               kept_values: torch.Tensor | None) -> bool:
    """Whether the append keeps the slots it overwrites; ValueError naming the argument that does not fit."""
    if (kept_keys is None) != (kept_values is None):
        raise ValueError("ring_append: kept_keys and kept_values come together (both tensors or both None)")
    if kept_keys is None:
        return False
    shape = (*key_new.shape[:2], 1, key_new.shape[3])
    for name, kept, store in (("kept_keys", kept_keys, keys), ("kept_values", kept_values, values)):
        if tuple(kept.shape) != shape or kept.dtype != store.dtype:
            raise ValueError(f"ring_append: {name} must be {list(shape)} of the store's {store.dtype}, got "
                             f"{list(kept.shape)} {kept.dtype}")
    return True


def ring_append_torch(keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, key_new: torch.Tensor,
                      value_new: torch.Tensor, rows: torch.Tensor | None = None, advance_seen: bool = False,
                      kept_keys: torch.Tensor | None = None, kept_values: torch.Tensor | None = None) -> None:
    """Reference: one indexed write of K and one of V (then ``seen += 1`` with ``advance_seen``); with ``kept_*``,
    one indexed read of each first."""
    check_append_arguments(keys, values, seen, key_new, value_new, rows)
    keep = check_kept(keys, values, key_new, kept_keys, kept_values)
    batch, heads = key_new.shape[:2]
    check_advanceable(seen, batch, advance_seen, "ring_append")
    slot = torch.remainder(seen, keys.shape[2]).reshape(-1, 1).expand(batch, heads)
    row = (rows if rows is not None else torch.arange(batch, device=keys.device))[:, None].expand(batch, heads)
    head = torch.arange(heads, device=keys.device)[None, :].expand(batch, heads)
    if keep:
        kept_keys[:, :, 0] = keys[row, head, slot]
        kept_values[:, :, 0] = values[row, head, slot]
    keys[row, head, slot] = key_new[:, :, 0].to(keys.dtype)
    values[row, head, slot] = value_new[:, :, 0].to(values.dtype)
    if advance_seen:
        seen.add_(1)


try:
    import triton
    import triton.language as tl

    from ._triton_common import kernel_owns_count, next_pow2
    from .launch import TritonLaunch
except ImportError:  # triton is optional: the reference above works without it
    triton = None

if triton is not None:
    @triton.jit
    def _ring_append_kernel(
        k_ptr, v_ptr, seen_ptr, rows_ptr, kn_ptr, vn_ptr, kk_ptr, kv_ptr,
        s_kn, s_kh, s_kw, s_kd,
        s_vn, s_vh, s_vw, s_vd,
        s_sb,
        s_ab, s_ah, s_ad,
        s_bb, s_bh, s_bd,
        s_kkb, s_kkh, s_kkd,
        s_kvb, s_kvh, s_kvd,
        num_kv_heads, head_dim, window,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, ADVANCE: tl.constexpr, KEEP: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        m = (h < num_kv_heads)[:, None] & (d < head_dim)[None, :]
        seen = tl.load(seen_ptr + b * s_sb)
        slot = seen.to(tl.int64) % window
        if ROWS:
            r = tl.load(rows_ptr + b).to(tl.int64)
        else:
            r = b
        k = tl.load(kn_ptr + b * s_ab + h[:, None] * s_ah + d[None, :] * s_ad, mask=m)
        v = tl.load(vn_ptr + b * s_bb + h[:, None] * s_bh + d[None, :] * s_bd, mask=m)
        if KEEP:  # the slot as it was, before this token replaces it
            old_k = tl.load(k_ptr + r * s_kn + h[:, None] * s_kh + slot * s_kw + d[None, :] * s_kd, mask=m)
            old_v = tl.load(v_ptr + r * s_vn + h[:, None] * s_vh + slot * s_vw + d[None, :] * s_vd, mask=m)
            tl.store(kk_ptr + b * s_kkb + h[:, None] * s_kkh + d[None, :] * s_kkd, old_k, mask=m)
            tl.store(kv_ptr + b * s_kvb + h[:, None] * s_kvh + d[None, :] * s_kvd, old_v, mask=m)
            tl.debug_barrier()  # every lane has read the slot before any lane writes it
        tl.store(k_ptr + r * s_kn + h[:, None] * s_kh + slot * s_kw + d[None, :] * s_kd, k.to(k_ptr.dtype.element_ty),
                 mask=m)
        tl.store(v_ptr + r * s_vn + h[:, None] * s_vh + slot * s_vw + d[None, :] * s_vd, v.to(v_ptr.dtype.element_ty),
                 mask=m)
        if ADVANCE:
            tl.debug_barrier()  # every lane has read the count before it advances
            tl.store(seen_ptr + b * s_sb, seen + 1)

    _ring_append_launch = TritonLaunch(_ring_append_kernel)

    def ring_append_triton(keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, key_new: torch.Tensor,
                           value_new: torch.Tensor, rows: torch.Tensor | None = None,
                           advance_seen: bool = False, kept_keys: torch.Tensor | None = None,
                           kept_values: torch.Tensor | None = None) -> None:
        """Same contract as ``ring_append_torch`` (registered as a triton_op in ``triton_ops``); one launch."""
        check_append_arguments(keys, values, seen, key_new, value_new, rows)
        keep = check_kept(keys, values, key_new, kept_keys, kept_values)
        batch, heads, _, dim = key_new.shape
        check_advanceable(seen, batch, advance_seen, "ring_append")
        advance = advance_seen and batch * heads > 0 and kernel_owns_count(seen, batch)
        if batch * heads > 0:
            block_h, block_d = next_pow2(heads), next_pow2(dim)
            _ring_append_launch[(batch,)](
                keys, values, seen, rows if rows is not None else seen, key_new, value_new,
                kept_keys if keep else keys, kept_values if keep else values,
                *keys.stride(), *values.stride(), seen.stride(0) if seen.dim() else 0,
                key_new.stride(0), key_new.stride(1), key_new.stride(3),
                value_new.stride(0), value_new.stride(1), value_new.stride(3),
                *((kept_keys.stride(0), kept_keys.stride(1), kept_keys.stride(3)) if keep else (0, 0, 0)),
                *((kept_values.stride(0), kept_values.stride(1), kept_values.stride(3)) if keep else (0, 0, 0)),
                heads, dim, keys.shape[2],
                BLOCK_H=block_h, BLOCK_D=block_d, ROWS=rows is not None, ADVANCE=advance, KEEP=keep,
                num_warps=max(1, min(8, block_h * block_d // 256)),
            )
        if advance_seen and not advance:  # a count shared by several rows' programs (or no launch)
            seen.add_(1)
