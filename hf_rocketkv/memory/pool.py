"""KVBlockPool: fixed-size KV pages shared by every request, with exact accounting, prefix reuse and host offload.

    pool = KVBlockPool(model, max_gpu_bytes=40 << 30, host_bytes=64 << 30, page_size=16, dtype=torch.bfloat16)
    pool.pages_needed(32768, 256, cfg)         # PagesNeeded(prefill_peak=..., steady_state=..., ...)
    adm = pool.admit(32768, 256, cfg, token_ids=ids)   # every page or none
    storage = pool.layer(layer_idx, key_states)        # the layer's page tensors (allocated on first use)
    ...
    pool.commit_prompt(adm); pool.release(adm.prompt); ...; pool.release(adm)

docs/memory.md has the layout, the formulas, the hashing scheme and the life of a request. This module composes
the parts: storage.py (device tensors), free_list.py (allocation / eviction order), hashing.py (prefix keys),
accounting.py (pages needed), host_tier.py (offload), prefix_file.py (files).

Thread safety: one re-entrant lock per pool (``pool._lock``). Every public method holds it for its whole run,
except that ``save_prefix`` writes and ``load_prefix`` reads the file outside it. Block tables are changed only by
the pool, under the lock. Pages must not be released from a garbage-collector finalizer (it can run inside a pool
method on the same thread): a finalizer calls ``release_later``, which only queues the tables; the pool releases
them at its next call (``deferred.py``).

CUDA streams: call the pool on the stream that writes and reads the pages (the current stream; ``release`` after the
last kernel that uses them is enqueued). Copies run on the pool's own copy stream: a copy out of or into a page waits
for the event recorded when that page was last released (not for the whole compute stream, so copies overlap
compute), and the current stream waits for every copy touching a page the pool hands it. No page or host slot is
reused while a copy still reads or writes it.
"""

from __future__ import annotations

import gc
import json
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .accounting import PagesNeeded, RowPages, row_pages
from .admission import Admission
from .block_table import BlockTable
from .deferred import DeferredReleases, DrainingLock, weakly_bound
from .errors import PoolExhaustedError, PoolStateError, PrefixFileError
from .fingerprint import fingerprint_fields, fingerprint_of
from .free_list import UNCACHED, FreeLists, cached_queue
from .geometry import KT_DTYPES, KV_DTYPES, dtype_name, model_geometry, parse_dtype
from .hashing import HASH_SCHEME, MultimodalItem, PrefixKeys, as_token_list, hit_cap_tokens, page_hashes, root_hash
from .host_tier import CopyEngine, HostBuffer
from .layout import SCALE_GRANULARITIES, LayerShape, RecordLayout
from .page_meta import DEFAULT_PRIORITY, LOADED_PREFIX_PRIORITY, PageInfo, PageMeta, Tier, check_priority
from .prefix_file import read_prefix_file, write_prefix_file
from .reservation import Reservation
from .stats import PoolStats
from .storage import LayerStorage, PageStorage

if TYPE_CHECKING:  # type hints only: memory/ does not depend on the config module at run time
    from ..config import RocketKVConfig

CONFIG_FIELDS = ("prompt_budget", "page_size", "window_size", "kt_cache_dtype")


def _check_int(value: Any, field: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _distinct(events) -> list:
    """The distinct non-None events, in first-seen order."""
    return list({id(event): event for event in events if event is not None}.values())


@dataclass
class _RowPlan:
    prompt_len: int
    max_new_tokens: int
    keys: PrefixKeys
    pages: RowPages
    hashes: list[bytes]
    hits: list[PageMeta]

    @property
    def new_prompt_pages(self) -> int:
        return self.pages.prompt_pages - len(self.hits)


@dataclass
class _Plan:
    rows: list[_RowPlan]
    needed: PagesNeeded
    host_hits: list[PageMeta]  # unique host slots hit, in first-seen order


@dataclass(frozen=True)
class LoadedPrefix:
    """What ``load_prefix`` did: tokens in the file, pages it inserted, pages that were already resident."""

    num_tokens: int
    pages_loaded: int
    pages_already_resident: int


def check_pool_policy(cfg: "RocketKVConfig") -> None:
    """Refuse a stage-1 policy a pool cannot account for (``KVBlockPool.check_config``; the serve CLI and the eval
    harness call it before loading a model): per-head budgets (AdaKV), ValueError naming stage1."""
    if getattr(cfg, "per_head_budgets", False):
        raise ValueError(
            f"RocketKVConfig.stage1={getattr(cfg.stage1, 'name', cfg.stage1)!r} gives each KV head its own number "
            f"of kept tokens, which a KVBlockPool does not account for: a pool page holds every KV head of a row, "
            f"so admission would have to reserve the longest head's count for all of them. Use this policy "
            f"without pool= (RocketKVCache(cfg) stores per-head lengths), or a uniform policy with the pool "
            f"(snapkv, streaming, knorm, h2o, random)"
        )


class KVBlockPool:
    """A pool of KV pages for one model: ``num_pages`` pages of ``page_size`` tokens in every layer.

    Args:
        model_or_config: a model (a ``torch.nn.Module`` with ``.config``; its weights enter the fingerprint), its
            config, or any object with ``num_hidden_layers``, ``num_key_value_heads`` (or ``num_attention_heads``)
            and ``head_dim`` (or ``hidden_size``); ``get_text_config()`` is used when present.
        max_gpu_bytes: device bytes for pages; ``num_pages = max_gpu_bytes // bytes_per_page`` where a page counts
            K + V + KT (+ fp8 scales) of every layer. Transient copy staging is outside this budget.
        host_bytes: host bytes for offloaded pages (0: none): ``host_bytes // slot_bytes`` slots, pinned.
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
    """

    def __init__(
        self,
        model_or_config: Any,
        max_gpu_bytes: int,
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
    ):
        _check_int(max_gpu_bytes, "KVBlockPool.max_gpu_bytes", 1)
        _check_int(host_bytes, "KVBlockPool.host_bytes", 0)
        _check_int(page_size, "KVBlockPool.page_size (tokens per pool page)", 1)
        _check_int(kt_page_size, "KVBlockPool.kt_page_size (tokens per KT page)", 1)
        if kt_page_size & (kt_page_size - 1):
            raise ValueError(f"KVBlockPool.kt_page_size (tokens per KT page) must be a power of 2, got {kt_page_size}")
        if page_size % kt_page_size:
            raise ValueError(
                f"KVBlockPool.page_size (tokens per pool page) must be a multiple of KVBlockPool.kt_page_size "
                f"(tokens per KT page): got page_size={page_size}, kt_page_size={kt_page_size}"
            )
        if scale_granularity not in SCALE_GRANULARITIES:
            raise ValueError(
                f"KVBlockPool.scale_granularity must be one of {list(SCALE_GRANULARITIES)}, got {scale_granularity!r}"
            )
        if not isinstance(prefix_reuse, bool):
            raise ValueError(f"KVBlockPool.prefix_reuse must be True or False, got {prefix_reuse!r}")
        _check_int(transfer_chunk_pages, "KVBlockPool.transfer_chunk_pages", 1)
        _check_int(fingerprint_samples, "KVBlockPool.fingerprint_samples", 0)
        self.default_priority = check_priority(default_priority, "KVBlockPool.default_priority")
        self.offload_min_priority = check_priority(offload_min_priority, "KVBlockPool.offload_min_priority")

        self.geometry, model = model_geometry(model_or_config, num_kv_heads)
        if dtype is None:
            if self.geometry.dtype is None:
                raise ValueError(
                    "KVBlockPool.dtype is None and the model/config names no dtype; pass dtype= one of "
                    f"{sorted(KV_DTYPES)}"
                )
            dtype = self.geometry.dtype
        self.dtype = parse_dtype(dtype, "KVBlockPool.dtype", KV_DTYPES)
        self.kt_dtype = parse_dtype(kt_dtype, "KVBlockPool.kt_dtype", KT_DTYPES)
        self.page_size = page_size
        self.kt_page_size = kt_page_size
        self.scale_granularity = scale_granularity
        self.prefix_reuse = prefix_reuse
        self.device = torch.device(device) if device is not None else None
        # a model was given: load_prefix allocates unbound layers where its weights are (at load time)
        self._model_ref = weakref.ref(model) if model is not None else None

        planned = LayerShape(self.geometry.num_kv_heads, self.geometry.head_dim, page_size, kt_page_size,
                             self.dtype, self.kt_dtype, scale_granularity)
        num_layers = self.geometry.num_layers
        self.bytes_per_page = planned.bytes_per_page() * num_layers
        self.num_pages = max_gpu_bytes // self.bytes_per_page
        if self.num_pages < 1:
            raise ValueError(
                f"KVBlockPool.max_gpu_bytes={max_gpu_bytes} holds no page: one page of {page_size} tokens takes "
                f"{self.bytes_per_page} bytes over {num_layers} layers"
            )
        self._storage = PageStorage(num_layers, self.num_pages, planned)

        self._fingerprint_fields = fingerprint_fields(self.geometry, self.dtype, model, fingerprint_samples)
        self.fingerprint = fingerprint_of(self._fingerprint_fields)
        self._root = root_hash(self.fingerprint)

        self._device_pages = [PageMeta(i, Tier.DEVICE) for i in range(self.num_pages)]
        self._free = FreeLists(self.num_pages)
        for meta in self._device_pages:
            self._free.push_back(UNCACHED, meta.index)
        self._index: dict[bytes, PageMeta] = {}

        self._host: HostBuffer | None = None
        self._engine: CopyEngine | None = None
        self._host_pages: list[PageMeta] = []
        self._host_free = FreeLists(0)
        if host_bytes:
            slot_bytes = RecordLayout([planned] * num_layers).record_bytes
            num_slots = host_bytes // slot_bytes
            if num_slots < 1:
                raise ValueError(
                    f"KVBlockPool.host_bytes={host_bytes} holds no page: one host slot takes {slot_bytes} bytes"
                )
            self._host = HostBuffer(num_slots, slot_bytes)
            self._engine = CopyEngine(self._host, transfer_chunk_pages)
            self._host_pages = [PageMeta(i, Tier.HOST) for i in range(num_slots)]
            self._host_free = FreeLists(num_slots)
            for meta in self._host_pages:
                self._host_free.push_back(UNCACHED, meta.index)

        self._layout: RecordLayout | None = None
        self._pending: deque[tuple[Any, list[PageMeta]]] = deque()
        self._clock = 0
        self._counters = dict.fromkeys(
            ("hit_pages", "missed_pages", "evictions", "dropped_pages", "host_evictions", "offloaded_bytes",
             "onloaded_bytes"), 0)
        self._reserved = 0  # pages set aside by reservations (counted, not held)
        self._deferred = DeferredReleases()
        # releases queued by finalizers happen at the next call; weakly bound: no reference cycle, so a dropped pool
        # frees its pages at once (not at the next full garbage collection)
        self._lock = DrainingLock(weakly_bound(self._drain_deferred))

    def __repr__(self) -> str:
        return (f"KVBlockPool({self.geometry.architecture}, pages={self.num_pages}x{self.page_size} tokens, "
                f"dtype={dtype_name(self.dtype)}, free={self._available()}, host_slots={len(self._host_pages)})")

    # ============================================================================================ occupancy
    def total_pages(self) -> int:
        return self.num_pages

    def free_pages(self) -> int:
        """Pages an allocation can take now: unused ones and cached ones (evicted on demand), less those set aside by
        reservations."""
        with self._lock:
            return self._available()

    def reserved_pages(self) -> int:
        """Free pages set aside by reservations (row-group prefills in progress)."""
        with self._lock:
            return self._reserved

    def _available(self, reservation: Reservation | None = None) -> int:
        """Free pages an allocation may take: all free ones less the reserved, plus its own reservation's."""
        return len(self._free) - self._reserved + (reservation.count if reservation is not None else 0)

    # ============================================================================================ reservations
    def reserve(self, num_pages: int, what: str = "reserving pages") -> Reservation:
        """Set ``num_pages`` free pages aside (``reservation.py``), or raise PoolExhaustedError and change nothing."""
        with self._lock:
            _check_int(num_pages, "num_pages", 0)
            if num_pages > self._available():
                raise PoolExhaustedError(what, num_pages, self._available(), self.num_pages)
            self._reserved += num_pages
            return Reservation(num_pages)

    def add_to_reservation(self, reservation: Reservation, num_pages: int) -> None:
        """Set ``num_pages`` more free pages aside for ``reservation`` (e.g. pages its owner just released)."""
        with self._lock:
            _check_int(num_pages, "num_pages", 0)
            if num_pages > self._available():
                raise PoolExhaustedError(f"adding to {reservation.name}", num_pages, self._available(),
                                         self.num_pages)
            reservation.count += num_pages
            self._reserved += num_pages

    def unreserve(self, reservation: Reservation, num_pages: int | None = None) -> None:
        """Give ``num_pages`` (default: all) of a reservation's pages back to everyone."""
        with self._lock:
            count = reservation.count if num_pages is None else min(_check_int(num_pages, "num_pages", 0),
                                                                    reservation.count)
            reservation.count -= count
            self._reserved -= count

    def _consume(self, reservation: Reservation | None, pages: int) -> None:
        """Pages just taken by an allocation naming ``reservation`` come off it first."""
        if reservation is not None:
            used = min(reservation.count, pages)
            reservation.count -= used
            self._reserved -= used

    def used_pages(self) -> int:
        with self._lock:
            return self.num_pages - len(self._free)

    def cached_pages(self) -> int:
        """Free device pages that still hold a prefix."""
        with self._lock:
            return len(self._free) - self._free.count(UNCACHED)

    @property
    def host_slots(self) -> int:
        return len(self._host_pages)

    def copied_bytes(self) -> tuple[int, int]:
        """``(offloaded_bytes, onloaded_bytes)`` so far: what ``stats()`` reports of them, counted when each copy is
        issued, without ``stats()``'s walk over every page (a cache reads these around each admission)."""
        with self._lock:
            return self._counters["offloaded_bytes"], self._counters["onloaded_bytes"]

    def stats(self) -> PoolStats:
        with self._lock:
            self._poll_copies()
            return PoolStats(
                total_pages=self.num_pages,
                free_pages=self._available(),
                cached_pages=len(self._free) - self._free.count(UNCACHED),
                used_pages=self.num_pages - len(self._free),
                in_flight_pages=sum(meta.in_flight for meta in self._device_pages),
                host_slots=len(self._host_pages),
                host_cached=len(self._host_free) - self._host_free.count(UNCACHED),
                **self._counters,
            )

    def page_info(self, index: int, tier: str = "device") -> PageInfo:
        """A snapshot of one device page's (or host slot's) metadata."""
        with self._lock:
            pages, free = self._tier(tier)
            if not isinstance(index, int) or not 0 <= index < len(pages):
                raise ValueError(f"page index must be in [0, {len(pages)}) for tier {tier!r}, got {index!r}")
            return PageInfo.of(pages[index], index in free)

    def free_page_ids(self, tier: str = "device") -> list[int]:
        """Free pages (host: slots not being onloaded) in the order allocation takes them / eviction drops them."""
        with self._lock:
            return list(self._tier(tier)[1].in_allocation_order())

    def _tier(self, tier: str) -> tuple[list[PageMeta], FreeLists]:
        if tier == Tier.DEVICE.value:
            return self._device_pages, self._free
        if tier == Tier.HOST.value:
            return self._host_pages, self._host_free
        raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")

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

    def bind_all(self, device: torch.device | str, num_kv_heads: int | None = None) -> None:
        """Allocate every layer not allocated yet on ``device`` (default: the planned KV-head count)."""
        with self._lock:
            heads = num_kv_heads or self._storage.planned.num_kv_heads
            for layer_idx in range(self.geometry.num_layers):
                if not self._storage.is_bound(layer_idx):
                    self._storage.bind(layer_idx, heads, self.geometry.head_dim, torch.device(device))

    def _record_layout(self) -> RecordLayout:
        if self._layout is None:
            self._layout = self._storage.record_layout()
        return self._layout

    def _page_data_bytes(self) -> int:
        return sum(shape.bytes_per_page() for shape in self._record_layout().layer_shapes)

    # ============================================================================================ accounting
    def check_config(self, cfg: "RocketKVConfig") -> None:
        """Refuse a RocketKVConfig whose KT geometry differs from this pool's KT slab."""
        missing = [name for name in CONFIG_FIELDS if not hasattr(cfg, name)]
        if missing:
            raise ValueError(f"cfg must be a RocketKVConfig; {type(cfg).__name__} lacks {missing}")
        if cfg.page_size != self.kt_page_size:
            raise ValueError(
                f"RocketKVConfig.page_size (tokens per KT page) is {cfg.page_size}, but this pool's KT slab holds KT "
                f"pages of KVBlockPool.kt_page_size={self.kt_page_size} tokens (KVBlockPool.page_size, tokens per "
                f"pool page, is {self.page_size}); build the pool with kt_page_size={cfg.page_size} or use "
                f"RocketKVConfig(page_size={self.kt_page_size})"
            )
        check_pool_policy(cfg)
        if cfg.kt_cache_dtype != dtype_name(self.kt_dtype):
            raise ValueError(
                f"RocketKVConfig.kt_cache_dtype is {cfg.kt_cache_dtype!r}, but this pool's KT slab is "
                f"KVBlockPool.kt_dtype={dtype_name(self.kt_dtype)!r}; build the pool with "
                f"kt_dtype={cfg.kt_cache_dtype!r} or use RocketKVConfig(kt_cache_dtype={dtype_name(self.kt_dtype)!r})"
            )

    def hash_pages(self, token_ids: Any, keys: PrefixKeys | None = None) -> list[bytes]:
        """Chained prefix hashes of the full pages of ``token_ids`` under this pool's model fingerprint."""
        return page_hashes(self._root, as_token_list(token_ids), self.page_size, keys)

    def pages_needed(self, prompt_len: int | Sequence[int], max_new_tokens: int | Sequence[int],
                     cfg: "RocketKVConfig", token_ids: Any = None, keys: Any = None,
                     keep_all: bool | None = None) -> PagesNeeded:
        """Pages a request (or a batch: ``prompt_len`` a list, ``token_ids`` a list per row) takes at its prefill
        peak and holds once compressed; with token ids, prefix hits are counted (formulas: docs/memory.md)."""
        with self._lock:
            return self._plan(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all).needed

    def can_admit(self, prompt_len: int | Sequence[int], max_new_tokens: int | Sequence[int],
                  cfg: "RocketKVConfig", token_ids: Any = None, keys: Any = None, keep_all: bool | None = None) -> bool:
        """``pages_needed(...).prefill_peak <= free_pages()``: admitting now cannot fail for lack of pages."""
        with self._lock:
            return self._plan(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all).needed.prefill_peak \
                <= self._available()

    def _rows(self, prompt_len, max_new_tokens, token_ids, keys) -> list[tuple[int, int, list[int] | None, PrefixKeys]]:
        batch = not isinstance(prompt_len, int)
        lengths = list(prompt_len) if batch else [prompt_len]
        count = len(lengths)
        if batch and count == 0:
            raise ValueError("prompt_len must name at least one row")
        news = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * count
        if len(news) != count:
            raise ValueError(f"max_new_tokens has {len(news)} entries for {count} rows")
        if token_ids is None:
            ids_per_row = [None] * count
        elif batch:
            if isinstance(token_ids, torch.Tensor) and token_ids.dim() == 2:
                token_ids = list(token_ids)
            ids_per_row = list(token_ids)
            if len(ids_per_row) != count:
                raise ValueError(f"token_ids has {len(ids_per_row)} rows, prompt_len has {count}")
        else:
            ids_per_row = [token_ids]
        if keys is None or isinstance(keys, PrefixKeys):
            keys_per_row = [keys or PrefixKeys()] * count
        else:
            keys_per_row = list(keys)
            if len(keys_per_row) != count or not all(isinstance(k, PrefixKeys) for k in keys_per_row):
                raise ValueError(f"keys must be a PrefixKeys or a list of {count} PrefixKeys, got {keys!r}")
        rows = []
        for row, (length, new, ids, row_keys) in enumerate(zip(lengths, news, ids_per_row, keys_per_row)):
            where = f"[{row}]" if batch else ""
            _check_int(length, f"prompt_len{where}", 1)
            _check_int(new, f"max_new_tokens{where}", 0)
            if ids is not None:
                ids = as_token_list(ids, f"token_ids{where}")
                if len(ids) != length:
                    raise ValueError(f"token_ids{where} has {len(ids)} ids but prompt_len{where} is {length}")
            rows.append((length, new, ids, row_keys))
        return rows

    def _plan(self, prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all) -> _Plan:
        self.check_config(cfg)
        if keep_all is None:  # the config says: RocketKVConfig(multi_turn="keep_all") keeps the prompt table
            keep_all = getattr(cfg, "multi_turn", "evict") == "keep_all"
        if not isinstance(keep_all, bool):
            raise ValueError(f"keep_all must be True or False, got {keep_all!r}")
        p = self.page_size
        plans = []
        for length, new, ids, row_keys in self._rows(prompt_len, max_new_tokens, token_ids, keys):
            pages = row_pages(length, new, p, cfg.prompt_budget, prefix_reuse=self.prefix_reuse, keep_all=keep_all)
            hashes = page_hashes(self._root, ids, p, row_keys) if self.prefix_reuse and ids is not None else []
            cap_pages = hit_cap_tokens(length, p, cfg.window_size, cfg.prompt_budget) // p
            hits = []
            for page_hash in hashes[:cap_pages]:
                meta = self._index.get(page_hash)
                if meta is None:
                    break
                hits.append(meta)
            plans.append(_RowPlan(length, new, row_keys, pages, hashes, hits))
        free_hits = {m.index for plan in plans for m in plan.hits if m.tier is Tier.DEVICE and m.ref == 0}
        host_hits = list({id(m): m for plan in plans for m in plan.hits if m.tier is Tier.HOST}.values())
        fresh = sum(plan.new_prompt_pages + plan.pages.view_pages for plan in plans)
        hit_pages = sum(len(plan.hits) for plan in plans)
        needed = PagesNeeded(
            prefill_peak=fresh + len(free_hits) + len(host_hits),
            steady_state=sum(plan.pages.steady_pages for plan in plans),
            prompt_pages=sum(plan.pages.prompt_pages for plan in plans),
            view_pages=sum(plan.pages.view_pages for plan in plans),
            hit_pages=hit_pages,
            hit_pages_free=len(free_hits),
            hit_pages_host=len(host_hits),
            hit_tokens=hit_pages * p,
            new_pages=fresh + len(host_hits),
            rows=len(plans),
        )
        return _Plan(plans, needed, host_hits)

    # ============================================================================================ admission
    def admit(self, prompt_len: int, max_new_tokens: int, cfg: "RocketKVConfig", token_ids: Any = None,
              keys: PrefixKeys | None = None, keep_all: bool | None = None) -> Admission:
        """Take every page one request needs (prefix hits first), or raise PoolExhaustedError and change nothing."""
        if not isinstance(prompt_len, int):
            raise ValueError(f"admit: prompt_len must be an integer (admit_batch takes rows), got {prompt_len!r}")
        return self._admit(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all)[0]

    def admit_batch(self, prompt_lens: Sequence[int], max_new_tokens: int | Sequence[int], cfg: "RocketKVConfig",
                    token_ids: Any = None, keys: Any = None, keep_all: bool | None = None,
                    reservation: Reservation | None = None) -> list[Admission]:
        """``admit`` for several rows at once: all rows get their pages, or none does. ``reservation``: pages set
        aside for this admission (they count as free for it; what it takes comes off the reservation)."""
        if isinstance(prompt_lens, int):
            raise ValueError(f"admit_batch: prompt_lens must be a list of row lengths, got {prompt_lens!r}")
        return self._admit(list(prompt_lens), max_new_tokens, cfg, token_ids, keys, keep_all, reservation)

    def _admit(self, prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all, reservation=None) -> list[Admission]:
        args = (prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all, reservation)
        try:
            return self._admit_now(*args)
        except PoolExhaustedError:
            if not self.reclaim_unreachable():
                raise
            return self._admit_now(*args)

    def reclaim_unreachable(self) -> bool:
        """Run Python's cyclic garbage collector once (call it without holding the pool); True if pages came back.

        A cache nobody can reach any more still holds its pages until it is collected, and a reference cycle (one
        made by torch.compile while tracing a cache, or by a user's own objects) delays that until the collector
        happens to run. Before an admission is refused for lack of pages, those pages are worth one collection (a
        refusal is rare, a collection takes milliseconds): the caches' finalizers queue their releases, which the
        next acquisition of the lock applies. ``reserve`` does not collect: a scheduler asks it at every step."""
        before = self.free_pages()
        gc.collect()
        return self.free_pages() > before

    def _admit_now(self, prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all, reservation) -> list[Admission]:
        with self._lock:
            plan = self._plan(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all)
            need = plan.needed.prefill_peak
            available = self._available(reservation)
            if need > available:
                rows = f"{plan.needed.rows} row(s), " if plan.needed.rows > 1 else ""
                raise PoolExhaustedError(
                    f"admitting {rows}{plan.needed.prompt_pages} prompt + {plan.needed.view_pages} view pages "
                    f"({plan.needed.hit_pages} hit)", need, available, self.num_pages)
            admissions = self._admit_planned(plan)
            self._consume(reservation, need)
            return admissions

    def _admit_planned(self, plan: _Plan) -> list[Admission]:
        """Execute a plan that fits: touch device hits, onload host hits, allocate the rest. Nothing here raises
        for lack of pages (the plan was checked against the free count)."""
        self._poll_copies()
        self._clock += 1
        for row in plan.rows:
            for meta in row.hits:
                if meta.tier is Tier.DEVICE:
                    self._touch(meta)
        onloaded = self._onload(plan.host_hits) if plan.host_hits else {}
        admissions = []
        for row in plan.rows:
            hits = []
            for meta in row.hits:
                if meta.tier is Tier.HOST:  # now on the device: this row's reference
                    meta = onloaded[id(meta)]
                    self._touch(meta)
                hits.append(meta)
            prompt_new = self._take_pages(row.new_prompt_pages)
            view_new = self._take_pages(row.pages.view_pages)
            prompt = BlockTable("prompt", max_pages=row.pages.prompt_pages)
            prompt._extend([m.index for m in hits] + [m.index for m in prompt_new])
            view = BlockTable("view", max_pages=row.pages.view_pages)
            view._extend([m.index for m in view_new])
            self._counters["hit_pages"] += len(hits)
            self._counters["missed_pages"] += len(row.hashes) - len(hits)
            admissions.append(Admission(
                prompt=prompt, view=view, prompt_len=row.prompt_len, max_new_tokens=row.max_new_tokens,
                page_size=self.page_size, keys=row.keys, page_hashes=tuple(row.hashes), hit_pages=len(hits),
                onloaded_pages=sum(id(meta) in onloaded for meta in row.hits), committed_pages=len(hits),
            ))
        self._wait_for_copies(meta for row in plan.rows for meta in row.hits if meta.tier is Tier.DEVICE)
        self._wait_for_copies(onloaded.values())
        return admissions

    def _touch(self, meta: PageMeta) -> None:
        """A hit takes a reference; a ref-0 page leaves the free list (it can no longer be evicted). The caller
        makes the current stream wait for the page's pending copy (``_wait_for_copies``)."""
        if meta.index in self._free:
            self._free.remove(meta.index)
        meta.ref += 1
        meta.last_access = self._clock

    # ============================================================================================ low-level pages
    def new_table(self, kind: str, max_pages: int | None = None) -> BlockTable:
        return BlockTable(kind, max_pages)

    def allocate(self, table: BlockTable, num_pages: int) -> None:
        """Append ``num_pages`` fresh pages to ``table`` (ref 1 each), or raise and change nothing."""
        with self._lock:
            _check_int(num_pages, "num_pages", 0)
            if num_pages > self._available():
                raise PoolExhaustedError(f"allocating {num_pages} pages for {table.name}", num_pages,
                                         self._available(), self.num_pages)
            table._check_room(num_pages)
            self._poll_copies()
            self._clock += 1
            table._extend([m.index for m in self._take_pages(num_pages)])

    def register(self, table: BlockTable, hashes: Sequence[bytes], start_page: int = 0,
                 priority: int | None = None) -> int:
        """Give pages ``start_page, start_page+1, ...`` of ``table`` the prefix hashes ``hashes`` (their K/V must be
        written). A hash already indexed on another page leaves this page private. Returns pages newly indexed."""
        with self._lock:
            priority = self.default_priority if priority is None else check_priority(priority, "priority")
            _check_int(start_page, "start_page", 0)
            pages = table.pages
            if start_page + len(hashes) > len(pages):
                raise ValueError(f"{table.name} has {len(pages)} pages; cannot register pages "
                                 f"[{start_page}, {start_page + len(hashes)})")
            self._clock += 1
            return sum(self._register_page(self._device_pages[pages[start_page + i]], h, start_page + i, priority)
                       for i, h in enumerate(hashes))

    def commit_prompt(self, admission: Admission, num_tokens: int | None = None, priority: int | None = None) -> int:
        """Index the admission's full prompt pages among its first ``num_tokens`` tokens (default: the whole
        prompt), once their K/V are written in every layer. Returns pages newly indexed."""
        with self._lock:
            num_tokens = admission.prompt_len if num_tokens is None else num_tokens
            _check_int(num_tokens, "num_tokens", 0)
            if num_tokens > admission.prompt_len:
                raise ValueError(f"num_tokens={num_tokens} exceeds the prompt ({admission.prompt_len} tokens)")
            full = min(num_tokens // self.page_size, len(admission.page_hashes))
            start = admission.committed_pages
            if full <= start:
                return 0
            if len(admission.prompt) < full:
                raise PoolStateError(f"{admission.prompt.name} was released; commit_prompt must come before release")
            added = self.register(admission.prompt, admission.page_hashes[start:full], start, priority)
            admission.committed_pages = full
            return added

    def _register_page(self, meta: PageMeta, page_hash: bytes, depth: int, priority: int) -> int:
        if meta.hash == page_hash:
            return 0
        if meta.hash is not None:
            raise PoolStateError(f"page {meta.index} already holds another prefix page; refusing to re-key it")
        if meta.ref < 1:
            raise PoolStateError(f"page {meta.index} is not held by any table; only held pages can be registered")
        existing = self._index.get(page_hash)
        if existing is not None:
            if existing.tier is Tier.DEVICE or existing.index not in self._host_free:
                return 0  # the same content is already indexed on the device (computed twice): keep this private
            self._host_free.remove(existing.index)  # a device copy replaces the host copy
            existing.forget()
            self._host_free.push_back(UNCACHED, existing.index)
        meta.hash, meta.depth, meta.priority = page_hash, depth, priority
        meta.last_access = self._clock
        self._index[page_hash] = meta
        return 1

    def release(self, obj: BlockTable | Admission) -> None:
        """Drop the references of a table (or both tables of an admission), tail first; the table becomes empty.
        Pages nobody holds become free: hashed ones as cached pages (hittable until evicted)."""
        with self._lock:
            tables = (obj.prompt, obj.view) if isinstance(obj, Admission) else (obj,)
            for table in tables:
                if not isinstance(table, BlockTable):
                    raise ValueError(f"release expects a BlockTable or an Admission, got {type(obj).__name__}")
                self._clock += 1
                self._unref_all(table._truncate(0))

    def exclusive(self):
        """The pool's (re-entrant) lock, as a context manager: a sequence of pool calls no other thread interleaves
        with, e.g. handing a reservation's pages to an admission (``with pool.exclusive(): pool.truncate(...);
        pool.admit_batch(...)``)."""
        return self._lock

    def release_later(self, obj: Any) -> None:
        """Queue a table, an admission, or a list of them for release at the pool's next call. Takes no lock and runs
        no pool code, so it is safe from a garbage-collector finalizer (which may fire inside a pool method)."""
        self._deferred.put(obj)

    def pending_releases(self) -> int:
        """Objects queued by ``release_later`` and not released yet (any locked call releases them first)."""
        return len(self._deferred)

    def _drain_deferred(self) -> None:
        """Called by the lock when a thread takes it from outside: release what finalizers queued."""
        self._deferred.drain(self._release_queued)

    def _release_queued(self, obj: Any) -> None:
        if isinstance(obj, (list, tuple)):
            for item in obj:
                self._release_queued(item)
        elif isinstance(obj, Reservation):
            self.unreserve(obj)
        else:
            self.release(obj)

    def allocate_batch(self, requests: Sequence[tuple[BlockTable, int]], what: str = "allocating pages") -> None:
        """``allocate`` for several tables at once: every table gets its pages, or none does (PoolExhaustedError
        naming the pages needed and free, before anything changes)."""
        with self._lock:
            total = 0
            for table, num_pages in requests:
                _check_int(num_pages, "num_pages", 0)
                table._check_room(num_pages)
                total += num_pages
            if total > self._available():
                raise PoolExhaustedError(what, total, self._available(), self.num_pages)
            self._poll_copies()
            self._clock += 1
            for table, num_pages in requests:
                table._extend([m.index for m in self._take_pages(num_pages)])

    def truncate(self, table: BlockTable, num_pages: int) -> None:
        """Release ``table``'s pages from ``num_pages`` on (tail first): in-place compaction gives its tail back."""
        with self._lock:
            _check_int(num_pages, "num_pages", 0)
            self._clock += 1
            self._unref_all(table._truncate(num_pages))

    def _unref_all(self, pages: list[int]) -> None:
        freed = []
        for index in reversed(pages):  # tail first: deeper pages reach the eviction queues first
            meta = self._device_pages[index]
            if meta.ref <= 0:
                raise PoolStateError(f"page {index} released more often than taken")
            meta.ref -= 1
            meta.last_access = self._clock
            if meta.ref == 0:
                self._push_free(meta)
                freed.append(meta)
        event = self._release_event() if freed else None
        for meta in freed:
            meta.released = event

    def _cuda_device(self) -> torch.device | None:
        """The pool's CUDA device once layers are allocated on a single one (None on CPU or before)."""
        if not self._storage.any_bound:
            return None
        try:
            device = self._storage.device()
        except ValueError:  # layers on several devices: no host copies, so no events are needed
            return None
        return device if device.type == "cuda" else None

    def _release_event(self):
        """An event on the current (compute) stream marking the last use of pages being freed now."""
        device = self._cuda_device()
        if device is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def _push_free(self, meta: PageMeta) -> None:
        if meta.hash is not None:
            self._free.push_back(cached_queue(meta.priority), meta.index)
        elif meta.in_flight:
            self._free.push_back(UNCACHED, meta.index)  # taken last: a copy still uses it
        else:
            self._free.push_front(UNCACHED, meta.index)

    def _take_pages(self, count: int) -> list[PageMeta]:
        """Pop ``count`` pages in allocation order (caller checked ``count <= free``); cached ones are evicted
        (offloaded when they qualify). Each comes back with ref 1."""
        taken, offloads = [], {}
        for _ in range(count):
            index = self._free.next_in_allocation_order()
            self._free.remove(index)
            meta = self._device_pages[index]
            if meta.hash is not None:
                self._evict_page(meta, offloads)
            taken.append(meta)
        if offloads:
            self._start_offload(list(offloads.values()))
        self._wait_for_copies(taken)
        for meta in taken:
            meta.ref = 1
            meta.last_access = self._clock
        return taken

    # ============================================================================================ eviction, offload
    def evict(self, num_pages: int | None = None) -> int:
        """Evict up to ``num_pages`` cached device pages (all when None) in eviction order; with a host tier they
        are offloaded. The free count does not change (cached pages were free already). Returns pages evicted."""
        with self._lock:
            if num_pages is not None:
                _check_int(num_pages, "num_pages", 0)
            self._poll_copies()
            evicted, offloads = [], {}
            while num_pages is None or len(evicted) < num_pages:
                index = self._free.first_cached()
                if index is None:
                    break
                self._free.remove(index)
                meta = self._device_pages[index]
                self._evict_page(meta, offloads)
                evicted.append(meta)
            if offloads:
                self._start_offload(list(offloads.values()))
            for meta in evicted:
                self._push_free(meta)
            return len(evicted)

    def _can_offload(self) -> bool:
        if self._engine is None or not self._storage.all_bound:
            return False
        try:
            self._record_layout()
        except ValueError:  # layers on several devices: pages are dropped instead
            return False
        return True

    def _evict_page(self, meta: PageMeta, offloads: dict[int, tuple[PageMeta, PageMeta]]) -> None:
        """Take a cached device page's hash away; move it to a host slot when it qualifies, else drop it.

        ``offloads`` (host slot -> (device page, slot)) collects one batch of copies, issued together afterwards. A
        later page of the batch may displace an earlier one from its slot before the copy is issued (the earlier
        one is then dropped, never copied), so the host keeps the most recent pages as LRU says it should.
        """
        del self._index[meta.hash]
        self._counters["evictions"] += 1
        slot = None
        if meta.priority >= self.offload_min_priority and self._can_offload():
            slot = self._take_host_slot(meta.priority)
        if slot is None:
            self._counters["dropped_pages"] += 1
            meta.forget()
            return
        if slot.hash is not None:
            del self._index[slot.hash]
            displaced = offloads.pop(slot.index, None)
            self._counters["dropped_pages" if displaced else "host_evictions"] += 1
            slot.forget()
        slot.hash, slot.depth, slot.priority, slot.last_access = meta.hash, meta.depth, meta.priority, meta.last_access
        self._index[slot.hash] = slot
        self._host_free.push_back(cached_queue(slot.priority), slot.index)
        offloads[slot.index] = (meta, slot)
        meta.forget()

    def _take_host_slot(self, priority: int) -> PageMeta | None:
        """An empty host slot, else the host page evicted next if it is worth no more than ``priority``."""
        index = self._host_free.first(UNCACHED)
        if index is None:
            index = self._host_free.first_cached()
            if index is None or self._host_pages[index].priority > priority:
                return None
        self._host_free.remove(index)
        return self._host_pages[index]

    def _start_offload(self, pairs: list[tuple[PageMeta, PageMeta]]) -> None:
        layout = self._record_layout()
        event = self._engine.offload(self._storage, layout, [m.index for m, _ in pairs], [s.index for _, s in pairs],
                                     wait_for=_distinct(m.released for m, _ in pairs))
        for meta, slot in pairs:
            meta.pending = slot.pending = event
        if event is not None:
            self._pending.append((event, [meta for pair in pairs for meta in pair]))
        self._counters["offloaded_bytes"] += len(pairs) * self._page_data_bytes()

    def _onload(self, slots: list[PageMeta]) -> dict[int, PageMeta]:
        """Bring host slots back into fresh device pages; their hashes move
        with them. Returns ``{id(slot meta): device page meta}`` (ref 0, not free: the caller touches them)."""
        for slot in slots:  # reserved: making room on the device must not evict them from the host
            self._host_free.remove(slot.index)
        targets = self._take_pages(len(slots))
        layout = self._record_layout()
        event = self._engine.onload(self._storage, layout, [s.index for s in slots], [m.index for m in targets],
                                    wait_for=_distinct(m.released for m in targets))
        moved = {}
        for slot, meta in zip(slots, targets):
            meta.hash, meta.depth, meta.priority = slot.hash, slot.depth, slot.priority
            meta.ref = 0
            self._index[meta.hash] = meta
            slot.forget()
            meta.pending = slot.pending = event
            self._host_free.push_back(UNCACHED, slot.index)
            moved[id(slot)] = meta
        if event is not None:
            self._pending.append((event, [*slots, *targets]))
        self._counters["onloaded_bytes"] += len(slots) * self._page_data_bytes()
        return moved

    def _wait_for_copies(self, metas) -> None:
        """The current stream, which will use these pages, waits (on the GPU; the host does not block) for every
        copy still pending on them."""
        events = _distinct(meta.pending for meta in metas)
        if events:
            stream = torch.cuda.current_stream(self._storage.device())
            for event in events:
                stream.wait_event(event)

    def _poll_copies(self) -> None:
        """Clear the in-flight mark of pages whose copies have completed (events complete in stream order)."""
        while self._pending and self._pending[0][0].query():
            event, metas = self._pending.popleft()
            for meta in metas:
                if meta.pending is event:
                    meta.pending = None

    def synchronize(self) -> None:
        """Block until every pending copy has completed."""
        with self._lock:
            while self._pending:
                event, metas = self._pending.popleft()
                event.synchronize()
                for meta in metas:
                    if meta.pending is event:
                        meta.pending = None

    def reset(self) -> None:
        """Forget every cached prefix (device and host). Refused while any table holds a page."""
        with self._lock:
            held = sum(meta.ref > 0 for meta in self._device_pages)
            if held:
                raise PoolStateError(f"KVBlockPool.reset: {held} pages are still held by requests; release them first")
            self.synchronize()
            self._index.clear()
            for pages, free in ((self._device_pages, self._free), (self._host_pages, self._host_free)):
                for meta in pages:
                    if meta.index in free:
                        free.remove(meta.index)
                    meta.forget()
                    meta.pending = meta.released = None
                    free.push_back(UNCACHED, meta.index)

    # ============================================================================================ lookups
    def resident_prefix(self, token_ids: Any, keys: PrefixKeys | None = None) -> list[PageInfo]:
        """The longest chain of full pages of ``token_ids`` in the index (device or host), no hit cap; read-only."""
        with self._lock:
            chain = []
            for page_hash in self.hash_pages(token_ids, keys):
                meta = self._index.get(page_hash)
                if meta is None:
                    break
                free = self._free if meta.tier is Tier.DEVICE else self._host_free
                chain.append(PageInfo.of(meta, meta.index in free))
            return chain

    # ============================================================================================ prefix files
    def save_prefix(self, path: str | Path, token_ids: Any, keys: PrefixKeys | None = None) -> int:
        """Write the longest resident chain of full pages of ``token_ids`` to a safetensors file; returns its
        token count. The salt is never written (the loader brings its own)."""
        ids = as_token_list(token_ids)
        with self._lock:
            chain = []
            for page_hash in self.hash_pages(ids, keys):
                meta = self._index.get(page_hash)
                if meta is None:
                    break
                chain.append(meta)
            if not chain:
                raise ValueError(
                    f"save_prefix: no page of these {len(ids)} token ids is resident (the first full page misses)"
                )
            layout = self._record_layout()
            self.synchronize()
            records = torch.empty(len(chain), layout.record_bytes, dtype=torch.uint8)
            device_rows = [row for row, meta in enumerate(chain) if meta.tier is Tier.DEVICE]
            host_rows = [row for row, meta in enumerate(chain) if meta.tier is Tier.HOST]
            if device_rows:
                page_ids = torch.tensor([chain[r].index for r in device_rows], dtype=torch.long,
                                        device=self._storage.device())
                records[device_rows] = self._storage.gather_records(page_ids, layout).cpu()
            if host_rows:
                records[host_rows] = self._engine.read_slots(layout, [chain[r].index for r in host_rows])
        num_tokens = len(chain) * self.page_size
        tensors = {f"layer.{layer}.{name}": t for (layer, name), t in layout.unpack(records).items()}
        tensors["token_ids"] = torch.tensor(ids[:num_tokens], dtype=torch.int64)
        keys = keys or PrefixKeys()
        extra = {"adapter": keys.adapter, "multimodal": [vars(m) for m in keys.multimodal]}
        metadata = {
            "hash_scheme": HASH_SCHEME,
            "model_fingerprint": self.fingerprint,
            "model": json.dumps(self._fingerprint_fields, sort_keys=True),
            "kv_dtype": dtype_name(self.dtype),
            "page_size": str(self.page_size),
            "kt_page_size": str(self.kt_page_size),
            "kt_dtype": dtype_name(self.kt_dtype),
            "scale_granularity": self.scale_granularity,
            "num_layers": str(self.geometry.num_layers),
            "token_count": str(num_tokens),
            "num_pages": str(len(chain)),
            "extra_keys": json.dumps(extra, sort_keys=True),
        }
        write_prefix_file(path, tensors, metadata)
        return num_tokens

    def _check_file_matches(self, path: Path, meta: dict[str, str]) -> None:
        """Named settings first (their messages say exactly what differs), then the whole model fingerprint."""
        if meta.get("hash_scheme") != HASH_SCHEME:
            raise PrefixFileError(f"prefix file {str(path)!r} uses hash scheme {meta.get('hash_scheme')!r}; this "
                                  f"pool uses {HASH_SCHEME!r}")
        expected = {
            "kv_dtype": dtype_name(self.dtype), "page_size": str(self.page_size),
            "kt_page_size": str(self.kt_page_size), "kt_dtype": dtype_name(self.kt_dtype),
            "num_layers": str(self.geometry.num_layers),
        }
        if self.dtype == torch.float8_e4m3fn:
            expected["scale_granularity"] = self.scale_granularity
        for key, value in expected.items():
            if meta.get(key) != value:
                raise PrefixFileError(
                    f"prefix file {str(path)!r} has {key}={meta.get(key)!r}; this pool has {key}={value!r}"
                )
        if meta.get("model_fingerprint") != self.fingerprint:
            raise PrefixFileError(
                f"prefix file {str(path)!r} was saved for another model: fingerprint "
                f"{str(meta.get('model_fingerprint'))[:16]}... ({meta.get('model')}) != this pool's "
                f"{self.fingerprint[:16]}... ({json.dumps(self._fingerprint_fields, sort_keys=True)})"
            )

    def load_prefix(self, path: str | Path, cache_salt: str | None = None, priority: int = LOADED_PREFIX_PRIORITY,
                    device: torch.device | str | None = None) -> LoadedPrefix:
        """Insert a prefix file's pages as cached pages (ref 0, ``priority``), hashed anew from the stored token ids
        under ``cache_salt`` and the file's adapter / multimodal keys (hashes are never read from the file)."""
        path = Path(path)
        check_priority(priority, "priority")
        tensors, meta = read_prefix_file(path)
        self._check_file_matches(path, meta)
        try:
            ids = as_token_list(tensors["token_ids"], "token_ids (in the file)")
            num_pages = int(meta["num_pages"])
            extra = json.loads(meta["extra_keys"])
            keys = PrefixKeys(cache_salt=cache_salt, adapter=extra["adapter"],
                              multimodal=tuple(MultimodalItem(**item) for item in extra["multimodal"]))
        except (KeyError, ValueError, TypeError) as err:
            raise PrefixFileError(f"prefix file {str(path)!r} has malformed contents: {err}") from err
        if len(ids) != num_pages * self.page_size or meta.get("token_count") != str(len(ids)):
            raise PrefixFileError(f"prefix file {str(path)!r}: {len(ids)} token ids for {num_pages} pages of "
                                  f"{self.page_size} (token_count={meta.get('token_count')})")
        with self._lock:
            self._bind_for_file(path, tensors, device)
            layout = self._record_layout()
            try:
                records = layout.pack({(seg.layer, seg.name): tensors[f"layer.{seg.layer}.{seg.name}"]
                                       for seg in layout.segments}, num_pages)
            except (KeyError, ValueError) as err:
                raise PrefixFileError(f"prefix file {str(path)!r} does not match this pool's page layout: {err}") from err
            hashes = self.hash_pages(ids, keys)
            missing = [i for i, h in enumerate(hashes) if h not in self._index]
            if len(missing) > self._available():
                raise PoolExhaustedError(f"loading {str(path)!r}", len(missing), self._available(), self.num_pages)
            self._poll_copies()
            self._clock += 1
            targets = self._take_pages(len(missing))
            if missing:
                device_ = self._storage.device()
                self._storage.scatter_records(torch.tensor([m.index for m in targets], device=device_),
                                              records[missing].to(device_), layout)
            for page, meta in zip(missing, targets):
                self._register_page(meta, hashes[page], page, priority)
            self._unref_all([m.index for m in targets])
        return LoadedPrefix(len(ids), len(missing), len(hashes) - len(missing))

    def _bind_for_file(self, path: Path, tensors: dict[str, torch.Tensor], device) -> None:
        device = device if device is not None else self.device
        model = self._model_ref() if self._model_ref is not None else None
        if device is None and model is not None:
            device = next((t.device for t in model.parameters()), None)
        for layer_idx in range(self.geometry.num_layers):
            if self._storage.is_bound(layer_idx):
                continue
            if device is None:
                raise ValueError(
                    f"load_prefix: layer {layer_idx} has not stored anything yet; pass device= (or build the pool "
                    f"with device=) so its pages can be allocated"
                )
            k = tensors.get(f"layer.{layer_idx}.k")
            if k is None or k.dim() != 4:
                raise PrefixFileError(f"prefix file {str(path)!r} lacks layer.{layer_idx}.k [pages, heads, tokens, dim]")
            self._storage.bind(layer_idx, k.shape[1], k.shape[3], torch.device(device))

    def close(self) -> None:
        """Wait for pending copies and unregister the pinned host buffer (also done when the pool is collected)."""
        with self._lock:
            self.synchronize()
            if self._host is not None:
                self._host.close()
