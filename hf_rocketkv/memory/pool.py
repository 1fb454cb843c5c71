"""KVBlockPool: fixed-size KV pages shared by every request, with exact accounting, prefix reuse and host offload.

    pool = KVBlockPool(model, max_gpu_bytes=40 << 30, host_bytes=64 << 30, page_size=16, dtype=torch.bfloat16)
    pool = KVBlockPool(model)                  # sized from free memory: 0.9 of CUDA's free, 0.25 of RAM (sizing.py)
    pool.pages_needed(32768, 256, cfg)         # PagesNeeded(prefill_peak=..., steady_state=..., ...)
    adm = pool.admit(32768, 256, cfg, token_ids=ids)   # every page or none
    storage = pool.layer(layer_idx, key_states)        # the layer's page tensors (allocated on first use)
    ...
    pool.commit_prompt(adm); pool.release(adm.prompt); ...; pool.release(adm)

The class is the public face of small parts, each with one job (docs/memory.md has the layout, the formulas, the
hashing scheme and the life of a request):

    core.py          PageCore: page metadata, free lists, reference counts, take / release, the lock, deferred releases
    planner.py       Planner: admission plans from plain per-row numbers, admit, reservations
    prefix_index.py  PrefixIndex: prefix hash -> page, registration, chain lookups, reset
    offload.py       HostOffload: eviction, the host tier, onload (copies: host_tier.py, copy_events.py)
    prefix_file.py   PrefixFiles: save_prefix / load_prefix and the file format
    budget.py        as_budget: how ``cfg`` becomes per-row numbers (``RowDemand``); the pool reads no config field
    sizing.py        the pool's size when none is given: a fraction of the free device memory or of the RAM

Thread safety: one re-entrant lock per pool (``pool._lock``, ``core.py``): every public method holds it for its
whole run, except that ``save_prefix`` writes and ``load_prefix`` reads the file outside it. A garbage-collector
finalizer must not release pages (it can run inside a pool method): ``release_later`` only queues them for the next
call (``deferred.py``). CUDA streams: call the pool on the stream that writes and reads the pages; host copies run on
the pool's copy stream, ordered by events (``copy_events.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .accounting import PagesNeeded
from .admission import Admission
from .block_table import BlockTable
from .budget import PoolSpec, as_budget
from .core import PageCore
from .deferred import weakly_bound
from .errors import check_device, check_pool_options
from .fingerprint import fingerprint_fields, fingerprint_of
from .geometry import KT_DTYPES, dtype_name, model_geometry, parse_dtype, split_model_and_config, storage_dtype
from .hashing import PrefixKeys, root_hash
from .hybrid import HybridLayout
from .layout import LayerShape, RecordLayout, pool_sizes
from .offload import HostOffload
from .page_meta import DEFAULT_PRIORITY, LOADED_PREFIX_PRIORITY, PageInfo, check_priority
from .planner import Planner
from .prefix_file import LoadedPrefix, PoolFacts, PrefixFiles
from .prefix_index import PrefixIndex
from .reservation import Reservation
from .sizing import PoolSize, activation_widths, auto_pool_size, geometry_prefill_reserve, model_device
from .sliding_slab import SlidingSlab, SlotLease
from .stats import PoolStats
from .storage import LayerStorage, PageStorage

__all__ = ["KVBlockPool", "LoadedPrefix"]


class KVBlockPool:
    """A pool of KV pages for one model: ``num_pages`` pages of ``page_size`` tokens in every layer.

    Args:
        model_or_config: a model (a ``torch.nn.Module`` with ``.config``; its weights enter the fingerprint), its
            config, or any object with ``num_hidden_layers``, ``num_key_value_heads`` (or ``num_attention_heads``)
            and ``head_dim`` (or ``hidden_size``); ``get_text_config()`` is used when present.
        max_gpu_bytes: device bytes for pages; ``num_pages = max_gpu_bytes // bytes_per_page`` where a page counts
            K + V + KT (+ fp8 scales) of every layer. Transient copy staging is outside this budget. None (the
            default): sized now from the memory free where the pages will live (``device``, else the model's
            device, else the current CUDA device, else the CPU; ``memory/sizing.py``): 0.9 of the free CUDA memory
            less what a 32k-token prompt's prefill needs outside the pool (``prefill_reserve_bytes``; 5.4 GiB at
            Llama-3.1-8B shapes), or 0.25 of the available RAM capped at 2 GiB; ``pool.sizing`` says how (None when bytes were given).
        host_bytes: host bytes for offloaded pages (0: none): ``host_bytes // slot_bytes`` slots, pinned (a slot
            holds a page of the layers that have pages: a hybrid model's full-attention layers, ``hybrid.py``).
        page_size: tokens per pool page, a multiple of ``kt_page_size``.
        dtype: K/V storage dtype ("bfloat16", "float16", "float32", "float8_e4m3fn"); None: the model's dtype.
        kt_page_size: tokens per KT page (must equal ``RocketKVConfig.page_size`` of every cache using the pool).
        kt_dtype: KT dtype (must equal ``RocketKVConfig.kt_cache_dtype``).
        scale_granularity: fp8 storage: one scale per page ("page") or per page and KV head ("head").
        num_kv_heads: KV heads per page to plan for (a tensor-parallel shard's count); default: the config's.
        device: where ``load_prefix`` allocates layers that have not stored anything yet.
        prefix_reuse: keep prompt pages hashed and reusable (True), or not (admission then plans in-place compaction).
        default_priority: retention priority of cached prompt pages (0..100, lower is evicted first).
        offload_min_priority: cached pages below this priority are dropped instead of offloaded.
        transfer_chunk_pages: pages per staging chunk of a host copy.
        fingerprint_samples: weight tensors sampled into the fingerprint when a model is given.
        sliding_slots: a model with sliding-window layers (its config's ``layer_types`` / ``sliding_window``): how
            many rows may hold a sliding-window slot at once (one slot = ``window`` tokens of K and V in every
            sliding layer, ``sliding_slab.py``), paid out of ``max_gpu_bytes`` before the pages; None: all of
            ``max_gpu_bytes`` when every layer slides, else ``min(64, max_gpu_bytes // 2 // bytes_per_slot)``
            (``hybrid.py``). Pages then span the full-attention layers only; under fp8 pages the slab keeps the
            model's dtype (its parameters', else its config's ``dtype``: ``sliding_dtype``).

    ``cfg`` of the admission methods is converted by ``budget.as_budget``: a RocketKVConfig (hf_rocketkv.cache
    registers it), or plain numbers (a ``RowDemand``, or a list of them, one per row).
    """

    def __init__(
        self,
        model_or_config: Any,
        max_gpu_bytes: int | None = None,
        host_bytes: int = 0,
        page_size: int = 16,
        dtype: torch.dtype | str | None = None,
        *,
        kt_page_size: int = 4,
        kt_dtype: torch.dtype | str = "float8_e5m2",
        scale_granularity: str = "page",
        num_kv_heads: int | None = None,
        device: torch.device | str | None = None,
        prefix_reuse: bool = True,
        default_priority: int = DEFAULT_PRIORITY,
        offload_min_priority: int = DEFAULT_PRIORITY,
        transfer_chunk_pages: int = 64,
        fingerprint_samples: int = 4,
        sliding_slots: int | None = None,
    ):
        device = check_device(device, "KVBlockPool.device")
        self.geometry, model = model_geometry(model_or_config, num_kv_heads)
        self.sizing: PoolSize | None = None
        if max_gpu_bytes is None:  # the reserve from the geometry just read (a shard's KV heads under num_kv_heads)
            widths = activation_widths(split_model_and_config(model_or_config)[1], self.geometry)
            self.sizing = auto_pool_size(model_device(model, device),
                                         reserve=geometry_prefill_reserve(self.geometry, *widths))
            max_gpu_bytes = self.sizing.bytes
        check_pool_options(page_size, kt_page_size, host_bytes, max_gpu_bytes, scale_granularity, prefix_reuse,
                           transfer_chunk_pages, fingerprint_samples)
        default_priority = check_priority(default_priority, "KVBlockPool.default_priority")
        offload_min_priority = check_priority(offload_min_priority, "KVBlockPool.offload_min_priority")
        self.dtype = storage_dtype(dtype, self.geometry)
        self.kt_dtype = parse_dtype(kt_dtype, "KVBlockPool.kt_dtype", KT_DTYPES)
        self.page_size, self.kt_page_size = page_size, kt_page_size
        self.scale_granularity = scale_granularity

        planned = LayerShape(self.geometry.num_kv_heads, self.geometry.head_dim, page_size, kt_page_size,
                             self.dtype, self.kt_dtype, scale_granularity)
        num_layers = self.geometry.num_layers
        self.hybrid = HybridLayout.of(split_model_and_config(model_or_config)[1], self.geometry, self.dtype,
                                      max_gpu_bytes, host_bytes, sliding_slots)
        slab = None
        if self.hybrid.slab_windows:
            slab = SlidingSlab(self.hybrid.slab_windows, self.hybrid.num_slots, self.geometry.num_kv_heads,
                               self.geometry.head_dim, self.hybrid.slab_dtype)
        if self.hybrid.global_layers:
            self.bytes_per_page, self.num_pages, slot_bytes, num_slots = pool_sizes(
                planned, len(self.hybrid.global_layers), self.hybrid.page_bytes_budget, host_bytes)
        else:  # every layer slides: no page holds anything
            self.bytes_per_page, self.num_pages, slot_bytes, num_slots = 0, 0, 0, 0
        self._storage = PageStorage(num_layers, self.num_pages, planned, self.hybrid.global_layers)
        fields = fingerprint_fields(self.geometry, self.dtype, model, fingerprint_samples)
        self.fingerprint = fingerprint_of(fields)
        self.spec = PoolSpec(page_size, kt_page_size, dtype_name(self.kt_dtype), prefix_reuse)

        self._core = PageCore(self._storage, num_slots, slab)
        self._lock = self._core.lock
        self._index = PrefixIndex(self._core, root_hash(self.fingerprint), page_size, default_priority)
        self._offload = HostOffload(self._core, self._index, slot_bytes, offload_min_priority, transfer_chunk_pages)
        self._core.on_evict(weakly_bound(self._offload.evict_pages))  # weak: the core holds no part above it
        self._planner = Planner(self._core, self._index, self._offload, self.spec, self.bytes_per_page,
                                paged=bool(self.hybrid.global_layers))
        facts = PoolFacts(self.fingerprint, fields, self.dtype, self.kt_dtype, page_size, kt_page_size,
                          scale_granularity, num_layers, self.hybrid.windows)
        self._files = PrefixFiles(facts, self._core, self._index, self._offload,
                                  device, model)

    @property
    def prefix_reuse(self) -> bool:
        """Whether prompt pages are hashed and kept for reuse (``pool.spec.prefix_reuse``). Settable: admissions
        planned afterwards follow the new mode (pages already cached stay in the index)."""
        return self.spec.prefix_reuse

    @prefix_reuse.setter
    def prefix_reuse(self, value: bool) -> None:
        if not isinstance(value, bool):  # as the constructor: a truthy string would leave reuse silently on
            raise ValueError(f"KVBlockPool.prefix_reuse must be True or False, got {value!r}")
        with self._lock:
            self.spec = dataclasses.replace(self.spec, prefix_reuse=value)
            self._planner.use_spec(self.spec)

    def __repr__(self) -> str:
        return (f"KVBlockPool({self.geometry.architecture}, pages={self.num_pages}x{self.page_size} tokens, "
                f"dtype={dtype_name(self.dtype)}, free={self._core.available()}, host_slots={self.host_slots}"
                + (f", sliding_slots={self.total_slots()}" if self.has_sliding_layers else "") + ")")

    # settings kept by the part that uses them
    default_priority = property(
        lambda self: self._index.default_priority,
        lambda self, value: self._index.use_default_priority(check_priority(value, "KVBlockPool.default_priority")),
        doc="Retention priority of cached prompt pages registered without one (0..100).")
    offload_min_priority = property(
        lambda self: self._offload.offload_min_priority,
        lambda self, value: self._offload.use_min_priority(check_priority(value, "KVBlockPool.offload_min_priority")),
        doc="Cached pages below this priority (0..100) are dropped instead of offloaded.")
    device = property(lambda self: self._files.device,
                      lambda self, value: self._files.use_device(check_device(value, "KVBlockPool.device")),
                      doc="Where ``load_prefix`` allocates layers that have not stored anything yet.")

    @property
    def _host(self):
        """The pinned host buffer (``.pinning``, ``.register_seconds`` say how it was pinned), or None."""
        return self._offload.host

    def _record_layout(self) -> RecordLayout:
        return self._core.record_layout()

    # ============================================================================================ occupancy
    def total_pages(self) -> int:
        return self.num_pages

    # sliding-window slots (a model with sliding layers; docs/memory.md, "Layer kinds")
    @property
    def has_sliding_layers(self) -> bool:
        return bool(self.hybrid.slab_windows)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: its sliding window, None for a full-attention layer (the model config's layer types)."""
        return self.hybrid.windows

    @property
    def bytes_per_slot(self) -> int:
        """Device bytes of one sliding-window slot (K and V of ``window`` tokens in every sliding layer); 0 without."""
        return self.hybrid.bytes_per_slot

    @property
    def sliding_dtype(self) -> torch.dtype | None:
        """The sliding-window slab's K/V dtype: ``dtype``, or under fp8 pages the model's (``hybrid.py``); None
        without sliding layers."""
        return self.hybrid.slab_dtype

    def total_slots(self) -> int:
        return self.hybrid.num_slots

    def free_slots(self) -> int:
        """Sliding-window slots an admission can take now (free less reserved); 0 without sliding layers."""
        with self._lock:
            return self._core.slab.available() if self._core.slab is not None else 0

    def take_slot(self, what: str = "taking a sliding-window slot") -> SlotLease:
        """One sliding-window slot outside any admission (a batch's padding rows write there), or
        PoolExhaustedError; give it back with ``release``."""
        with self._lock:
            self._planner.check_slots(what, 1)
            return self._core.slab.take(1)[0]

    def free_slot_ids(self) -> list[int]:
        with self._lock:
            return self._core.slab.free_ids() if self._core.slab is not None else []

    def device_bytes(self) -> int:
        """Device bytes the pool plans for: ``num_pages x bytes_per_page + total_slots x bytes_per_slot``."""
        return self.num_pages * self.bytes_per_page + self.total_slots() * self.bytes_per_slot

    def free_pages(self) -> int:
        """Pages an allocation can take now: unused and cached ones (evicted on demand), less the reserved."""
        with self._lock:
            return self._core.available()

    def reserved_pages(self) -> int:
        """Free pages set aside by reservations (row-group prefills in progress)."""
        with self._lock:
            return self._core.reserved

    def used_pages(self) -> int:
        with self._lock:
            return self.num_pages - len(self._core.free)

    def cached_pages(self) -> int:
        """Free device pages that still hold a prefix."""
        with self._lock:
            return self._core.cached_count()

    @property
    def host_slots(self) -> int:
        return len(self._core.host_pages)

    def copied_bytes(self) -> tuple[int, int]:
        """``(offloaded_bytes, onloaded_bytes)`` so far, without ``stats()``'s walk over every page."""
        with self._lock:
            return self._core.counters["offloaded_bytes"], self._core.counters["onloaded_bytes"]

    def stats(self) -> PoolStats:
        with self._lock:
            return self._core.stats()

    def page_info(self, index: int, tier: str = "device") -> PageInfo:
        """A snapshot of one device page's (or host slot's) metadata."""
        with self._lock:
            return self._core.page_info(index, tier)

    def free_page_ids(self, tier: str = "device") -> list[int]:
        """Free pages (host: slots not being onloaded) in allocation / eviction order."""
        with self._lock:
            return list(self._core.tier(tier)[1].in_allocation_order())

    # ============================================================================================ storage
    def layer(self, layer_idx: int, key_states: torch.Tensor | None = None) -> LayerStorage:
        """Layer ``layer_idx``'s page tensors; the first call with ``key_states`` ``[B, Hkv, T, D]`` allocates them
        on its device with its KV-head count (a tensor-parallel shard's)."""
        with self._lock:
            if key_states is None:
                return self._storage.layer(layer_idx)
            if not isinstance(key_states, torch.Tensor) or key_states.dim() != 4:
                raise ValueError(
                    f"KVBlockPool.layer: key_states must be a [batch, kv_heads, tokens, head_dim] tensor, got "
                    f"{getattr(key_states, 'shape', type(key_states).__name__)}"
                )
            return self._storage.bind(layer_idx, key_states.shape[1], key_states.shape[3], key_states.device)

    def sliding_slab(self, layer_idx: int, key_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliding layer ``layer_idx``'s ring slab ``(k, v)``, each ``[total_slots, Hkv, window, D]`` (allocated on
        the first call, on ``key_states``' device with its KV-head count); slot ``s`` is row ``s``."""
        with self._lock:
            if self._core.slab is None:
                raise ValueError("KVBlockPool.sliding_slab: this pool's model has no sliding-window layers")
            return self._core.slab.bind(layer_idx, key_states.shape[1], key_states.shape[3], key_states.device)

    def bind_all(self, device: torch.device | str, num_kv_heads: int | None = None) -> None:
        """Allocate every layer not allocated yet on ``device`` (default: the planned KV-head count): the pages of
        the full-attention layers, the slab of the sliding ones."""
        with self._lock:
            heads = num_kv_heads or self._storage.planned.num_kv_heads
            for layer_idx in self.hybrid.global_layers:
                if not self._storage.is_bound(layer_idx):
                    self._storage.bind(layer_idx, heads, self.geometry.head_dim, torch.device(device))
            for layer_idx in self.hybrid.slab_windows:
                self._core.slab.bind(layer_idx, heads, self.geometry.head_dim, torch.device(device))

    # ============================================================================================ admission (planner.py)
    def check_config(self, cfg: Any) -> None:
        """Refuse a ``cfg`` the pool cannot serve (a RocketKVConfig: another KT geometry, per-head budgets)."""
        as_budget(cfg, self.spec)

    def hash_pages(self, token_ids: Any, keys: PrefixKeys | None = None) -> list[bytes]:
        """Chained prefix hashes of the full pages of ``token_ids`` under this pool's model fingerprint."""
        return self._index.hash_pages(token_ids, keys)

    def pages_needed(self, prompt_len: int | Sequence[int], max_new_tokens: int | Sequence[int], cfg: Any,
                     token_ids: Any = None, keys: Any = None, keep_all: bool | None = None) -> PagesNeeded:
        """Pages a request (or a batch: lists per row) takes at its prefill peak and holds once compressed; with
        token ids, prefix hits are counted (formulas: accounting.py, docs/memory.md)."""
        return self._planner.pages_needed(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all)

    def can_admit(self, prompt_len: int | Sequence[int], max_new_tokens: int | Sequence[int], cfg: Any,
                  token_ids: Any = None, keys: Any = None, keep_all: bool | None = None) -> bool:
        """``pages_needed(...).prefill_peak <= free_pages()``: admitting now cannot fail for lack of pages."""
        return self._planner.can_admit(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all)

    def admit(self, prompt_len: int, max_new_tokens: int, cfg: Any, token_ids: Any = None,
              keys: PrefixKeys | None = None, keep_all: bool | None = None) -> Admission:
        """Take every page one request needs (prefix hits first), or raise PoolExhaustedError and change nothing."""
        if not isinstance(prompt_len, int):
            raise ValueError(f"admit: prompt_len must be an integer (admit_batch takes rows), got {prompt_len!r}")
        return self._planner.admit(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all)[0]

    def admit_batch(self, prompt_lens: Sequence[int], max_new_tokens: int | Sequence[int], cfg: Any,
                    token_ids: Any = None, keys: Any = None, keep_all: bool | None = None,
                    reservation: Reservation | None = None) -> list[Admission]:
        """``admit`` for several rows: all or none. ``reservation``'s pages count as free for it and what it takes
        comes off them."""
        if isinstance(prompt_lens, int):
            raise ValueError(f"admit_batch: prompt_lens must be a list of row lengths, got {prompt_lens!r}")
        return self._planner.admit(list(prompt_lens), max_new_tokens, cfg, token_ids, keys, keep_all, reservation)

    def reclaim_unreachable(self) -> bool:
        """Run the cyclic garbage collector once (without holding the pool); True if pages came back."""
        return self._planner.reclaim_unreachable()

    def reserve(self, num_pages: int, what: str = "reserving pages", slots: int = 0) -> Reservation:
        """Set ``num_pages`` free pages (and ``slots`` sliding-window slots) aside, or raise PoolExhaustedError and
        change nothing; ``unreserve`` without a count gives both back."""
        return self._planner.reserve(num_pages, what, slots)

    def add_to_reservation(self, reservation: Reservation, num_pages: int) -> None:
        """Set ``num_pages`` more free pages aside for ``reservation`` (e.g. pages its owner just released)."""
        self._planner.add_to_reservation(reservation, num_pages)

    def unreserve(self, reservation: Reservation, num_pages: int | None = None) -> None:
        """Give ``num_pages`` (default: all) of a reservation's pages back to everyone."""
        self._planner.unreserve(reservation, num_pages)

    # ============================================================================================ pages (core.py)
    def new_table(self, kind: str, max_pages: int | None = None) -> BlockTable:
        return BlockTable(kind, max_pages)

    def allocate(self, table: BlockTable, num_pages: int) -> None:
        """Append ``num_pages`` fresh pages to ``table`` (ref 1 each), or raise and change nothing."""
        self._core.allocate(table, num_pages)

    def allocate_batch(self, requests: Sequence[tuple[BlockTable, int]], what: str = "allocating pages") -> None:
        """``allocate`` for several tables at once: every table gets its pages, or none does."""
        self._core.allocate_batch(requests, what)

    def release(self, obj: BlockTable | Admission | SlotLease) -> None:
        """Drop a table's (or an admission's two tables' and its slot's) references, tail first; freed hashed pages
        stay cached. A ``SlotLease`` (``Admission.slot``) goes back to the free slots."""
        self._core.release(obj)

    def truncate(self, table: BlockTable, num_pages: int) -> None:
        """Release ``table``'s pages from ``num_pages`` on (tail first): in-place compaction gives its tail back."""
        self._core.truncate(table, num_pages)

    def exclusive(self):
        """The pool's re-entrant lock: ``with pool.exclusive():`` a sequence of calls no other thread interleaves."""
        return self._lock

    def release_later(self, obj: Any) -> None:
        """Queue tables / admissions / reservations for release at the next call (safe from a finalizer)."""
        self._core.release_later(obj)

    def pending_releases(self) -> int:
        """Objects queued by ``release_later`` and not released yet."""
        return len(self._core.deferred)

    # ============================================================================================ prefixes (prefix_index.py)
    def register(self, table: BlockTable, hashes: Sequence[bytes], start_page: int = 0,
                 priority: int | None = None) -> int:
        """Index pages ``start_page, ...`` of ``table`` (written) under ``hashes``; returns pages newly indexed."""
        return self._index.register(table, hashes, start_page, priority)

    def commit_prompt(self, admission: Admission, num_tokens: int | None = None, priority: int | None = None) -> int:
        """Index the admission's full prompt pages among its first ``num_tokens`` (written) tokens."""
        return self._index.commit_prompt(admission, num_tokens, priority)

    def resident_prefix(self, token_ids: Any, keys: PrefixKeys | None = None) -> list[PageInfo]:
        """The longest chain of full pages of ``token_ids`` in the index (device or host), no hit cap; read-only."""
        return self._index.resident_prefix(token_ids, keys)

    def reset(self) -> None:
        """Forget every cached prefix (device and host). Refused while any table holds a page."""
        self._index.reset()

    # ============================================================================================ offload, files
    def evict(self, num_pages: int | None = None) -> int:
        """Evict (offload or drop) up to ``num_pages`` cached device pages (None: all); returns pages evicted."""
        return self._offload.evict(num_pages)

    def synchronize(self) -> None:
        """Block until every pending copy has completed."""
        with self._lock:
            self._core.events.synchronize()

    def save_prefix(self, path: str | Path, token_ids: Any, keys: PrefixKeys | None = None) -> int:
        """Write the longest resident chain of ``token_ids``' full pages to a file; returns its token count."""
        return self._files.save(path, token_ids, keys)

    def load_prefix(self, path: str | Path, cache_salt: str | None = None, priority: int = LOADED_PREFIX_PRIORITY,
                    device: torch.device | str | None = None) -> LoadedPrefix:
        """Insert a prefix file's pages as cached pages, hashed anew under ``cache_salt`` (never read from it)."""
        return self._files.load(path, cache_salt, priority, device)

    def close(self) -> None:
        """Wait for pending copies and unregister the pinned host buffer (also done when the pool is collected)."""
        self._offload.close()
