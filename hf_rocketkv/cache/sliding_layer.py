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

Decode steps (one new token) use a ring instead, so that a step has fixed shapes, fixed addresses and no host sync
(CUDA-graph decode captures it, ``integration/decode_graphs.py``; torch.compile'd decode compiles it, the ring laid
out on the host before the first compiled step by ``count_graphed_step``): ``keys`` / ``values`` become
``[B, Hkv, window, D]`` buffers where logical position ``p`` lives in slot ``p % window``, and ``position`` (a
device counter) says where the next token goes. ``get_mask_sizes(1)`` is then ``(window, max(0, seen - window +
1))``, the sizes of transformers' own static sliding layer, so transformers' mask has ``window`` columns whatever was
seen, column ``c`` being position ``offset + c``; ``ring_mask`` reorders it into slot order (slot ``s`` is column
``(s - offset) % window``). A forward of several tokens (a later turn) turns the ring back into the ordered columns
first. Between forwards the ring holds ``min(seen, window)`` tokens, of which the next query can see the last
``window - 1`` (``stored``).
"""

from __future__ import annotations

import torch

from ..kernels.dispatch import get_ops
from ..selection.logit_features import LogitFeatures, allowed_of
from .hints import GenerationHints
from .seam import tag
from .unscored_layer import UnscoredLayer

SLIDING_CROP = (
    "RocketKVCache: a sliding-window layer (window {window}) has already dropped the tokens before its window, so "
    "its last {tokens} token(s) cannot be removed once {seen} tokens were seen. Assisted decoding and rollbacks "
    "past the window are not supported on sliding-window models."
)


class SlidingWindowLayer(UnscoredLayer):
    """The last ``window - 1`` tokens of every row, dense (see the module docstring); what it shares with
    ``DenseLayer`` is in ``UnscoredLayer``, the decode ring is its own."""

    is_sliding = True
    is_croppable = False

    def __init__(self, window: int, hints: GenerationHints | None = None, layer_idx: int | None = None,
                 chunked: bool = False, backend: str = "auto"):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SlidingWindowLayer: window must be a positive integer (the model config's "
                             f"sliding_window or attention_chunk_size), got {window!r}")
        super().__init__(hints, layer_idx)
        self.window = window
        self.backend = backend  # RocketKVConfig.backend: which implementation of the ring's decode attention
        # a chunked-attention layer (Llama 4): ``window`` is the chunk size; its attention passes no sliding_window,
        # transformers' chunked mask hides what lies outside the query's chunk
        self.chunked = chunked
        self.ring = False  # decode layout (see the module docstring)
        self.position = None  # ring only: tokens seen, a 0-d int64 device tensor (a graphed step advances it)
        self.floor = 0  # the first position the layer may hold (a prefix hit's replay start, ``seed_replay``)

    def reset(self) -> None:
        self.__init__(self.window, self.hints, self.layer_idx, self.chunked, self.backend)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.ops = get_ops(self.backend, self.device)  # resolved here, eagerly: never inside a compiled step

    def hold_rows(self, keys: torch.Tensor, values: torch.Tensor, like: UnscoredLayer) -> None:
        """``UnscoredLayer.hold_rows``, keeping ``like``'s replay start (``floor``)."""
        super().hold_rows(keys, values, like)
        self.floor = like.floor

    def seed_replay(self, start: int) -> None:
        """Before the first update: a prefix hit replays the prompt from input column ``start`` (``PoolPages.
        setup_prefix``). The layer starts with an empty window there, as if nothing before ``start`` could be
        attended; positions stay absolute (the logical length starts at ``start``)."""
        if self.is_initialized:
            raise RuntimeError("SlidingWindowLayer.seed_replay needs a layer that has stored nothing yet")
        self.seen_tokens = self.host_seen = self.floor = start

    # ------------------------------------------------------------------------------------------ sizes
    @property
    def stored(self) -> int:
        """Tokens held per row: ``min(seen - floor, window - 1)``."""
        return min(self.seen_tokens - self.floor, self.window - 1)

    def get_max_length(self) -> int:
        return self.window

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The columns of this forward's keys: the stored tokens, then the new ones; the first stored token is
        logical position ``seen - stored``. One new token (decode): the ring's ``window`` columns, the first being
        position ``max(0, seen - window + 1)``."""
        if self._decodes(query_length):
            return self.window, max(0, self.seen_tokens - self.window + 1)
        return self.stored + query_length, self.seen_tokens - self.stored

    def _decodes(self, query_length: int) -> bool:
        """A forward of one token after some were stored goes to the ring (a decode step). The first forward of an
        empty layer stays in ordered columns even with one token (a chunked prefill of chunks of 1): transformers
        sizes that forward's mask before the cache has any layer, at ``query_length`` columns, and this layer
        agrees. Read ``ring`` first: a compiled decode step (the ring laid out) never reads the host count."""
        return query_length == 1 and (self.ring or self.seen_tokens > self.floor)

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``[B, Hkv, n, D]`` new tokens; returns the stored ones followed by them (tagged for ``layer_of``)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        query_length = key_states.shape[2]
        if self._decodes(query_length):
            return self._update_ring(key_states, value_states)
        self._to_ordered()
        if not torch.compiler.is_compiling():
            self.awaiting_attention = True
            self.host_seen += query_length
        self.seen_tokens += query_length
        keys = torch.cat([self.keys, key_states], dim=2)
        values = torch.cat([self.values, value_states], dim=2)
        self.keys, self.values = self._last(keys), self._last(values)
        tag(keys, self)
        return keys, values

    def _update_ring(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """One new token per row into slot ``position % window`` (in place, no host sync); returns the ring."""
        if not self.ring:
            self._to_ring()
        if not (self.hints.in_graph or torch.compiler.is_compiling()):  # a graphed step: count_decode_step counts
            self.awaiting_attention = True
            self.host_seen += 1
            self.seen_tokens += 1
        self.ops.ring_append(self.keys, self.values, self.position, key_states, value_states)
        self.position.add_(1)
        tag(self.keys, self)
        return self.keys, self.values

    def count_graphed_step(self) -> None:
        """The host side of a decode step whose device side a CUDA graph replays or a torch.compile'd step runs
        (their ``update`` skips it): the ordered columns become the ring first, here on the host and from the count
        before this step (inside a compiled step the conversion would specialise the graph to the prompt's length),
        then the step is counted."""
        if self.is_initialized and not self.ring:
            self._to_ring()
        self.host_seen += 1
        self.seen_tokens += 1

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
        out = self.ops.ring_decode_attention(q, keys, values, seen, scaling, rows, mask, features.softcap, features.sinks)
        return out.reshape(batch, 1, query_heads, dim)

    reads_mask = True  # transformers' decode mask is read (it hides left padding still inside the window)

    def ring_store(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(keys, values, rows, seen)`` of ``ring_decode_attention``: the rings ``[B, Hkv, W, D]``, no store rows,
        the 0-d count (this step's token included)."""
        return self.keys, self.values, None, self.position

    def ring_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' rings ``[B, Hkv, W, D]`` in slot order (for attention under ``ring_mask``)."""
        return self.keys, self.values

    def ring_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """A decode step's mask over the ring, ``[B or 1, 1, 1, window]`` in slot order: transformers' mask
        (``window`` columns from ``get_mask_sizes(1)``) reordered, or, without one, the causal window alone.
        Device arithmetic only (graph-safe); call it after ``update``."""
        newest = self.position - 1  # the new token's position
        offset = (newest - self.window + 1).clamp(min=0)
        column = torch.remainder(torch.arange(self.window, device=self.position.device) - offset, self.window)
        if attention_mask is None:
            return (column <= newest - offset)[None, None, None, :]
        return attention_mask.index_select(-1, column)

    def _to_ring(self) -> None:
        """The ordered columns (positions ``seen - stored`` ... ``seen - 1``) into a ring of ``window`` slots."""
        stored = self.keys.shape[2]
        batch, heads, _, dim = self.keys.shape
        slots = torch.remainder(torch.arange(stored, device=self.device) + self.seen_tokens - stored, self.window)
        ring_k = self.keys.new_zeros(batch, heads, self.window, dim)
        ring_v = self.values.new_zeros(batch, heads, self.window, self.values.shape[3])
        self.keys = ring_k.index_copy_(2, slots, self.keys)
        self.values = ring_v.index_copy_(2, slots, self.values)
        self.position = torch.tensor(self.seen_tokens, dtype=torch.long, device=self.device)
        self.ring = True
        tag(self.keys, self)  # tagged where allocated, so a compiled step finds it tagged (seam.tag)
        self._mark_ring_static(self.keys, self.values)

    def _mark_ring_static(self, *tensors: torch.Tensor) -> None:
        """Fixed addresses for a compiled decode step: each step mutates the ring and ``position`` in place, and
        inductor's CUDA graphs skip a graph that mutates inputs unless their addresses are marked static (it would
        run the compiled step without graphs). Host-side, where the ring is laid out."""
        if torch.compiler.is_compiling():
            return
        for tensor in (*tensors, self.position):  # no guard: a next request's ring re-records, never recompiles
            torch._dynamo.mark_static_address(tensor, guard=False)

    def _to_ordered(self) -> None:
        """The ring back into ordered columns: the last ``stored`` positions."""
        if not self.ring:
            return
        stored = self.stored
        slots = torch.remainder(torch.arange(stored, device=self.device) + self.seen_tokens - stored, self.window)
        self.keys = self.keys.index_select(2, slots)
        self.values = self.values.index_select(2, slots)
        self.position, self.ring = None, False

    def _last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last ``window - 1`` columns, copied when they are a small part of ``tensor`` (a prompt), so that the
        prompt's memory goes once its forward ends; a decode step's window is already the whole tensor."""
        keep = self.window - 1
        if tensor.shape[2] <= keep:
            return tensor
        last = tensor[:, :, tensor.shape[2] - keep:]
        return last.clone() if tensor.shape[2] > keep + 1 else last

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens while the layer still holds every token it saw (fewer than
        ``window`` seen); past that, the tokens before the window are gone and it raises."""
        if tokens_to_remove > 0:
            raise NotImplementedError("RocketKVCache.crop takes a negative count of tokens to remove")
        count = -tokens_to_remove
        if count == 0 or not self.is_initialized:
            return
        self._to_ordered()
        if self.seen_tokens - self.floor >= self.window or count > self.seen_tokens - self.floor:
            raise NotImplementedError(SLIDING_CROP.format(window=self.window, tokens=count, seen=self.seen_tokens))
        self.keys, self.values = self.keys[:, :, :-count], self.values[:, :, :-count]
        self.seen_tokens -= count
        self.host_seen -= count
