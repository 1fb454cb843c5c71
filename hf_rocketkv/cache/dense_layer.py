"""DenseLayer: a layer of a RocketKVCache that keeps its whole KV and attends every token (``dense_layers``), and the
store a ``SlidingWindowLayer`` narrows to its window.

Many sparse-attention methods keep the first layers dense (their attention is broad, their KV a small part of the
model's). A dense layer stores every input column, dense and unpaged, exactly as transformers' ``DynamicLayer``:
nothing is scored, evicted or summarised in KT pages. Its attention is transformers' own sdpa attention with
transformers' causal mask (``integration/attention.py``'s window path), so its outputs are the ones the model's own
cache gives. It is a full-attention layer for transformers (``is_sliding = False``): the causal mask of the model's
full-attention layers is built from the first of them, a dense layer when ``dense_layers`` > 0, and covers every
stored column; the RocketKV layers after it ignore that mask once compressed (they attend by their own lengths).

``SlidingWindowLayer`` (``sliding_layer.py``) is one of these that keeps only its last ``window - 1`` columns and
decodes into a ring, as transformers' ``DynamicSlidingWindowLayer`` is a ``DynamicLayer``: it says how many tokens are
held (``stored``), how ``update`` stores new ones and what the masks are (``get_mask_sizes``). This class holds what
both share: the counts of tokens seen, row selection and reordering, row-group stacking, and the bookkeeping
RocketKVCache reads. Tensors (B batch, Hkv KV heads, D head_dim): ``keys`` / ``values`` ``[B, Hkv, stored, D]``.
"""

from __future__ import annotations

import torch
from transformers import CacheLayerMixin

from .hints import GenerationHints
from .seam import tag


class DenseLayer(CacheLayerMixin):
    """Every token of every row, dense (see the module docstring)."""

    is_sliding = False  # transformers: a full-attention layer
    is_dense = True  # RocketKVCache: no stage 1, nothing to compress
    is_croppable = True
    is_compileable = False
    compressed = False  # never compressed: the RocketKV layers' state, read by the cache
    history = None
    per_head_lengths = False

    def __init__(self, hints: GenerationHints | None = None, layer_idx: int | None = None):
        super().__init__()
        self.hints = hints if hints is not None else GenerationHints()
        self.layer_idx = layer_idx
        self.window = None  # never closes: what the attention's sliding_window check compares with (None)
        self.keys = self.values = None
        self.seen_tokens = 0  # logical tokens seen
        self.host_seen = 0  # what RocketKVCache's consistency check compares across layers
        self.awaiting_attention = False  # set by update, cleared by the attention function

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_kv_heads, self.head_dim = key_states.shape[1], key_states.shape[3]
        self.keys = key_states[:, :, :0].clone()
        self.values = value_states[:, :, :0].clone()
        self.is_initialized = True

    # ------------------------------------------------------------------------------------------ sizes
    def reset(self) -> None:
        self.__init__(self.hints, self.layer_idx)

    @property
    def stored(self) -> int:
        """Tokens held per row: every one seen."""
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Every column seen and the new ones, from position 0 (transformers' ``DynamicLayer``)."""
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    @property
    def seen(self) -> torch.Tensor:
        """Logical tokens seen as a 0-d int64 tensor (``RocketKVCache.seq_length_tensor``)."""
        device = self.device if self.is_initialized else None
        return torch.tensor(self.seen_tokens, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        if not self.is_initialized:
            raise AttributeError("batch_size")  # Cache.batch_size skips layers without it
        return self.keys.shape[0]

    def kept_tokens(self) -> torch.Tensor:
        """Tokens the next query can see, ``[B, Hkv]`` (stored columns, left padding included)."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.full(self.keys.shape[:2], self.stored, dtype=torch.long)

    def memory_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.untyped_storage().nbytes() for t in (self.keys, self.values))

    # ------------------------------------------------------------------------------------------ attention
    def attention_ran(self) -> None:
        self.awaiting_attention = False

    def finish_prefill(self) -> None:
        """Nothing deferred: a dense store has no stage 1."""

    def to_ordered(self) -> None:
        """Make ``keys`` / ``values`` the stored columns in order; they always are here (a sliding layer's decode ring
        is not: it overrides this)."""

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, Hkv, n, D]`` new tokens, decode steps included (no ring: the store grows, so a dense layer's
        decode runs eagerly); returns every stored token (tagged for ``layer_of``)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        query_length = key_states.shape[2]
        if not torch.compiler.is_compiling():
            self.awaiting_attention = True
            self.host_seen += query_length
        self.seen_tokens += query_length
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        tag(self.keys, self)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (every token is still stored)."""
        if tokens_to_remove > 0:
            raise NotImplementedError("RocketKVCache.crop takes a negative count of tokens to remove")
        count = -tokens_to_remove
        if count == 0 or not self.is_initialized:
            return
        if count > self.seen_tokens:
            raise ValueError(f"DenseLayer.crop: {count} token(s) to remove, {self.seen_tokens} stored")
        self.keys, self.values = self.keys[:, :, :-count], self.values[:, :, :-count]
        self.seen_tokens -= count
        self.host_seen -= count

    # ------------------------------------------------------------------------------------------ rows
    def _index_rows(self, index: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys = self.keys.index_select(0, index.to(self.keys.device))
            self.values = self.values.index_select(0, index.to(self.values.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows reordered in place, so that a captured decode step keeps its buffers."""
        if self.is_initialized:
            index = beam_idx.to(self.keys.device)
            self.keys.copy_(self.keys.index_select(0, index))
            self.values.copy_(self.values.index_select(0, index))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_rows(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    @staticmethod
    def stack_rows(parts: list[DenseLayer], new_layer) -> DenseLayer:
        """One layer holding the rows of ``parts`` in order (row-group prefill): the parts saw the same input columns
        (one padded batch), so their stores have the same width."""
        first = parts[0]
        for part in parts:
            part.to_ordered()
        if len({part.seen_tokens for part in parts}) != 1:
            raise RuntimeError(f"{type(first).__name__}.stack_rows needs parts that saw the same input columns")
        layer = new_layer()
        layer.hold_rows(torch.cat([part.keys for part in parts]), torch.cat([part.values for part in parts]), first)
        return layer

    def hold_rows(self, keys: torch.Tensor, values: torch.Tensor, like: DenseLayer) -> None:
        """An empty layer takes ``keys`` / ``values`` ``[B, Hkv, n, D]`` as its stored columns, having seen what
        ``like`` saw (``stack_rows``)."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.seen_tokens, self.host_seen = like.seen_tokens, like.host_seen

    def offload(self):
        raise NotImplementedError("RocketKVCache does not support offloading=True")

    prefetch = offload


__all__ = ["DenseLayer"]
