"""HostOffload: eviction of cached device pages, and the host tier they may move to instead of being dropped.

Eviction order is the free lists' (``free_list.py``): lowest priority first, then least recently released, tail
first. An evicted page leaves the prefix index; when a host buffer exists, every layer is allocated on one device and
the page's priority is at least ``offload_min_priority``, its content and hash move to a host slot (an empty one,
else the host page evicted next if it is worth no more), copied on the copy engine's stream (``host_tier.py``,
ordered by ``copy_events.py``). A prefix hit on a host slot brings it back into a fresh device page (``onload``).
A page is in exactly one tier.
"""

from __future__ import annotations

import torch

from .copy_events import distinct
from .core import PageCore
from .errors import check_int
from .free_list import UNCACHED, cached_queue
from .host_tier import CopyEngine, HostBuffer
from .page_meta import PageMeta
from .prefix_index import PrefixIndex


class HostOffload:
    """Evicts cached pages of ``core`` (dropping or offloading them) and onloads host hits; owns the host buffer and
    the copy engine (none when the pool has no host slots)."""

    def __init__(self, core: PageCore, index: PrefixIndex, slot_bytes: int, offload_min_priority: int,
                 transfer_chunk_pages: int = 64):
        self.core = core
        self.index = index
        self.offload_min_priority = offload_min_priority  # cached pages below it are dropped, not offloaded
        self.host: HostBuffer | None = None
        self.engine: CopyEngine | None = None
        if core.host_pages:
            self.host = HostBuffer(len(core.host_pages), slot_bytes)
            self.engine = CopyEngine(self.host, transfer_chunk_pages)

    # ============================================================================================ eviction

    def use_min_priority(self, priority: int) -> None:
        """Cached pages below ``priority`` are dropped instead of offloaded from now on."""
        self.offload_min_priority = priority
    def evict(self, num_pages: int | None = None) -> int:
        """Evict up to ``num_pages`` cached device pages (all when None) in eviction order; returns pages evicted."""
        core = self.core
        with core.lock:
            if num_pages is not None:
                check_int(num_pages, "num_pages", 0)
            core.events.poll()
            evicted = []
            while num_pages is None or len(evicted) < num_pages:
                index = core.free.first_cached()
                if index is None:
                    break
                core.free.remove(index)
                evicted.append(core.device_pages[index])
            self.evict_pages(evicted)
            for meta in evicted:
                core.push_free(meta)
            return len(evicted)

    def evict_pages(self, metas: list[PageMeta]) -> None:
        """Take the hashes away of cached device pages just taken out of the free list, in order; those that qualify
        are copied to host slots, in one batch."""
        offloads: dict[int, tuple[PageMeta, PageMeta]] = {}
        for meta in metas:
            self._evict_page(meta, offloads)
        if offloads:
            self._start_offload(list(offloads.values()))

    def _can_offload(self) -> bool:
        if self.engine is None or not self.core.storage.all_bound:
            return False
        try:
            self.core.record_layout()
        except ValueError:  # layers on several devices: pages are dropped instead
            return False
        return True

    def _evict_page(self, meta: PageMeta, offloads: dict[int, tuple[PageMeta, PageMeta]]) -> None:
        """Take a cached device page's hash away; move it to a host slot when it qualifies, else drop it.

        ``offloads`` (host slot -> (device page, slot)) collects one batch of copies, issued together afterwards. A
        later page of the batch may displace an earlier one from its slot before the copy is issued (the earlier
        one is then dropped, never copied), so the host keeps the most recent pages as LRU says it should.
        """
        core, entries = self.core, self.index.entries
        del entries[meta.hash]
        core.counters["evictions"] += 1
        slot = None
        if meta.priority >= self.offload_min_priority and self._can_offload():
            slot = self._take_host_slot(meta.priority)
        if slot is None:
            core.counters["dropped_pages"] += 1
            meta.forget()
            return
        if slot.hash is not None:
            del entries[slot.hash]
            displaced = offloads.pop(slot.index, None)
            core.counters["dropped_pages" if displaced else "host_evictions"] += 1
            slot.forget()
        slot.take_identity(meta)
        entries[slot.hash] = slot
        core.host_free.push_back(cached_queue(slot.priority), slot.index)
        offloads[slot.index] = (meta, slot)
        meta.forget()

    def _take_host_slot(self, priority: int) -> PageMeta | None:
        """An empty host slot, else the host page evicted next if it is worth no more than ``priority``."""
        host_free = self.core.host_free
        index = host_free.first(UNCACHED)
        if index is None:
            index = host_free.first_cached()
            if index is None or self.core.host_pages[index].priority > priority:
                return None
        host_free.remove(index)
        return self.core.host_pages[index]

    def _start_offload(self, pairs: list[tuple[PageMeta, PageMeta]]) -> None:
        core = self.core
        event = self.engine.offload(core.storage, core.record_layout(), [m.index for m, _ in pairs],
                                    [s.index for _, s in pairs], wait_for=distinct(m.released for m, _ in pairs))
        core.events.add(event, [meta for pair in pairs for meta in pair])
        core.counters["offloaded_bytes"] += len(pairs) * core.page_data_bytes()

    # ============================================================================================ onload
    def onload(self, slots: list[PageMeta]) -> dict[int, PageMeta]:
        """Bring host slots back into fresh device pages; their hashes move with them. Returns
        ``{id(slot meta): device page meta}`` (ref 0, not free: the caller touches them)."""
        core = self.core
        for slot in slots:  # reserved: making room on the device must not evict them from the host
            core.host_free.remove(slot.index)
        targets = core.take_pages(len(slots))
        event = self.engine.onload(core.storage, core.record_layout(), [s.index for s in slots],
                                   [m.index for m in targets], wait_for=distinct(m.released for m in targets))
        moved = {}
        for slot, meta in zip(slots, targets):
            meta.take_identity(slot, core.clock)
            self.index.entries[meta.hash] = meta
            slot.forget()
            core.host_free.push_back(UNCACHED, slot.index)
            moved[id(slot)] = meta
        core.events.add(event, [*slots, *targets])
        core.counters["onloaded_bytes"] += len(slots) * core.page_data_bytes()
        return moved

    def read_slots(self, slots: list[int]) -> torch.Tensor:
        """CPU copies of host slots' records (the caller has waited for their copies)."""
        return self.engine.read_slots(self.core.record_layout(), slots)

    def close(self) -> None:
        """Wait for pending copies and unregister the pinned host buffer."""
        with self.core.lock:
            self.core.events.synchronize()
            if self.host is not None:
                self.host.close()
