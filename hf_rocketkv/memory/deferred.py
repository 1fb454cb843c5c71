"""Releases queued from places that must not run pool code (garbage-collector finalizers), and the pool's lock that
processes them.

A finalizer can run at any allocation, including inside a pool method on the same thread while the pool's
re-entrant lock is held and its free lists are half updated; releasing pages there would corrupt them. So a
finalizer only appends to ``DeferredReleases`` (``deque.append`` is atomic, takes no lock), and ``DrainingLock``,
the pool's lock, hands the queue to the pool each time a thread takes the lock from outside (not re-entrantly), i.e.
at the start of the pool's next public call, when no pool operation is in progress.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Callable


class DeferredReleases:
    """A queue of objects (block tables, admissions) whose pages go back at the pool's next call."""

    def __init__(self) -> None:
        self._queue: deque[Any] = deque()

    def put(self, obj: Any) -> None:
        self._queue.append(obj)  # atomic in CPython: safe from a finalizer, another thread, or inside the lock

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self, release: Callable[[Any], None]) -> int:
        """Hand every queued object to ``release`` (objects queued meanwhile included); returns how many."""
        count = 0
        while True:
            try:
                obj = self._queue.popleft()
            except IndexError:
                return count
            release(obj)
            count += 1


def weakly_bound(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` (a bound method) as a callable that does not keep its object alive: a no-op once the object is
    gone. An object that stores its own bound method (the pool's lock calling ``PageCore._drain_deferred``), or a
    method of an object that holds it (the core's eviction hook into offload), would otherwise be a reference cycle,
    freed only by the cyclic garbage collector: a dropped pool would keep its device pages until the next full
    collection."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class DrainingLock:
    """A re-entrant lock that calls ``on_outer_acquire`` whenever a thread takes it from outside.

    The depth counter is only touched by the thread holding the lock, so it needs no lock of its own.
    """

    def __init__(self, on_outer_acquire: Callable[[], None]) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._on_outer_acquire = on_outer_acquire

    def __enter__(self) -> "DrainingLock":
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1:
            try:
                self._on_outer_acquire()
            except BaseException:
                self._depth -= 1
                self._lock.release()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        self._lock.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Plain acquire (tests and callers that cannot use ``with``); drains like ``__enter__``."""
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        if self._depth == 1:
            self._on_outer_acquire()
        return True

    def release(self) -> None:
        self._depth -= 1
        self._lock.release()
