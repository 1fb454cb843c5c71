"""RequestQueue: the bounded FIFO of requests waiting for an engine, with removal by id and closing.

``queue.Queue`` cannot drop an entry from the middle (a waiting request cancelled by its client) nor refuse new
entries while still handing out the admitted ones (a draining stop), so engines use this instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..errors import EngineStopped, Overloaded
from .interface import EngineRequest


class RequestQueue:
    """FIFO of at most ``max_size`` waiting requests. Thread-safe."""

    def __init__(self, max_size: int):
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 1:
            raise ValueError(f"max_queue must be an integer >= 1, got {max_size!r}")
        self.max_size = max_size
        self._items: OrderedDict[str, EngineRequest] = OrderedDict()
        self._closed = False
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, request: EngineRequest) -> None:
        """Append, or raise Overloaded (full) / EngineStopped (closed) / ValueError (duplicate id)."""
        with self._cond:
            if self._closed:
                raise EngineStopped("the engine is stopping or stopped; no new requests are admitted")
            if request.request_id in self._items:
                raise ValueError(f"request id {request.request_id!r} is already waiting")
            if len(self._items) >= self.max_size:
                raise Overloaded(len(self._items), self.max_size)
            self._items[request.request_id] = request
            self._cond.notify()

    def get(self, timeout: float | None = None) -> EngineRequest | None:
        """The oldest request; blocks until one arrives. None when closed and empty, or on timeout."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed, timeout)
            if not self._items:
                return None
            return self._items.popitem(last=False)[1]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a request waits or the queue is closed; True if one waits."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed, timeout)
            return bool(self._items)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Drop a waiting request; returns it, or None if it is not waiting (running, finished or unknown)."""
        with self._cond:
            return self._items.pop(request_id, None)

    def close(self) -> None:
        """Refuse new requests from now on; admitted ones can still be taken (``get``) or removed (``drain``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[EngineRequest]:
        """Remove and return every waiting request (oldest first)."""
        with self._cond:
            items = list(self._items.values())
            self._items.clear()
            return items
