"""OutputChannel: hands one request's outputs from the engine thread to one consumer, sync or asyncio.

The producer (engine thread, or whoever cancels) calls ``push``; a thread consumer blocks in ``get``; an asyncio
consumer awaits ``aget``, woken through ``loop.call_soon_threadsafe`` (the event loop is never touched from another
thread directly).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class OutputChannel(Generic[T]):
    """Unbounded FIFO with one consumer (the engine must never block on a slow client)."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def push(self, item: T) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is waiting any more
                pass

    def get(self, timeout: float | None = None) -> T:
        """The next item; raises TimeoutError after ``timeout`` seconds without one."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"no output within {timeout} s")
            return self._items.popleft()

    async def aget(self) -> T:
        """The next item, awaited on the running event loop."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                event = asyncio.Event()
                self._waiters.append((loop, event))
            await event.wait()
