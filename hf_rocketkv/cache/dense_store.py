"""A layer's contiguous K/V: the dense store until stage 1, a later turn's working set until stage 1 runs again.

The dense store is ``[B, Hkv, T, D]`` where slot s holds input column s (left padding included), exactly like a
DynamicLayer, so prefill attention is plain causal attention; a prefix hit starts it from the pool's pages; a chunked
prefill's later chunks are written into one buffer of the prompt's width (the store is then a view of its first
columns). A later turn's working set (``working_set.py``) is held here too: the kept tokens, then the turn's new ones.
"""

from __future__ import annotations

import weakref

import torch


class DenseStore:
    """One layer's contiguous K/V (module docstring); the layer holds one and is its only user.

        keys, values  [B, Hkv, T, D], or None (before the first update; compressed with no later turn in flight)
        room          columns at the end of a prefix hit's store that its first forward fills (``append``)
        buffers       weak references to a chunked prefill's whole-prompt buffers, of which keys / values are views
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.room = 0
        self.buffers: tuple[weakref.ref, weakref.ref] | None = None

    def hold(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        """Hold ``keys`` / ``values`` ``[B, Hkv, T, D]`` as they are (a working set, rows picked by index); None, None
        releases the store (stage 1 compacted it)."""
        self.keys, self.values = keys, values

    def start(self, key_states: torch.Tensor, value_states: torch.Tensor,
              hit: tuple[torch.Tensor, torch.Tensor] | None = None, room: int = 0) -> None:
        """At the layer's first update (``[B, Hkv, n, D]``): an empty store ``[B, Hkv, 0, D]``, or a prefix hit's
        ``hit`` K/V ``[B, Hkv, hit tokens + room, D]`` gathered from the pool's pages, whose last ``room`` columns
        this forward's tokens fill (not concatenated to a copy of 32k prefix columns)."""
        if hit is not None:
            self.keys, self.values = hit
            self.room = room
            return
        batch, heads, _, dim = key_states.shape
        self.keys = key_states.new_empty((batch, heads, 0, dim))
        self.values = value_states.new_empty((batch, heads, 0, value_states.shape[3]))

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, prefill_columns: int | None) -> None:
        """A prefill forward's K/V ``[B, Hkv, n, D]`` after the stored columns: into the room a prefix hit's store
        left for them; a chunk after the first into a buffer sized once for the whole prompt (``prefill_columns``
        wide, None: unknown), else by concatenation (a new buffer)."""
        n = key_states.shape[2]
        if self.room:
            if n != self.room:
                raise RuntimeError(f"a prefix hit's dense store has room for {self.room} tokens, got {n}")
            self.keys[:, :, -n:].copy_(key_states)
            self.values[:, :, -n:].copy_(value_states)
            self.room = 0
        elif self.keys.shape[2] == 0:
            self.keys, self.values = key_states, value_states
        else:
            filled = self.keys.shape[2]
            keys, values = self._room_for(filled + n, prefill_columns)
            if keys is None:
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
            else:
                keys[:, :, filled:filled + n].copy_(key_states)
                values[:, :, filled:filled + n].copy_(value_states)
                self.keys, self.values = keys[:, :, :filled + n], values[:, :, :filled + n]

    def _room_for(self, needed: int, prefill_columns: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Buffers ``[B, Hkv, C, D]`` whose first columns are the store, with ``C >= needed``: the ones an earlier
        chunk made while the store is still a view of them, else new ones of the prefill's whole width
        (``prefill_columns``, the store's columns copied in). Concatenating at every chunk instead would copy the
        prompt so far once per chunk (quadratic in the chunks, and a new allocation each time). (None, None) without
        that width, or when the store is wider than it says: the caller concatenates.

        Held through weak references: the views in ``keys`` / ``values`` keep them alive, so they go with the store
        (stage 1's compaction, a reset) and never outlive it."""
        refs = self.buffers
        keys, values = (refs[0](), refs[1]()) if refs is not None else (None, None)
        if (keys is not None and values is not None and _leading_columns(self.keys, keys)
                and _leading_columns(self.values, values) and keys.shape[2] >= needed):
            return keys, values
        if prefill_columns is None or prefill_columns < needed:
            return None, None
        filled = self.keys.shape[2]
        batch, heads, _, dim = self.keys.shape
        keys = self.keys.new_empty((batch, heads, prefill_columns, dim))
        values = self.values.new_empty((batch, heads, prefill_columns, self.values.shape[3]))
        keys[:, :, :filled].copy_(self.keys)
        values[:, :, :filled].copy_(self.values)
        self.buffers = (weakref.ref(keys), weakref.ref(values))
        return keys, values


def _leading_columns(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``view`` is ``buffer[:, :, :n]`` (its first columns, in place): it starts where the buffer starts and
    steps through memory as the buffer does. A tensor made since (a concatenation) starts elsewhere while the buffer
    lives."""
    return view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride()
