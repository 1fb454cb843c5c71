"""PooledSlidingLayer: a sliding-window layer whose decode ring lives in the pool's slab (``RocketKVCache(pool=)``).

The layer is a ``SlidingWindowLayer`` in every respect but where its ring is: a prefill (and a later turn) keeps its
last ``window - 1`` columns in ordered tensors of its own, as without a pool (a transient, like the dense prompt of a
RocketKV layer before stage 1); the first decode step writes them into the row's slot of the pool's slab
(``KVBlockPool.sliding_slab``: ``[num_slots, Hkv, window, D]``, slot ``s`` = row ``s``, taken at admission, one per
row, ``memory/sliding_slab.py``), and from then on each step writes its token at ``[slot, :, position % window]``. So
between turns the request's sliding memory is its slots, exactly ``window`` tokens per row and layer, whatever was
seen.

A decode step's attention reads the rings where they lie in the slab, through the rows' slot ids
(``ring_store``, ``kernels/ring_attention.py``); ``keys`` / ``values`` are ``slab[first_slot : first_slot + B]`` (a
view) when the rows' slots are consecutive, as they are for one row, otherwise a gather of the rows' slots
(``ring_rows``, read only by the attention a per-head mask sends back to transformers' path). Every write goes through
device index tensors (the slot ids, the position counter): no host sync, fixed addresses, so a CUDA graph of the
decode step captures it.
"""

from __future__ import annotations

import torch

from .seam import tag
from .sliding_layer import SlidingWindowLayer


class PooledSlidingLayer(SlidingWindowLayer):
    """A ``SlidingWindowLayer`` whose ring is the rows' slots of the pool's slab (module docstring)."""

    def __init__(self, window: int, hints, layer_idx: int, pages, chunked: bool = False, backend: str = "auto"):
        self.pages = pages  # the cache's PoolPages: the pool, the rows' slot ids
        self._slots: torch.Tensor | None = None  # [B] int64 slot ids (ring only)
        self._first: int | None = None  # the first slot id when the rows' slots are consecutive
        self._slab_tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # the pool's (k, v) slab: never moves
        super().__init__(window, hints, layer_idx, chunked=chunked, backend=backend)

    def reset(self) -> None:
        self.__init__(self.window, self.hints, self.layer_idx, self.pages, self.chunked, self.backend)

    def ring_store(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The pool's slab itself and the rows' slot ids: the decode attention reads the rings where they lie."""
        k_slab, v_slab = self._slab()
        return k_slab, v_slab, self._slots, self.position

    # ------------------------------------------------------------------------------------------ the ring's tensors
    @property
    def keys(self) -> torch.Tensor | None:
        return self._ring(0) if self.ring else self._keys

    @keys.setter
    def keys(self, value) -> None:
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        return self._ring(1) if self.ring else self._values

    @values.setter
    def values(self, value) -> None:
        self._values = value

    def _slab(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._slab_tensors is None:
            pool = self.pages.pool
            if pool.sliding_dtype != self.dtype:
                fp8 = pool.sliding_dtype != pool.dtype  # fp8 pages: the slab keeps the dtype the pool was built for
                raise ValueError(
                    f"KVBlockPool.dtype is {pool.dtype}"
                    + (f" (its sliding-window slab: {pool.sliding_dtype}, the model's)" if fp8 else "")
                    + f" but the model's keys are {self.dtype}: build the pool with dtype={self.dtype}"
                    + (" or from the model in that dtype" if fp8 else "")
                    + " (its sliding-window slab holds the model's K/V as they are)")
            probe = torch.empty(0, self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
            self._slab_tensors = self.pages.pool.sliding_slab(self.layer_idx, probe)
        return self._slab_tensors

    def _ring(self, which: int) -> torch.Tensor:
        slab = self._slab()[which]
        if self._first is not None:
            return slab[self._first : self._first + self._slots.shape[0]]
        return slab.index_select(0, self._slots)

    @property
    def batch_size(self) -> int:
        if not self.is_initialized:
            raise AttributeError("batch_size")
        return self._slots.shape[0] if self.ring else self._keys.shape[0]

    def kept_tokens(self) -> torch.Tensor:
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.full((self.batch_size, self.num_kv_heads), self.stored, dtype=torch.long)

    def memory_bytes(self) -> int:
        """Bytes of the rows' ring slots while decoding (the slab's rows), else of the ordered store."""
        if not self.is_initialized:
            return 0
        if self.ring:
            return 2 * self._slots.shape[0] * self.num_kv_heads * self.window * self.head_dim * self.dtype.itemsize
        return sum(t.untyped_storage().nbytes() for t in (self._keys, self._values))

    # ------------------------------------------------------------------------------------------ layouts
    def _to_ring(self) -> None:
        """The ordered columns into the rows' slots (their earlier owner's bytes zeroed first)."""
        ordered_k, ordered_v = self._keys, self._values
        stored = ordered_k.shape[2]
        slots, ids = self.pages.slot_ids(self.device, ordered_k.shape[0], self.seen_tokens)
        self._slots = slots
        self._first = ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None
        positions = torch.remainder(torch.arange(stored, device=self.device) + self.seen_tokens - stored, self.window)
        for slab, ordered in zip(self._slab(), (ordered_k, ordered_v)):
            rows = slab.index_select(0, slots)
            rows.zero_()
            rows.index_copy_(2, positions, ordered)
            slab.index_copy_(0, slots, rows)
        self._keys = self._values = None
        self.position = torch.tensor(self.seen_tokens, dtype=torch.long, device=self.device)
        self.ring = True
        self._mark_ring_static(*self._slab(), self._slots)

    def _to_ordered(self) -> None:
        if not self.ring:
            return
        stored = self.stored
        positions = torch.remainder(torch.arange(stored, device=self.device) + self.seen_tokens - stored, self.window)
        keys, values = self._ring(0).index_select(2, positions), self._ring(1).index_select(2, positions)
        self.position, self.ring = None, False
        self._keys, self._values = keys, values

    def _update_ring(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One new token per row into ``[slot, :, position % window]`` of the slab (no host sync); returns the ring."""
        if not self.ring:
            self._to_ring()
        if not (self.hints.in_graph or torch.compiler.is_compiling()):
            self.awaiting_attention = True
            self.host_seen += 1
            self.seen_tokens += 1
        k_slab, v_slab = self._slab()
        self.ops.ring_append(k_slab, v_slab, self.position, key_states, value_states, self._slots)
        self.position.add_(1)
        if self._first is not None:  # the rows' rings as a view of the slab
            keys, values = self._ring(0), self._ring(1)
        else:  # the slab itself (a fresh view, tagged as this layer's): the attention reads it through the slot ids
            keys, values = k_slab[:], v_slab[:]
        tag(keys, self)
        return keys, values

    def ring_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ring(0), self._ring(1)

    # ------------------------------------------------------------------------------------------ rows
    def decode_slot(self) -> tuple[torch.Tensor, int]:
        """A one-row layer's ring as a row of the engine's batch takes it (``BatchedSlidingLayer.copy_in``): its slot
        id (a 0-d int64 device tensor) and the tokens seen; a layer still in ordered columns (just prefilled) moves
        them into its slot first."""
        if not self.is_initialized or self.batch_size != 1:
            raise ValueError("PooledSlidingLayer.decode_slot: a batch row takes the ring of a one-row layer that has "
                             "stored tokens")
        if not self.ring:
            self._to_ring()
        return self._slots[0], self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the rows' slots take their source rows' contents (the slot ids stay the rows')."""
        if not self.ring:
            super().reorder_cache(beam_idx)
            return
        index = beam_idx.to(self.device)
        for slab in self._slab():
            slab.index_copy_(0, self._slots, slab.index_select(0, self._slots.index_select(0, index)))

    def _index_rows(self, index: torch.Tensor) -> None:
        if self.ring:
            raise NotImplementedError("RocketKVCache(pool=...): selecting rows of a decoding sliding-window layer is "
                                      "not supported (its rows own their pool slots)")
        super()._index_rows(index)
