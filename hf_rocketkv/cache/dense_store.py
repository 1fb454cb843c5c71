"""A layer's dense store until stage 1: contiguous K/V ``[B, Hkv, T, D]`` where slot s holds input column s (left
padding included), exactly like a DynamicLayer, so prefill attention is plain causal attention; a prefix hit starts
it from the pool's pages; a chunked prefill's later chunks are written into one buffer of the prompt's width (the
store is then a view of its first columns)."""

from __future__ import annotations

import weakref

import torch


def start_dense(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """At ``layer``'s first update (``[B, Hkv, n, D]``): an empty store ``[B, Hkv, 0, D]``, or a prefix hit's
    ``[B, Hkv, prefix_tokens + n, D]``: the hit tokens, gathered from the pool's pages, then room for this forward's
    tokens, which ``append_dense`` copies in (not concatenated to a copy of 32k prefix columns); ``dense_room`` says
    how many columns at its end are unwritten."""
    if layer.prefix_tokens:
        # a replayed hit (``seed_prefix(tokens, start)``): the forward's replayed columns are not stored
        layer.dense_room = key_states.shape[2] - layer.replayed_columns(key_states.shape[2])
        layer._keys, layer._values = layer.pages.prefix_keys(layer, key_states, room=layer.dense_room)
        layer.seen.fill_(layer.prefix_tokens if layer.replay_pos is None else layer.replay_pos)
    else:
        layer._keys = key_states.new_empty((key_states.shape[0], key_states.shape[1], 0, key_states.shape[3]))
        layer._values = value_states.new_empty((value_states.shape[0], value_states.shape[1], 0,
                                                value_states.shape[3]))


def append_dense(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Append a prefill forward's K/V ``[B, Hkv, n, D]`` to ``layer``'s dense store: into the room a prefix hit's
    store left for them; a chunk after the first into a buffer sized once for the whole prompt (``dense_buffers``),
    else by concatenation (a new buffer). Tagged for ``layer_of``."""
    n = key_states.shape[2]
    if layer.dense_room:
        if n != layer.dense_room:
            raise RuntimeError(f"a prefix hit's dense store has room for {layer.dense_room} tokens, got {n}")
        layer._keys[:, :, -n:].copy_(key_states)
        layer._values[:, :, -n:].copy_(value_states)
        layer.dense_room = 0
    elif layer._keys.shape[2] == 0:
        layer._keys, layer._values = key_states, value_states
    else:
        filled = layer._keys.shape[2]
        keys, values = _room_for(layer, filled + n)
        if keys is None:
            layer._keys = torch.cat([layer._keys, key_states], dim=-2)
            layer._values = torch.cat([layer._values, value_states], dim=-2)
        else:
            keys[:, :, filled:filled + n].copy_(key_states)
            values[:, :, filled:filled + n].copy_(value_states)
            layer._keys, layer._values = keys[:, :, :filled + n], values[:, :, :filled + n]
    layer._tag_keys()  # a new dense buffer (or view) every forward but a prefix hit's first (eager: never compiled)


def _room_for(layer, needed: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Buffers ``[B, Hkv, C, D]`` whose first columns are ``layer``'s dense store, with ``C >= needed``: the ones an
    earlier chunk made while the store is still a view of them, else new ones of the prefill's whole width
    (``hints.prefill_columns``, the store's columns copied in). Concatenating at every chunk instead would copy the
    prompt so far once per chunk (quadratic in the chunks, and a new allocation each time). (None, None) without
    that width, or when the store is wider than it says: the caller concatenates.

    Held through weak references: the views in ``_keys`` / ``_values`` keep them alive, so they go with the dense
    store (stage 1's compaction, a reset) and never outlive it."""
    refs = layer.dense_buffers
    keys, values = (refs[0](), refs[1]()) if refs is not None else (None, None)
    if (keys is not None and values is not None and layer._keys._base is keys and layer._values._base is values
            and keys.shape[2] >= needed):
        return keys, values
    capacity = layer.hints.prefill_columns
    if capacity is None or capacity < needed:
        return None, None
    filled = layer._keys.shape[2]
    batch, heads, _, dim = layer._keys.shape
    keys = layer._keys.new_empty((batch, heads, capacity, dim))
    values = layer._values.new_empty((batch, heads, capacity, layer._values.shape[3]))
    keys[:, :, :filled].copy_(layer._keys)
    values[:, :, :filled].copy_(layer._values)
    layer.dense_buffers = (weakref.ref(keys), weakref.ref(values))
    return keys, values
