"""A decode step's write on a compressed layer: each row's new token into slot ``lengths[b]`` through the block table,
its key folded into the KT page, and keep_all's history beside it.

Shapes (B batch, Hkv KV heads, D head_dim): the step's ``key_states`` / ``value_states`` ``[B, Hkv, 1, D]``; the
kernels take the token as ``[B, Hkv, D]``. No host sync and no shape change, so a compiled decode step replays as
one CUDA graph; eager steps on CUDA replay the launches through the layer's "append" OpGraph (``op_graphs.py``).
"""

from __future__ import annotations

import torch

from .capacity import grow_view
from .history import grow_history
from .op_graphs import buffers_key


def append_one(layer, key_states: torch.Tensor, value_states: torch.Tensor, graphed: bool = False) -> None:
    """Write the token of every row of ``layer`` in place and count it in ``seen``. Capacity comes from generate()'s
    max_length; in eager mode the store grows when a caller runs past it. ``graphed`` (eager steps,
    ``RocketKVLayer.eager_graphs()``): the append through the layer's "append" OpGraph. The count advances inside
    the append's launch (``advance_seen``), except on a plain eager step, whose capacity check reads it first."""
    eager = layer.host_bookkeeping()  # compiled/graphed steps: their runner counts on the host
    if eager and not graphed:
        layer.seen.add_(1)
    if eager:
        layer.maybe_compress_decode()
        ensure_capacity(layer, 1)
        layer.note_decode_step()
    store, history = layer.store, layer.history
    if graphed:
        key = buffers_key(store.k, store.v, store.kt, store.table, layer.positions, layer.lengths, layer.seen,
                          store.k_scale, store.v_scale)
        layer.op_graphs["append"](key, lambda k, v: _append_token(layer, k, v, advance_seen=True),
                                  key_states[:, :, 0], value_states[:, :, 0], hints=layer.hints)
        return
    _append_token(layer, key_states[:, :, 0], value_states[:, :, 0], advance_seen=not eager)
    if history is not None:  # keep_all: the full history too
        layer.ops.paged_append_kv(
            history.store.k, history.store.v, history.store.table, history.positions, history.lengths,
            layer.seen, key_states[:, :, 0], value_states[:, :, 0],
            k_scale=history.store.k_scale, v_scale=history.store.v_scale,
        )


def ensure_capacity(layer, extra: int) -> None:
    """Room for ``extra`` more tokens in every row of ``layer`` (eager): keep_all's history, then the view."""
    if layer.history is not None:
        grow_history(layer, extra)
    grow_view(layer, extra)


def _append_token(layer, key_new: torch.Tensor, value_new: torch.Tensor, advance_seen: bool) -> None:
    """The token ``[B, Hkv, D]`` into slot lengths[b] of every row and its key into the KT page (``advance_seen``:
    and ``seen`` += 1, in the same launch where the kernel owns the count)."""
    store = layer.store
    layer.ops.paged_append_token(
        store.k, store.v, store.kt, store.table, layer.positions, layer.lengths, layer.seen, key_new, value_new,
        layer.config.page_size, k_scale=store.k_scale, v_scale=store.v_scale, advance_seen=advance_seen,
    )
