"""Reservation: free pages set aside for one consumer, counted, not held.

A row-group prefill (``RocketKVConfig.prefill_batch_size``) admits its groups one after the other, yet must know at
the start that every group will fit, and no other request may take the room meanwhile. Holding real pages for that
would evict cached prefix pages the later groups could reuse; a reservation only lowers what other allocations see
as free (``KVBlockPool.free_pages()``): cached pages stay cached and hittable. An admission or allocation that names
the reservation may use its pages, and what it takes comes off the reservation.
"""

from __future__ import annotations

import itertools

_ids = itertools.count()


class Reservation:
    """``count`` pages (and ``slots`` sliding-window slots, hybrid models) set aside in one pool (changed only by the
    pool, under its lock)."""

    def __init__(self, count: int, slots: int = 0):
        self.count = count
        self.slots = slots
        self.name = f"reservation-{next(_ids)}"

    def grow(self, num_pages: int, slots: int = 0) -> None:
        """``num_pages`` more pages (and ``slots`` more slots) set aside."""
        self.count += num_pages
        self.slots += slots

    def shrink(self, num_pages: int, slots: int = 0) -> None:
        """``num_pages`` pages (and ``slots`` slots) fewer set aside."""
        self.count -= num_pages
        self.slots -= slots

    def __repr__(self) -> str:
        slots = f", slots={self.slots}" if self.slots else ""
        return f"Reservation({self.name}, pages={self.count}{slots})"
