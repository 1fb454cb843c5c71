"""SlidingWindowLayer: the cache layer of a sliding-window attention layer inside a RocketKVCache.

A sliding layer attends only to its last ``window`` tokens, so there is nothing for RocketKV to choose: it keeps
exactly what the model can still see, dense, in a store of its own, and is never scored. A chunked-attention layer
(Llama 4, ``chunked``) is one too, its window the chunk size: a query sees at most the ``chunk - 1`` tokens before
it, and transformers' chunked mask (built from the same ``get_mask_sizes``) hides those of earlier chunks. The
contract is the one of transformers' ``DynamicSlidingWindowLayer`` at every step, so the masks transformers builds
from ``get_mask_sizes`` are the ones the model's own cache gets:

    update(k, v)         returns the stored tokens followed by the new ones (what the forward's queries may see,
                         the mask hiding what lies outside each query's window and the padding), then keeps the
                         last ``window - 1`` of them: the next query is the window's last token
    get_mask_sizes(n)    ``(stored + n, seen - stored)``: the mask's columns start at the first stored token
    get_seq_length()     logical tokens seen (positions continue from here)

Tensors (B batch, Hkv KV heads, D head_dim): ``keys`` / ``values`` ``[B, Hkv, min(seen, window - 1), D]``, input
columns in order (left padding included, as transformers stores it; the mask hides it). The attention function finds
the layer through the key tensor ``update`` returned (``seam.tag``) and runs exact attention with transformers' mask
(``integration/attention.py``).

Decode steps (one new token) use a ring instead (``ring.py``), so that a step has fixed shapes, fixed addresses and
no host sync (CUDA-graph decode captures it, ``integration/decode_graphs.py``; torch.compile'd decode compiles it, the
ring laid out on the host before the first compiled step by ``count_graphed_step``): ``window`` slots per row where
logical position ``p`` lives in slot ``p % window``, and a device count of the tokens seen says where the next token
goes. ``get_mask_sizes(1)`` is then ``(window, max(0, seen - window + 1))``, the sizes of transformers' own static
sliding layer, so transformers' mask has ``window`` columns whatever was seen, column ``c`` being position ``offset +
c``; ``ring_mask`` reorders it into slot order (slot ``s`` is column ``(s - offset) % window``). A forward of several
tokens (a later turn) turns the ring back into the ordered columns first. Between forwards the ring holds ``min(seen,
window)`` tokens, of which the next query can see the last ``window - 1`` (``stored``).

Where the ring lies is the layer's only difference between its three uses (``Ring``):

- ``RocketKVCache(cfg)``: storage of its own, ``[B, Hkv, window, D]``, laid out at the first decode step.
- ``RocketKVCache(cfg, pool=pool)`` (``pages``, the cache's ``PoolPages``): the rows' slots of the pool's slab
  (``KVBlockPool.sliding_slab``, ``memory/sliding_slab.py``), taken at admission, one per row; the first decode step
  writes the ordered columns there. Between turns the request's sliding memory is its slots, exactly ``window`` tokens
  per row and layer, whatever was seen.
- A row of the engine's batch (``BatchedDecodeCache``, ``join_batch``): the slab again, each row in its request's
  slot with its own count, the slot ids and counts views of the batch's buffers (``decode_rows``). No K/V is copied
  when rows join, move or leave: only the slot id and the count. The rows have different lengths, so the layer
  answers no length (``get_seq_length`` raises; positions come from ``position_ids``) and reads no mask: each row's
  count says which slots it filled. A chunked row (ring of ``chunk`` slots) sees only its own chunk: after this
  step's token at position ``p = seen - 1``, its count is ``(seen - 1) % chunk + 1``.
"""

from __future__ import annotations

import torch

from ..kernels.dispatch import get_ops
from ..selection.logit_features import LogitFeatures, allowed_of
from .dense_layer import DenseLayer
from .hints import GenerationHints
from .ring import Ring
from .seam import tag

SLIDING_CROP = (
    "RocketKVCache: a sliding-window layer (window {window}) has already dropped the tokens before its window, so "
    "its last {tokens} token(s) cannot be removed once {seen} tokens were seen. Assisted decoding and rollbacks "
    "past the window are not supported on sliding-window models."
)


class SlidingWindowLayer(DenseLayer):
    """The last ``window - 1`` tokens of every row, dense (see the module docstring): a ``DenseLayer`` narrowed to
    its window, with a decode ring of its own."""

    is_sliding = True
    is_dense = False  # a layer of the model's sliding kind, not one of RocketKVConfig.dense_layers
    is_croppable = False

    def __init__(self, window: int, hints: GenerationHints | None = None, layer_idx: int | None = None,
                 chunked: bool = False, backend: str = "auto", pages=None, flash_window: bool = False):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SlidingWindowLayer: window must be a positive integer (the model config's "
                             f"sliding_window or attention_chunk_size), got {window!r}")
        self.ring: Ring | None = None  # the decode layout (module docstring); None while in ordered columns
        super().__init__(hints, layer_idx)
        self.window = window
        self.backend = backend  # RocketKVConfig.backend: which implementation of the ring's decode attention
        # RocketKVConfig.flash_window_prefill: a prefill forward whose mask is the window's band may run as one flash
        # call with the window (integration/window_prefill.py)
        self.flash_window = flash_window
        # a chunked-attention layer (Llama 4): ``window`` is the chunk size; its attention passes no sliding_window,
        # transformers' chunked mask hides what lies outside the query's chunk
        self.chunked = chunked
        self.pages = pages  # the cache's PoolPages (its ring in the rows' slots of the pool's slab), or None
        self.floor = 0  # the first position the layer may hold (a prefix hit's replay start, ``seed_replay``)
        # generate()'s deferred stop check may take the last decode step back (``activate_past_recording``): the
        # ring keeps what each append replaces, and ``undoable`` says whether a step was taken since the last undo
        self.record_past = False
        self.undoable = False
        self._slab_tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # the pool's (k, v) slab: never moves

    def reset(self) -> None:
        if self.per_row:
            raise NotImplementedError("SlidingWindowLayer.reset: the engine's rows leave one at a time "
                                      "(BatchedDecodeCache.leave)")
        self.__init__(self.window, self.hints, self.layer_idx, self.chunked, self.backend, self.pages)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.ops = get_ops(self.backend, self.device)  # resolved here, eagerly: never inside a compiled step

    def hold_rows(self, keys: torch.Tensor, values: torch.Tensor, like: DenseLayer) -> None:
        """``DenseLayer.hold_rows``, keeping ``like``'s replay start (``floor``)."""
        super().hold_rows(keys, values, like)
        self.floor = like.floor

    def seed_replay(self, start: int) -> None:
        """Before the first update: a prefix hit replays the prompt from input column ``start`` (``PoolPages.
        setup_prefix``). The layer starts with an empty window there, as if nothing before ``start`` could be
        attended; positions stay absolute (the logical length starts at ``start``)."""
        if self.is_initialized:
            raise RuntimeError("SlidingWindowLayer.seed_replay needs a layer that has stored nothing yet")
        self.seen_tokens = self.host_seen = self.floor = start

    # ------------------------------------------------------------------------------------------ the stored tensors
    @property
    def keys(self) -> torch.Tensor | None:
        """The stored columns ``[B, Hkv, stored, D]`` in order, or while decoding the rows' rings ``[B, Hkv, window,
        D]`` in slot order."""
        return self.ring.row_tensors()[0] if self.ring is not None else self._keys

    @keys.setter
    def keys(self, value) -> None:
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        return self.ring.row_tensors()[1] if self.ring is not None else self._values

    @values.setter
    def values(self, value) -> None:
        self._values = value

    @property
    def position(self) -> torch.Tensor | None:
        """While decoding: the device count of the tokens seen (``[]``, or ``[B]`` for the engine's rows)."""
        return self.ring.seen if self.ring is not None else None

    @property
    def per_row(self) -> bool:
        """Whether each row has its own length (a row of the engine's batch)."""
        return self.ring is not None and self.ring.per_row

    # ------------------------------------------------------------------------------------------ sizes
    @property
    def stored(self) -> int:
        """Tokens held per row: ``min(seen - floor, window - 1)``."""
        return min(self.seen_tokens - self.floor, self.window - 1)

    @property
    def batch_size(self) -> int:
        if not self.is_initialized:
            raise AttributeError("batch_size")  # Cache.batch_size skips layers without it
        return self.ring.batch_size if self.ring is not None else self._keys.shape[0]

    def kept_tokens(self) -> torch.Tensor:
        """Tokens the next query can see, ``[B, Hkv]`` (stored columns, left padding included)."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.full((self.batch_size, self.num_kv_heads), self.stored, dtype=torch.long)

    def memory_bytes(self) -> int:
        """Bytes of the rows' rings while decoding (their slots of a slab), else of the ordered store."""
        if not self.is_initialized:
            return 0
        if self.ring is not None:
            return self.ring.nbytes()
        return sum(t.untyped_storage().nbytes() for t in (self._keys, self._values))

    def get_seq_length(self) -> int:
        if self.per_row:
            raise RuntimeError("BatchedDecodeCache rows have different lengths: pass position_ids")
        return self.seen_tokens

    def get_max_length(self) -> int:
        return self.window

    def decode_room(self) -> int:
        return 1 << 62  # a ring never fills

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The columns of this forward's keys: the stored tokens, then the new ones; the first stored token is
        logical position ``seen - stored``. One new token (decode): the ring's ``window`` columns, the first being
        position ``max(0, seen - window + 1)`` (the engine's rows, whose positions differ: 0; their attention reads
        no mask)."""
        if self.per_row:
            return self.window, 0
        if self._decodes(query_length):
            return self.window, max(0, self.seen_tokens - self.window + 1)
        return self.stored + query_length, self.seen_tokens - self.stored

    def _decodes(self, query_length: int) -> bool:
        """A forward of one token after some were stored goes to the ring (a decode step). The first forward of an
        empty layer stays in ordered columns even with one token (a chunked prefill of chunks of 1): transformers
        sizes that forward's mask before the cache has any layer, at ``query_length`` columns, and this layer
        agrees. Read ``ring`` first: a compiled decode step (the ring laid out) never reads the host count."""
        return query_length == 1 and (self.ring is not None or self.seen_tokens > self.floor)

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``[B, Hkv, n, D]`` new tokens; returns the stored ones followed by them (tagged for ``layer_of``)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        query_length = key_states.shape[2]
        if self._decodes(query_length):
            return self._update_ring(key_states, value_states)
        self.to_ordered()
        if not torch.compiler.is_compiling():
            self.awaiting_attention = True
            self.host_seen += query_length
        self.seen_tokens += query_length
        if self._keys.shape[2]:
            keys = torch.cat([self._keys, key_states], dim=2)
            values = torch.cat([self._values, value_states], dim=2)
        else:  # nothing stored (a first forward): the new tokens themselves, not a copy of them
            keys, values = key_states, value_states
        self.keys, self.values = self._last(keys), self._last(values)
        tag(keys, self)
        return keys, values

    def _update_ring(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One new token per row into its ring's slot ``seen % window`` (in place, no host sync); returns what the
        attention function finds the layer by (``Ring.returned``)."""
        if self.ring is None:
            self._to_ring()
        if not (self.hints.in_graph or torch.compiler.is_compiling()):  # a graphed step: count_decode_step counts
            self.awaiting_attention = True
            self.host_seen += 1
            if not self.per_row:
                self.seen_tokens += 1
        self.ring.append(self.ops, key_states, value_states)
        self.undoable = self.record_past
        keys, values = self.ring.returned()
        tag(keys, self)
        return keys, values

    def count_graphed_step(self) -> None:
        """The host side of a decode step whose device side a CUDA graph replays or a torch.compile'd step runs
        (their ``update`` skips it): the ordered columns become the ring first, here on the host and from the count
        before this step (inside a compiled step the conversion would specialise the graph to the prompt's length),
        then the step is counted."""
        if self.is_initialized and self.ring is None:
            self._to_ring()
        self.host_seen += 1
        self.seen_tokens += 1
        self.undoable = self.record_past

    # ------------------------------------------------------------------------------------------ attention
    def attend_ring(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                    features: LogitFeatures) -> torch.Tensor | None:
        """A decode step's attention over the ring where it lies, ``[B, 1, Hq, D]`` (``ring_decode_attention``:
        one kernel or two on the Triton backend, the mask reordered from the count inside it, no ``repeat_kv``);
        None for a mask the op does not take (one per head): the caller then attends under ``ring_mask``. Call it
        after ``update``."""
        keys, values, rows, seen = self.ring_store()
        mask = None
        if attention_mask is not None and self.reads_mask:
            if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-1] != self.window:
                return None
            mask = allowed_of(attention_mask[:, 0, -1, :])
        batch, query_heads, _, dim = query.shape
        heads = keys.shape[1]
        q = query.reshape(batch, heads, query_heads // heads, dim)
        out = self.ops.ring_decode_attention(q, keys, values, seen, scaling, rows, mask, features.softcap,
                                             features.sinks)
        return out.reshape(batch, 1, query_heads, dim)

    @property
    def reads_mask(self) -> bool:
        """transformers' decode mask is read (it hides left padding still inside the window), except for the
        engine's rows (different lengths: each row's count says which slots it filled)."""
        return not self.per_row

    def ring_store(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(keys, values, rows, seen)`` of ``ring_decode_attention``: the ring's storage, the rows' storage rows
        (None: row b is storage row b) and their counts, this step's token included (a chunked row of the engine's
        batch: the tokens of its own chunk)."""
        ring = self.ring
        seen = ring.seen
        if self.chunked and ring.per_row:
            seen = torch.remainder(seen - 1, self.window) + 1
        return ring.keys, ring.values, ring.rows, seen

    def ring_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' rings ``[B, Hkv, W, D]`` in slot order (for attention under ``ring_mask``)."""
        return self.ring.row_tensors()

    def ring_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """A decode step's mask over the ring in slot order (``Ring.mask``); call it after ``update``."""
        return self.ring.mask(attention_mask)

    # ------------------------------------------------------------------------------------------ layouts
    def _to_ring(self) -> None:
        """The ordered columns (positions ``seen - stored`` ... ``seen - 1``) into a ring of ``window`` slots: storage
        of its own, or the rows' slots of the pool's slab (a pool-backed cache)."""
        ordered_k, ordered_v = self._keys, self._values
        if self.pages is None:
            ring = Ring.laid_out(ordered_k, ordered_v, self.seen_tokens, self.window)
            tag(ring.keys, self)  # tagged where allocated, so a compiled step finds it tagged (seam.tag)
        else:
            slots, ids = self.pages.slot_ids(self.device, ordered_k.shape[0], self.seen_tokens)
            ring = Ring.laid_out(ordered_k, ordered_v, self.seen_tokens, self.window, self._slab(), slots, ids)
        self._keys = self._values = None
        self.ring = ring
        if self.record_past:
            ring.keep_overwritten()
        self._mark_ring_static(ring.keys, ring.values, *(() if ring.rows is None else (ring.rows,)), ring.seen,
                               *(ring.overwritten or ()))

    def _mark_ring_static(self, *tensors: torch.Tensor) -> None:
        """Fixed addresses for a compiled decode step: each step mutates the ring and its count in place, and
        inductor's CUDA graphs skip a graph that mutates inputs unless their addresses are marked static (it would
        run the compiled step without graphs). Host-side, where the ring is laid out."""
        if torch.compiler.is_compiling():
            return
        for tensor in tensors:  # no guard: a next request's ring re-records, never recompiles
            torch._dynamo.mark_static_address(tensor, guard=False)

    def to_ordered(self) -> None:
        """The ring back into ordered columns: the last ``stored`` positions."""
        if self.ring is None:
            return
        keys, values = self.ring.ordered(self.stored, self.seen_tokens)
        self.ring = None
        self.undoable = False  # what the ring kept goes with it
        self._keys, self._values = keys, values

    def _slab(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's ``(k, v)`` slab of this layer (a pool-backed cache), ``[slots, Hkv, window, D]`` each."""
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
            self._slab_tensors = pool.sliding_slab(self.layer_idx, probe)
        return self._slab_tensors

    def _last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last ``window - 1`` columns, copied when they are a small part of ``tensor`` (a prompt), so that the
        prompt's memory goes once its forward ends; a decode step's window is already the whole tensor."""
        keep = self.window - 1
        if tensor.shape[2] <= keep:
            return tensor
        last = tensor[:, :, tensor.shape[2] - keep:]
        return last.clone() if tensor.shape[2] > keep + 1 else last

    # ------------------------------------------------------------------------------------------ rows
    def decode_slot(self) -> tuple[torch.Tensor, int]:
        """A one-row pool-backed layer's ring as a row of the engine's batch takes it (``KVRecord``): its slot id (a
        0-d int64 device tensor) and the tokens seen; a layer still in ordered columns (just prefilled) moves them
        into its slot first."""
        if self.pages is None or not self.is_initialized or self.batch_size != 1:
            raise ValueError("SlidingWindowLayer.decode_slot: a batch row takes the ring of a one-row, pool-backed "
                             "layer that has stored tokens")
        if self.ring is None:
            self._to_ring()
        return self.ring.rows[0], self.seen_tokens

    def join_batch(self, dtype: torch.dtype, device: torch.device, num_kv_heads: int, head_dim: int, pool,
                   slots: torch.Tensor, seen: torch.Tensor) -> None:
        """This empty layer becomes a layer of the engine's batch: ``[R]`` int64 ``slots`` (each row's slot of the
        pool's slab) and ``seen`` (each row's count), the batch's buffers; ``decode_rows`` narrows them per step."""
        self.dtype, self.device, self.num_kv_heads, self.head_dim = dtype, device, num_kv_heads, head_dim
        probe = torch.empty(0, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self._slab_tensors = pool.sliding_slab(self.layer_idx, probe)
        self.ops = get_ops(self.backend, device)
        self.is_initialized = True
        self.decode_rows(slots, seen)

    def decode_rows(self, slots: torch.Tensor, seen: torch.Tensor) -> None:
        """The engine's next step decodes the rows whose slots and counts these ``[bucket]`` views hold."""
        self.ring = Ring(*self._slab_tensors, slots, seen)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows reordered in place (a ring's rows keep their storage rows)."""
        if self.ring is None:
            super().reorder_cache(beam_idx)
            return
        self.ring.reorder(beam_idx.to(self.device))

    def _index_rows(self, index: torch.Tensor) -> None:
        if self.ring is None:
            super()._index_rows(index)
            return
        if self.ring.rows is not None:
            raise NotImplementedError("RocketKVCache(pool=...): selecting rows of a decoding sliding-window layer is "
                                      "not supported (its rows own their pool slots)")
        index = index.to(self.device)
        ring = self.ring
        self.ring = Ring(ring.keys.index_select(0, index), ring.values.index_select(0, index), None, ring.seen)
        self.undoable = False
        if self.record_past:
            self.ring.keep_overwritten()

    def activate_past_recording(self, **kwargs) -> None:
        """transformers' contract for generate()'s deferred stop check, which may undo its last decode step with
        ``crop(-1)``: from now on the ring keeps what each append replaces (``Ring.keep_overwritten``), so that one
        step can be taken back with a full window too."""
        if self.per_row:
            raise NotImplementedError("SlidingWindowLayer.activate_past_recording: the engine's rows take no step back")
        self.record_past = True
        if self.ring is not None:
            self.ring.keep_overwritten()
            self._mark_ring_static(*self.ring.overwritten)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens while the layer still holds every token it saw (fewer than
        ``window`` seen); past that, the tokens before the window are gone and it raises, except for the last decode
        step while recording (``activate_past_recording``), which the ring takes back."""
        if tokens_to_remove > 0:
            raise NotImplementedError("RocketKVCache.crop takes a negative count of tokens to remove")
        count = -tokens_to_remove
        if count == 0 or not self.is_initialized:
            return
        if count == 1 and self.ring is not None and self.undoable:
            self.ring.undo_append()
            self.seen_tokens -= 1
            self.host_seen -= 1
            self.undoable = False
            return
        self.to_ordered()
        if self.seen_tokens - self.floor >= self.window or count > self.seen_tokens - self.floor:
            raise NotImplementedError(SLIDING_CROP.format(window=self.window, tokens=count, seen=self.seen_tokens))
        self.keys, self.values = self.keys[:, :, :-count], self.values[:, :, :-count]
        self.seen_tokens -= count
        self.host_seen -= count
