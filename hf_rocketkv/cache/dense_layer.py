"""DenseLayer: a layer of a RocketKVCache that keeps its whole KV and attends every token (``dense_layers``).

Many sparse-attention methods keep the first layers dense (their attention is broad, their KV a small part of the
model's). A dense layer stores every input column, dense and unpaged, exactly as transformers' ``DynamicLayer``:
nothing is scored, evicted or summarised in KT pages. Its attention is transformers' own sdpa attention with
transformers' causal mask (``integration/attention.py``'s window path), so its outputs are the ones the model's own
cache gives.

It shares the store of ``SlidingWindowLayer`` (``UnscoredLayer``: counts, rows, row-group stacking), not its decode
ring: a dense layer's store grows. Unlike a sliding layer it is a full-attention layer for transformers
(``is_sliding = False``): the causal mask of the model's full-attention layers is built from the first of them, a
dense layer when ``dense_layers`` > 0, and covers every stored column; the RocketKV layers after it ignore that mask
once compressed (they attend by their own lengths).
"""

from __future__ import annotations

import torch

from .hints import GenerationHints
from .seam import tag
from .unscored_layer import UnscoredLayer


class DenseLayer(UnscoredLayer):
    """Every token of every row, dense (see the module docstring)."""

    is_sliding = False  # transformers: a full-attention layer
    is_dense = True  # RocketKVCache: no stage 1, nothing to compress
    is_croppable = True

    def __init__(self, hints: GenerationHints | None = None, layer_idx: int | None = None):
        super().__init__(hints, layer_idx)
        self.window = None  # never closes: what the attention's sliding_window check compares with (None)

    def reset(self) -> None:
        self.__init__(self.hints, self.layer_idx)

    @property
    def stored(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Every column seen and the new ones, from position 0 (transformers' ``DynamicLayer``)."""
        return self.seen_tokens + query_length, 0

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
