"""PageCore: the exact bookkeeping of one pool's pages, and nothing else.

It holds the metadata of every device page and host slot (``PageMeta``: reference count, prefix hash, priority,
last access, copies in flight), the free lists of both tiers in allocation / eviction order (``free_list.py``),
the count of free pages set aside by reservations, the pool's logical clock and traffic counters, the re-entrant
lock every pool operation holds, and the releases that garbage-collector finalizers queued (``deferred.py``).

Taking and giving back pages happens here: ``take_pages`` pops pages in allocation order (a cached page it pops is
handed to the eviction hook first, which offload sets), ``touch`` takes a reference on a prefix hit, ``unref_all``
drops references tail first. Block tables are changed only here and by the planner, under the lock.

Invariants (tested): free + held == total pages; a page is in a free list iff its reference count is 0; its
reference count equals the number of block tables holding it; the reserved count never exceeds the free pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .admission import Admission
from .block_table import BlockTable
from .copy_events import CopyEvents
from .deferred import DeferredReleases, DrainingLock, weakly_bound
from .errors import PoolExhaustedError, PoolStateError, check_int
from .free_list import UNCACHED, FreeLists, cached_queue
from .layout import RecordLayout
from .page_meta import PageInfo, PageMeta, Tier
from .reservation import Reservation
from .sliding_slab import SlidingSlab, SlotLease
from .stats import PoolStats
from .storage import PageStorage

COUNTERS = ("hit_pages", "missed_pages", "evictions", "dropped_pages", "host_evictions", "offloaded_bytes",
            "onloaded_bytes")


class PageCore:
    """Page metadata, free lists and reference counts of ``num_pages`` device pages and ``num_slots`` host slots."""

    def __init__(self, storage: PageStorage, num_slots: int = 0, slab: SlidingSlab | None = None):
        self.storage = storage
        self.slab = slab  # the sliding layers' ring slots (hybrid models), counted here like pages
        self.num_pages = storage.num_pages
        self.device_pages = [PageMeta(i, Tier.DEVICE) for i in range(self.num_pages)]
        self.free = FreeLists(self.num_pages)
        self.host_pages = [PageMeta(i, Tier.HOST) for i in range(num_slots)]
        self.host_free = FreeLists(num_slots)
        for pages, free in ((self.device_pages, self.free), (self.host_pages, self.host_free)):
            for meta in pages:
                free.push_back(UNCACHED, meta.index)
        self.events = CopyEvents(storage)
        self.clock = 0  # logical time of the last take / release (``PageMeta.last_access``)
        self.token = object()  # names this pool in the tables holding its pages (BlockTable.check_owner)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.reserved = 0  # pages set aside by reservations (counted, not held)
        # cached pages that take_pages pops lose their prefix identity here first (set by offload, weakly bound)
        self.evict_hook: Callable[[list[PageMeta]], None] | None = None
        self._layout: RecordLayout | None = None
        self.deferred = DeferredReleases()
        # releases queued by finalizers happen at the next call; weakly bound: no reference cycle, so a dropped pool
        # frees its pages at once (not at the next full garbage collection)
        self.lock = DrainingLock(weakly_bound(self._drain_deferred))

    # ============================================================================================ occupancy
    def available(self, reservation: Reservation | None = None) -> int:
        """Free pages an allocation may take: all free ones less the reserved, plus its own reservation's."""
        return len(self.free) - self.reserved + (reservation.count if reservation is not None else 0)

    def cached_count(self) -> int:
        return len(self.free) - self.free.count(UNCACHED)

    def stats(self) -> PoolStats:
        self.events.poll()
        return PoolStats(
            total_pages=self.num_pages,
            free_pages=self.available(),
            cached_pages=self.cached_count(),
            used_pages=self.num_pages - len(self.free),
            in_flight_pages=sum(meta.in_flight for meta in self.device_pages),
            host_slots=len(self.host_pages),
            host_cached=len(self.host_free) - self.host_free.count(UNCACHED),
            **self.counters,
            total_slots=self.slab.num_slots if self.slab is not None else 0,
            free_slots=self.slab.available() if self.slab is not None else 0,
        )

    def tier(self, tier: str) -> tuple[list[PageMeta], FreeLists]:
        if tier == Tier.DEVICE.value:
            return self.device_pages, self.free
        if tier == Tier.HOST.value:
            return self.host_pages, self.host_free
        raise ValueError(f"tier must be 'device' or 'host', got {tier!r}")

    def free_of(self, meta: PageMeta) -> FreeLists:
        return self.free if meta.tier is Tier.DEVICE else self.host_free

    def page_info(self, index: int, tier: str = "device") -> PageInfo:
        pages, free = self.tier(tier)
        if not isinstance(index, int) or not 0 <= index < len(pages):
            raise ValueError(f"page index must be in [0, {len(pages)}) for tier {tier!r}, got {index!r}")
        return PageInfo.of(pages[index], index in free)

    def record_layout(self) -> RecordLayout:
        """The byte layout of a page record (every layer's tensors), once every layer is allocated on one device."""
        if self._layout is None:
            self._layout = self.storage.record_layout()
        return self._layout

    def page_data_bytes(self) -> int:
        return sum(shape.bytes_per_page() for shape in self.record_layout().layer_shapes)

    # ============================================================================================ reservations
    def set_aside(self, reservation: Reservation, num_pages: int, slots: int = 0) -> None:
        reservation.grow(num_pages, slots)
        self.reserved += num_pages
        if slots:
            self.slab.set_aside(slots)

    def give_back(self, reservation: Reservation, num_pages: int, slots: int = 0) -> None:
        reservation.shrink(num_pages, slots)
        self.reserved -= num_pages
        if slots:
            self.slab.set_aside(-slots)

    def on_evict(self, hook: Callable[[list[PageMeta]], None]) -> None:
        """``hook(pages)`` runs on the cached pages that ``take_pages`` is about to reuse (their hashes must go)."""
        self.evict_hook = hook

    def tick(self) -> None:
        """The pool's logical clock advances (an allocation, a release, a hit: what ``last_access`` orders)."""
        self.clock += 1

    # ============================================================================================ taking pages
    def take_pages(self, count: int) -> list[PageMeta]:
        """Pop ``count`` pages in allocation order (the caller checked ``count <= free``); cached ones go through the
        eviction hook (their hashes leave the index; offloaded when they qualify). Each comes back with ref 1."""
        taken = []
        for _ in range(count):
            index = self.free.next_in_allocation_order()
            self.free.remove(index)
            taken.append(self.device_pages[index])
        cached = [meta for meta in taken if meta.hash is not None]
        if cached:
            self.evict_hook(cached)
        self.events.wait_for(taken)
        for meta in taken:  # free pages are held by no table
            meta.take(self.clock)
        return taken

    def touch(self, meta: PageMeta) -> None:
        """A hit takes a reference; a ref-0 page leaves the free list (it can no longer be evicted). The caller
        makes the current stream wait for the page's pending copy (``events.wait_for``)."""
        if meta.index in self.free:
            self.free.remove(meta.index)
        meta.take(self.clock)

    def allocate(self, table: BlockTable, num_pages: int) -> None:
        """Append ``num_pages`` fresh pages to ``table`` (ref 1 each), or raise and change nothing."""
        with self.lock:
            check_int(num_pages, "num_pages", 0)
            if num_pages > self.available():
                raise PoolExhaustedError(f"allocating {num_pages} pages for {table.name}", num_pages,
                                         self.available(), self.num_pages)
            table.check_room(num_pages)
            table.check_owner(self.token)
            self.events.poll()
            self.clock += 1
            table.extend([m.index for m in self.take_pages(num_pages)], self.token)

    def allocate_batch(self, requests: Sequence[tuple[BlockTable, int]], what: str = "allocating pages") -> None:
        """``allocate`` for several tables at once: every table gets its pages, or none does (PoolExhaustedError
        naming the pages needed and free, before anything changes)."""
        with self.lock:
            total = 0
            for table, num_pages in requests:
                check_int(num_pages, "num_pages", 0)
                table.check_room(num_pages)
                table.check_owner(self.token)
                total += num_pages
            if total > self.available():
                raise PoolExhaustedError(what, total, self.available(), self.num_pages)
            self.events.poll()
            self.clock += 1
            for table, num_pages in requests:
                table.extend([m.index for m in self.take_pages(num_pages)], self.token)

    # ============================================================================================ giving pages back
    def release(self, obj: BlockTable | Admission | SlotLease) -> None:
        """Drop the references of a table (or both tables of an admission, and its sliding slot), tail first; the
        table becomes empty. A ``SlotLease`` goes back to the slab (once)."""
        with self.lock:
            if isinstance(obj, SlotLease):
                self.slab.release(obj)
                return
            tables = (obj.prompt, obj.view) if isinstance(obj, Admission) else (obj,)
            for table in tables:  # every check before anything changes
                if not isinstance(table, BlockTable):
                    raise ValueError(f"release expects a BlockTable or an Admission, got {type(obj).__name__}")
                table.check_owner(self.token)
            if isinstance(obj, Admission) and obj.slot is not None:
                self.slab.release(obj.slot)
            for table in tables:
                self.clock += 1
                self.unref_all(table.truncate(0))

    def truncate(self, table: BlockTable, num_pages: int) -> None:
        """Release ``table``'s pages from ``num_pages`` on (tail first)."""
        with self.lock:
            check_int(num_pages, "num_pages", 0)
            table.check_owner(self.token)
            self.clock += 1
            self.unref_all(table.truncate(num_pages))

    def unref_all(self, pages: list[int]) -> None:
        freed = []
        for index in reversed(pages):  # tail first: deeper pages reach the eviction queues first
            meta = self.device_pages[index]
            if meta.ref <= 0:
                raise PoolStateError(f"page {index} released more often than taken")
            if meta.drop(self.clock):
                self.push_free(meta)
                freed.append(meta)
        event = self.events.release_event() if freed else None
        for meta in freed:
            meta.mark_freed(event)

    def push_free(self, meta: PageMeta) -> None:
        if meta.hash is not None:
            self.free.push_back(cached_queue(meta.priority), meta.index)
        elif meta.in_flight:
            self.free.push_back(UNCACHED, meta.index)  # taken last: a copy still uses it
        else:
            self.free.push_front(UNCACHED, meta.index)

    # ============================================================================================ deferred releases
    def release_later(self, obj: Any) -> None:
        """Queue a table, an admission, a reservation or a list of them for release at the next locked call. Takes
        no lock and runs no pool code, so it is safe from a garbage-collector finalizer."""
        self.deferred.put(obj)

    def _drain_deferred(self) -> None:
        """Called by the lock when a thread takes it from outside: release what finalizers queued."""
        self.deferred.drain(self._release_queued)

    def _release_queued(self, obj: Any) -> None:
        if isinstance(obj, (list, tuple)):
            for item in obj:
                self._release_queued(item)
        elif isinstance(obj, Reservation):
            self.give_back(obj, obj.count, obj.slots)
        else:
            self.release(obj)
