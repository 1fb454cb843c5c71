"""KVRecord: a prefilled request's decode state as data, what a row of the engine's batch takes when it joins.

A request is prefilled in its own pool-backed ``RocketKVCache``. Once stage 1 has run, everything its decode steps
read is, per layer, a block table row, a few counters and the settings the layer runs with. ``KVRecord.of(cache)``
reads them (views of the cache's tensors, nothing copied; a sliding layer just prefilled first moves its last columns
into its pool slot, as its first decode step would); ``BatchedDecodeCache.join`` builds its
layers from the first record it takes and copies each record into a row, then takes the request's pool holdings
(``RocketKVCache.hand_over``). So the batch reads records, never a cache's layers, and a record says in one place
what "a decoding request" is.

Per layer, in the model's layer order (Hkv KV heads, D head_dim, PP tokens per pool page, MP the request's view
pages, C = MP * PP slots):

    PagedRow   a compressed layer (global attention: stage 2 over the request's pages)
        table       [MP] int32       the request's view pages: pool block ids, -1 after them
        length      [] int64         tokens stored (the kept prompt tokens, then every generated one)
        positions   [Hkv, C] int32   input column of each stored token, -1 for an empty slot
        seen        [] int64         logical tokens seen: the request's next position
        row_pages   int              pages of ``table`` the request holds
        room        int              decode steps left before those pages are full (host count)
        runs_with   LayerSettings    what the batch's layer runs with (config, stage-1 policy, logit features,
                                     kernels, dtype, device, Hkv, D, PP)
    RingRow    a sliding-window or chunked layer whose ring is a slot of the pool's slab
        slot        [] int64         the request's slot id (``[slot, :, p % window]`` holds position p)
        seen        int              logical tokens seen
        window, chunked, backend, dtype, device, num_kv_heads, head_dim: what the batch's layer runs with
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .layer import RocketKVLayer
from .sliding_layer import SlidingWindowLayer

# a row whose layers all slide never runs out of room (a ring never fills)
UNBOUNDED_ROOM = 1 << 62


@dataclass(frozen=True)
class LayerSettings:
    """What a compressed layer's decode steps run with, beside its data: the same for every request of one model and
    config (the batch builds its layer from the first record it takes)."""

    config: Any  # the layer's effective RocketKVConfig (stage-2 options, KT page size)
    policy: Any  # the stage-1 policy (its per-head budgets decide the lengths' shape)
    features: Any  # soft-capping / sinks of the model's attention (stage 2's logits)
    ops: Any  # the kernels (RocketOps)
    dtype: torch.dtype
    device: torch.device
    num_kv_heads: int
    head_dim: int
    page_tokens: int  # PP: tokens per pool page


@dataclass(frozen=True)
class PagedRow:
    """One compressed layer of a one-row request (module docstring)."""

    table: torch.Tensor
    length: torch.Tensor
    positions: torch.Tensor
    seen: torch.Tensor
    row_pages: int
    room: int
    runs_with: LayerSettings

    @classmethod
    def of(cls, layer: RocketKVLayer) -> "PagedRow":
        store = layer.store
        settings = LayerSettings(layer.config, layer.policy, layer.features, layer.ops, layer.dtype, layer.device,
                                 layer.num_kv_heads, layer.head_dim, store.page_tokens)
        return cls(store.table[0], layer.lengths[0], layer.positions[0], layer.seen, store.row_pages[0],
                   layer.decode_room(), settings)

    @property
    def width(self) -> int:
        """MP: entries of the table row (view pages)."""
        return self.table.shape[0]

    @property
    def device(self) -> torch.device:
        return self.runs_with.device


@dataclass(frozen=True)
class RingRow:
    """One sliding-window (or chunked) layer of a one-row request whose ring is a slot of the pool's slab."""

    slot: torch.Tensor
    seen: int
    window: int
    chunked: bool
    backend: str
    dtype: torch.dtype
    device: torch.device
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, layer: SlidingWindowLayer) -> "RingRow":
        slot, seen = layer.decode_slot()  # a layer still in ordered columns moves them into its slot first
        return cls(slot, seen, layer.window, layer.chunked, layer.backend, layer.dtype, layer.device,
                   layer.num_kv_heads, layer.head_dim)


@dataclass(frozen=True)
class KVRecord:
    """A prefilled request's decode state, one entry per model layer (module docstring)."""

    layers: tuple[PagedRow | RingRow, ...]

    @classmethod
    def of(cls, cache) -> "KVRecord":
        """The record of ``cache``: a pool-backed ``RocketKVCache`` of one row whose prefill and stage 1 are done.
        ValueError (NotImplementedError for a keep_all history) naming what is missing; reading it changes
        nothing, except that a sliding layer just prefilled moves its last columns into its pool slot."""
        if cache.pool is None:
            raise ValueError("KVRecord.of (a batch row's join) needs a pool-backed RocketKVCache "
                             "(RocketKVCache(cfg, pool=pool))")
        if not cache.is_compressed or cache.batch_size != 1 or cache.get_seq_length() == 0:
            raise ValueError("KVRecord.of (a batch row's join) needs a compressed RocketKVCache of batch 1 (prefill "
                             "and stage 1 done)")
        if any(getattr(layer, "history", None) is not None for layer in cache.layers):
            raise NotImplementedError(
                "BatchedDecodeCache does not batch keep_all histories (RocketKVConfig.multi_turn='keep_all'); "
                "use multi_turn='evict' for batched decode")
        rows = []
        for index, layer in enumerate(cache.layers):
            if isinstance(layer, SlidingWindowLayer):
                rows.append(RingRow.of(layer))
            elif isinstance(layer, RocketKVLayer):
                rows.append(PagedRow.of(layer))
            else:
                raise ValueError(f"KVRecord: layer {index} is a {type(layer).__name__}, which keeps no pool pages "
                                 f"(a batch row takes compressed and pool-sliding layers only)")
        return cls(tuple(rows))

    @property
    def paged(self) -> tuple[PagedRow, ...]:
        return tuple(row for row in self.layers if isinstance(row, PagedRow))

    @property
    def width(self) -> int:
        """View pages of the request's tables (0 when every layer slides)."""
        paged = self.paged
        return paged[0].width if paged else 0

    @property
    def row_pages(self) -> int:
        """Pool pages the request's view holds (0 when every layer slides)."""
        paged = self.paged
        return paged[0].row_pages if paged else 0

    @property
    def room(self) -> int:
        """Decode steps the request can take before its tightest layer's pages are full."""
        return min((row.room for row in self.paged), default=UNBOUNDED_ROOM)
