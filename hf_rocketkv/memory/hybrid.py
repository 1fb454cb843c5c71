"""HybridLayout: how a pool splits its bytes between pages and sliding-window slots, by layer kind.

A model's layers are full attention (RocketKV layers: pool pages, stage 1 and stage 2) or sliding-window attention
(``layer_kinds.py``). A page spans the full-attention layers only; each sliding layer gets a ring of ``window``
tokens per row in the pool's slab (``sliding_slab.py``), one slot per admitted row. The byte budget is paid in that
order:

    bytes_per_slot = sum over sliding layers of 2 * Hkv * window * D * itemsize(slab dtype)
    num_slots      = sliding_slots, or (None) max_gpu_bytes // bytes_per_slot when every layer slides,
                     else min(DEFAULT_SLOTS, max_gpu_bytes // 2 // bytes_per_slot)
    pages          = (max_gpu_bytes - num_slots * bytes_per_slot) // bytes_per_page   (full-attention layers only)

A model without sliding layers gets no slab and all of ``max_gpu_bytes`` for pages, as before.

The slab holds the model's K/V as they are, in the *slab dtype*: the pool's dtype, except for fp8 pages
(``float8_e4m3fn``), which only the full-attention layers' pages use (quantized and scaled as in any fp8 pool); the
slab then keeps the model's dtype (its parameters' when the pool is built from a model, else its config's ``dtype``),
which ``bytes_per_slot`` counts.

Prefix reuse shares the full-attention layers' pages only; a hit rebuilds the sliding layers' windows by running the
model again over the prefix's last ``sum(windows)`` tokens (``layer_kinds.replay_tokens``, ``cache/pool_pages.py``'s
``setup_prefix``). Host offload and prefix files follow from that: a host slot and a prefix file's page hold one
page record, the full-attention layers' tensors only (``layout.RecordLayout`` over ``global_layers``), so a host slot
takes the bytes of a device page (segments aligned) and an onloaded or loaded page is a hit like any other, its
sliding windows replayed. A prefix file records ``windows`` (``layer_windows``) and is loaded only into a pool whose
model has the same layer kinds and windows (``prefix_file.py``). A model whose layers all slide has no pages, so no
prefix hits (``token_ids`` at admission is refused), nothing to offload (``host_bytes`` is refused) and nothing to
save.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import check_int
from .geometry import FP8_KV_DTYPE, KV_DTYPES, ModelGeometry, dtype_name
from .layer_kinds import describe, sliding_windows
from .sliding_slab import SlidingSlab

DEFAULT_SLOTS = 64


@dataclass(frozen=True)
class HybridLayout:
    """Layer kinds of a pool's model and the slot budget (module docstring)."""

    windows: tuple[int | None, ...]  # per layer: its window, None for full attention
    global_layers: tuple[int, ...]
    slab_windows: dict[int, int]  # sliding layer index -> window
    num_slots: int
    bytes_per_slot: int
    page_bytes_budget: int  # what is left of max_gpu_bytes for pages
    slab_dtype: torch.dtype | None = None  # the sliding layers' K/V dtype (module docstring); None without a slab

    @classmethod
    def of(cls, config: Any, geometry: ModelGeometry, dtype: torch.dtype, max_gpu_bytes: int, host_bytes: int,
           sliding_slots: int | None) -> HybridLayout:
        windows = sliding_windows(config)
        if len(windows) != geometry.num_layers:
            windows = (None,) * geometry.num_layers
        sliding = {i: w for i, w in enumerate(windows) if w is not None}
        global_layers = tuple(i for i, w in enumerate(windows) if w is None)
        if not sliding:
            if sliding_slots is not None:
                raise ValueError("KVBlockPool.sliding_slots is for a model with sliding-window layers; this model "
                                 "has none (leave it None)")
            return cls(windows, global_layers, {}, 0, 0, max_gpu_bytes)
        layers = describe(windows)
        if host_bytes and not global_layers:
            raise ValueError(f"KVBlockPool.host_bytes={host_bytes}: every layer of this model slides ({layers}), so "
                             f"it has no pages to offload; leave host_bytes at 0")
        slab_dtype = slab_dtype_of(dtype, geometry, layers)
        per_slot = SlidingSlab.slot_bytes(sliding, geometry.num_kv_heads, geometry.head_dim, slab_dtype)
        if sliding_slots is None:
            sliding_slots = (max_gpu_bytes // per_slot if not global_layers
                             else min(DEFAULT_SLOTS, max_gpu_bytes // 2 // per_slot))
        else:
            check_int(sliding_slots, "KVBlockPool.sliding_slots", 1)
        if sliding_slots < 1 or sliding_slots * per_slot > max_gpu_bytes:
            raise ValueError(
                f"KVBlockPool.max_gpu_bytes={max_gpu_bytes} does not hold {max(1, sliding_slots)} sliding-window "
                f"slot(s) of {per_slot} bytes each ({layers}); give the pool more bytes or fewer sliding_slots")
        return cls(windows, global_layers, sliding, sliding_slots, per_slot, max_gpu_bytes - sliding_slots * per_slot,
                   slab_dtype)


def slab_dtype_of(dtype: torch.dtype, geometry: ModelGeometry, layers: str) -> torch.dtype:
    """The sliding layers' slab dtype: the pool's, or for fp8 pages the model's (which it must name)."""
    if dtype != FP8_KV_DTYPE:
        return dtype
    allowed = {name: value for name, value in KV_DTYPES.items() if value != FP8_KV_DTYPE}
    if geometry.dtype is None or dtype_name(geometry.dtype) not in allowed:
        raise ValueError(
            f"KVBlockPool(dtype={dtype_name(dtype)}): the sliding-window layers ({layers}) keep their K/V in the "
            f"model's dtype, and the model/config names {'none' if geometry.dtype is None else geometry.dtype}; "
            f"build the pool from the model, or set its config's dtype (one of {sorted(allowed)})")
    return geometry.dtype

