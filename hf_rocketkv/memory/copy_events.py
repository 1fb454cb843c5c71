"""CopyEvents: the pool's host copies in flight and the CUDA events that order pages between streams.

Copies between device pages and host slots run on the copy engine's stream (``host_tier.py``). Each batch of copies
ends with an event; every physical page and slot it touches keeps that event in ``PageMeta.pending`` until it
completes, so no page or slot is reused while a copy still reads or writes it. The other direction: when a page
becomes free, an event recorded on the current (compute) stream marks its last use (``PageMeta.released``); a copy
out of or into that page waits for it, not for the whole compute stream, so copies overlap compute. Without CUDA
(or with layers on several devices, where no copies happen) there are no events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from .page_meta import PageMeta
from .storage import PageStorage


def distinct(events: Iterable[Any]) -> list:
    """The distinct non-None events, in first-seen order."""
    return list({id(event): event for event in events if event is not None}.values())


class CopyEvents:
    """The copies not known to be complete: ``(event, pages and slots it touches)`` in issue order."""

    def __init__(self, storage: PageStorage):
        self.storage = storage
        self.pending: deque[tuple[Any, list[PageMeta]]] = deque()

    def add(self, event: Any, metas: list[PageMeta]) -> None:
        """Mark ``metas`` in flight until ``event`` completes (None: the copy was synchronous)."""
        for meta in metas:
            meta.copying(event)
        if event is not None:
            self.pending.append((event, metas))

    def poll(self) -> None:
        """Clear the in-flight mark of pages whose copies have completed (events complete in stream order)."""
        while self.pending and self.pending[0][0].query():
            event, metas = self.pending.popleft()
            for meta in metas:
                meta.copied(event)

    def synchronize(self) -> None:
        """Block until every pending copy has completed."""
        while self.pending:
            event, metas = self.pending.popleft()
            event.synchronize()
            for meta in metas:
                meta.copied(event)

    def wait_for(self, metas: Iterable[PageMeta]) -> None:
        """The current stream, which will use these pages, waits (on the GPU; the host does not block) for every
        copy still pending on them."""
        events = distinct(meta.pending for meta in metas)
        if events:
            stream = torch.cuda.current_stream(self.storage.device())
            for event in events:
                stream.wait_event(event)

    def release_event(self) -> Any:
        """An event on the current (compute) stream marking the last use of pages being freed now (None without
        CUDA)."""
        device = self._cuda_device()
        if device is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def _cuda_device(self) -> torch.device | None:
        """The pool's CUDA device once layers are allocated on a single one (None on CPU or before)."""
        if not self.storage.any_bound:
            return None
        try:
            device = self.storage.device()
        except ValueError:  # layers on several devices: no host copies, so no events are needed
            return None
        return device if device.type == "cuda" else None
