"""Slots per row of a layer's compressed store: capacity buckets, headroom for the tokens to come, the layer's own
stores, and growing the view when a decode step runs past it.

Tensors: slot axis is dim 2 (``[B, Hkv, C, ...]``: keys, values, positions); C = slots per row, in whole KT pages.
"""

from __future__ import annotations

import torch

from .paged_store import PagedStore, ceil_div, private_store

# requests larger than the largest capacity bucket: slots per row are rounded up to the ladder 256, 384, 512, 768,
# 1024, 1536, ... (powers of two and 1.5x powers of two), so such a store is at most 1.5x what the request needs
CAPACITY_LADDER_START = 256


def bucket_capacity(config, needed: int, page_size: int) -> int:
    """Slots per row for a store that must hold ``needed``: the smallest of ``config.effective_capacity_buckets``
    >= needed; above the largest, the ladder 256, 384, 512, 768, 1024, ... (so even those requests share graphs);
    ``needed`` itself when bucketing is off. Then whole pages of ``page_size``. A compiled decode step sees the same
    shapes for every request of one bucket."""
    needed = max(needed, 1)
    buckets = config.effective_capacity_buckets
    bucket = needed
    if buckets:
        bucket = next((size for size in buckets if size >= needed), None) or _ladder_bucket(needed)
    return -(-bucket // page_size) * page_size


def _ladder_bucket(needed: int) -> int:
    """The smallest of 256, 384, 512, 768, 1024, 1536, ... (2^k and 3 * 2^(k-1)) that is >= ``needed``."""
    size = CAPACITY_LADDER_START
    while size < needed:
        half_step = size * 3 // 2
        if half_step >= needed:
            return half_step
        size *= 2
    return size


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fit_slots(tensor: torch.Tensor, size: int, fill) -> torch.Tensor:
    """``tensor`` with dim 2 cut or extended (by ``fill``) to ``size``."""
    if tensor.shape[2] >= size:
        return tensor[:, :, :size].contiguous()
    return pad_slots(tensor, size, fill)


def pad_slots(tensor: torch.Tensor, size: int, fill) -> torch.Tensor:
    """``tensor`` with dim 2 extended to ``size`` by ``fill`` (slots or KT pages that hold no token)."""
    missing = size - tensor.shape[2]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[2] = missing
    return torch.cat([tensor, tensor.new_full(shape, fill)], dim=2)


def slack_of(store: PagedStore, lengths: list[int]) -> int:
    """How many fewer tokens the tightest row can take than the store's capacity minus its longest row."""
    rooms = [c - n for c, n in zip(store.row_capacity(), lengths)]
    return store.capacity - max(lengths) - min(rooms)


def slots_for(layer, needed: int) -> int:
    """Slots per row of a store of ``layer`` that must hold ``needed`` tokens: the capacity bucket that holds them
    (``RocketKVConfig.capacity_buckets``; exact when bucketing is off), in whole KT pages. Buckets keep a compiled
    decode step's shapes the same across prompt lengths and max_new_tokens."""
    return bucket_capacity(layer.config, needed, layer.config.page_size)


def headroom(layer) -> int:
    """Slots for tokens still to come: from generate()'s max_length when known (the tokens it will still feed back;
    0 when it generates one token), else the config's headroom (a stale hint of an earlier call too)."""
    # a first prefill is eager and counts its tokens on the host: no read of the device counter (a sync)
    seen = layer.host_seen if not layer.compressed and layer.host_bookkeeping() else layer.get_seq_length()
    config, max_length = layer.config, layer.hints.max_length
    if max_length is not None and max_length >= seen:
        return config.decode_headroom(max_length - seen)
    return config.decode_headroom(config.capacity_headroom)


def private_view(layer, batch: int, capacity: int) -> PagedStore:
    """A store of ``layer``'s own for ``capacity`` slots per row, with KT (pages of one KT page each, so the
    capacity is exactly what the layer asked for)."""
    page = layer.config.page_size
    return private_store(batch, ceil_div(capacity, page), layer.num_kv_heads, page, layer.head_dim, layer.dtype,
                         layer.device, page, layer.config.kt_torch_dtype)


def private_history(layer, batch: int, capacity: int) -> PagedStore:
    """A store of ``layer``'s own without KT for keep_all's history, ``capacity`` slots per row."""
    page = layer.config.page_size
    return private_store(batch, ceil_div(capacity, page), layer.num_kv_heads, page, layer.head_dim, layer.dtype,
                         layer.device)


def grow_view(layer, extra: int) -> None:
    """Grow ``layer``'s compressed view (eager mode) so that every row can take ``extra`` more tokens: a private
    store is reallocated; a pool-backed one gets more pages from the pool."""
    if layer.capacity - layer.host_max_length - layer.host_slack >= extra:
        return
    needed = layer.host_max_length + extra
    new_capacity = round_up(needed + headroom(layer), layer.config.page_size)
    keys, values = layer.store.gather()
    kt = layer.store.gather_kt()
    if layer.pages is not None:
        store = layer.pages.grow_view(layer, new_capacity).widened(slots_for(layer, new_capacity))
    else:
        store = private_view(layer, keys.shape[0], slots_for(layer, new_capacity))
    store.write(keys, values, kt)
    # a pool-backed view's rows may hold different page counts (only the short ones took pages): eager growth may
    # read the lengths back (a sync)
    slack = 0 if layer.pages is None else slack_of(store, layer.lengths.tolist())
    layer.move_view(store, pad_slots(layer.positions, store.capacity, -1), slack)
