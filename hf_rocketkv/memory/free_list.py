"""Free pages of one tier in allocation order, with O(1) removal from the middle.

Pages are small integers ``0 .. capacity-1``. Every free page sits in exactly one queue:

    queue 0            ``UNCACHED``: pages that hold nothing reusable (never used, private, evicted); taken first
    queue 1 + p        cached pages (a prefix hash, no request holds them) of priority p (0..100): evicted by
                       lowest priority first, then from the front of the queue

A queue is an intrusive doubly linked list threaded through two shared ``prev``/``next`` arrays (vLLM's free block
queue, generalised to one list per priority as TensorRT-LLM's eviction policy does), so push, pop and removing a
page that a prefix hit takes back are all O(1) and allocate no Python objects. The pool appends cached pages in
release order (tails first), so the front of each priority queue is its least recently used page, deepest first.
"""

from __future__ import annotations

from collections.abc import Iterator

UNCACHED = 0
NUM_PRIORITIES = 101  # priorities 0..100


def cached_queue(priority: int) -> int:
    return 1 + priority


class FreeLists:
    def __init__(self, capacity: int, num_priorities: int = NUM_PRIORITIES):
        self.capacity = capacity
        self.num_queues = 1 + num_priorities
        size = capacity + self.num_queues  # queue q's sentinel is node capacity + q
        self._next = list(range(size))
        self._prev = list(range(size))
        self._queue_of = [-1] * capacity  # -1: not free
        self._counts = [0] * self.num_queues
        self._total = 0

    # ------------------------------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return self._total

    def __contains__(self, page: int) -> bool:
        return self._queue_of[page] >= 0

    def queue_of(self, page: int) -> int:
        """The queue holding ``page`` (-1 when the page is not free)."""
        return self._queue_of[page]

    def count(self, queue: int) -> int:
        return self._counts[queue]

    def iter_queue(self, queue: int) -> Iterator[int]:
        sentinel = self.capacity + queue
        node = self._next[sentinel]
        while node != sentinel:
            yield node
            node = self._next[node]

    def in_allocation_order(self) -> Iterator[int]:
        """Every free page, in the order :meth:`pop_next` would hand them out."""
        for queue in range(self.num_queues):
            yield from self.iter_queue(queue)

    # ------------------------------------------------------------------------------------------ mutation
    def _link_after(self, node: int, page: int) -> None:
        following = self._next[node]
        self._prev[page], self._next[page] = node, following
        self._next[node] = page
        self._prev[following] = page

    def _check_not_free(self, page: int) -> None:
        if self._queue_of[page] >= 0:
            raise RuntimeError(f"page {page} is already free (queue {self._queue_of[page]})")

    def push_back(self, queue: int, page: int) -> None:
        self._check_not_free(page)
        self._link_after(self._prev[self.capacity + queue], page)
        self._queue_of[page] = queue
        self._counts[queue] += 1
        self._total += 1

    def push_front(self, queue: int, page: int) -> None:
        self._check_not_free(page)
        self._link_after(self.capacity + queue, page)
        self._queue_of[page] = queue
        self._counts[queue] += 1
        self._total += 1

    def remove(self, page: int) -> int:
        """Take ``page`` out of its queue (O(1)); returns the queue it was in."""
        queue = self._queue_of[page]
        if queue < 0:
            raise RuntimeError(f"page {page} is not free")
        before, after = self._prev[page], self._next[page]
        self._next[before] = after
        self._prev[after] = before
        self._prev[page] = self._next[page] = page
        self._queue_of[page] = -1
        self._counts[queue] -= 1
        self._total -= 1
        return queue

    def first(self, queue: int) -> int | None:
        node = self._next[self.capacity + queue]
        return None if node == self.capacity + queue else node

    def first_cached(self) -> int | None:
        """The cached page evicted next: lowest priority, then front of its queue."""
        for queue in range(1, self.num_queues):
            if self._counts[queue]:
                return self.first(queue)
        return None

    def next_in_allocation_order(self) -> int | None:
        """Uncached pages first, then :meth:`first_cached` (None when nothing is free)."""
        page = self.first(UNCACHED)
        return page if page is not None else self.first_cached()
