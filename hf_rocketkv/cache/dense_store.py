"""A layer's dense store until stage 1: contiguous K/V ``[B, Hkv, T, D]`` where slot s holds input column s (left
padding included), exactly like a DynamicLayer, so prefill attention is plain causal attention; a prefix hit starts
it from the pool's pages."""

from __future__ import annotations

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
    store left for them, else by concatenation (a new buffer, tagged for ``layer_of``)."""
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
        layer._keys = torch.cat([layer._keys, key_states], dim=-2)
        layer._values = torch.cat([layer._values, value_states], dim=-2)
    layer._tag_keys()  # a new dense buffer every forward but a prefix hit's first (eager: prefill never compiles)
