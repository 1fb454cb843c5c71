"""The batching engine's event sink for the serving benchmarks: when each request was submitted, when each of its
tokens arrived, and its final event (benchmarks.batching_throughput, benchmarks.tp_serving_throughput,
benchmarks.decode_under_arrivals).

Waiters are woken on every event (``wake_on_tokens=True``: a benchmark that waits for tokens to arrive) or only when
a request finishes (the default: a benchmark that waits for requests to end, whose waiting thread then never competes
with the engine's thread while tokens stream).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenRecorder:
    """Per request (by ``request_id``): ``submitted`` time, ``token_times`` (one arrival time per token, an event of
    n tokens gives n equal times) and the final event in ``finals``. Times come from ``clock`` (perf_counter)."""

    def __init__(self, wake_on_tokens: bool = False, clock: Callable[[], float] = time.perf_counter):
        self.cond = threading.Condition()
        self.wake_on_tokens = wake_on_tokens
        self.clock = clock
        self.submitted: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}
        self.finals: dict[str, object] = {}

    def __call__(self, event) -> None:
        now = self.clock()
        with self.cond:
            if event.token_ids:
                self.token_times.setdefault(event.request_id, []).extend([now] * len(event.token_ids))
            final = event.finish_reason is not None
            if final:
                self.finals[event.request_id] = event
            if final or self.wake_on_tokens:
                self.cond.notify_all()

    def submit(self, engine, request) -> None:
        """Record the submit time, then submit ``request`` to ``engine``."""
        with self.cond:
            self.submitted[request.request_id] = self.clock()
        engine.submit(request)

    def wait(self, count: int, timeout: float) -> bool:
        """Until ``count`` requests have finished (True), or ``timeout`` seconds (False)."""
        return self.wait_for(lambda recorder: len(recorder.finals) >= count, timeout)

    def wait_for(self, predicate: Callable[[TokenRecorder], bool], timeout: float) -> bool:
        """Until ``predicate(self)`` holds (checked on each wake-up, see the module docstring), or ``timeout``."""
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout)

    def gaps_overlapping(self, rid: str, start: float, end: float) -> list[float]:
        """``rid``'s inter-token gaps that overlap [start, end] (among the tokens arrived so far): a gap that began
        before the window or ended after it counts, since the gap that spans a stall is the one users wait through,
        and a window shorter than a decode step still holds the gap around it once a token after ``end`` is in."""
        with self.cond:
            stamps = list(self.token_times.get(rid, []))
        return [b - a for a, b in zip(stamps, stamps[1:]) if b > start and a < end]

    def window(self, rid: str, start: float, end: float) -> list[float]:
        """Arrival times of ``rid``'s tokens within [start, end]."""
        with self.cond:
            return [t for t in self.token_times.get(rid, []) if start <= t <= end]
