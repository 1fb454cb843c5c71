"""PoolStats: a snapshot of a KVBlockPool's occupancy and traffic counters."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class PoolStats:
    """Occupancy (now) and counters (since the pool was made).

    total_pages       device pages
    free_pages        pages an allocation can take: never used, private ones released, and cached ones
    cached_pages      of the free pages, those holding a prefix (hittable until evicted)
    used_pages        pages held by at least one block table
    in_flight_pages   device pages with a copy still pending
    host_slots        host slots (0 without host offload)
    host_cached       host slots holding an offloaded prefix page
    hit_pages         prompt pages served from the prefix index (device or host)
    missed_pages      full prompt pages looked up and not found (computed instead)
    evictions         cached device pages evicted (offloaded to host or dropped)
    dropped_pages     of those, pages dropped (no host tier, below the offload priority, or no host slot)
    host_evictions    host slots whose page was dropped to make room
    offloaded_bytes   bytes copied device -> host (pages x bytes per page)
    onloaded_bytes    bytes copied host -> device
    total_slots       sliding-window ring slots (a model with sliding layers; 0 otherwise)
    free_slots        of those, slots an admission can take (free less reserved)
    """

    total_pages: int
    free_pages: int
    cached_pages: int
    used_pages: int
    in_flight_pages: int
    host_slots: int
    host_cached: int
    hit_pages: int
    missed_pages: int
    evictions: int
    dropped_pages: int
    host_evictions: int
    offloaded_bytes: int
    onloaded_bytes: int
    total_slots: int = 0
    free_slots: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
