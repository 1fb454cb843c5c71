"""Serving metrics: fixed-bucket histograms and counters, snapshotted as ``ManagerMetrics``.

Lives on the manager (no process-global registry); the server renders a snapshot as Prometheus text.

    time_to_first_token_seconds   add_request -> first new token
    tokens_per_second             per request: (completion tokens - 1) / (finished - first token), decode speed
                                  seen by one user (requests with fewer than 2 tokens are not observed)
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from .outputs import FinishReason

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKENS_PER_S_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    """``counts[i]``: observations <= ``bounds[i]`` that exceed ``bounds[i-1]``; ``counts[-1]``: above the last."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, ending with ``(inf, count)`` (Prometheus' shape)."""
        running, out = 0, []
        for bound, n in zip(list(self.bounds) + [float("inf")], self.counts):
            running += n
            out.append((bound, running))
        return out


class Histogram:
    """Thread-safe fixed-bucket histogram."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)
        self._total = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._total += value
            self._count += 1

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(self.bounds, tuple(self._counts), self._total, self._count)


@dataclass(frozen=True)
class ManagerMetrics:
    """A snapshot of the manager. ``free_pages`` / ``total_pages`` are None without a pool; ``free_slots`` /
    ``total_slots`` (sliding-window slots, one per request) None without a pool of a model with sliding layers."""

    running: int
    waiting: int
    max_queue: int
    requests_total: int
    rejected_total: int
    finished: dict[str, int]
    prompt_tokens_total: int
    generation_tokens_total: int
    free_pages: int | None
    total_pages: int | None
    time_to_first_token: HistogramSnapshot
    tokens_per_second: HistogramSnapshot
    alive: bool = True
    free_slots: int | None = None
    total_slots: int | None = None


class MetricsRecorder:
    """The manager's counters and histograms (thread-safe)."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tokens_per_s = Histogram(TOKENS_PER_S_BUCKETS)
        self._lock = threading.Lock()
        self._finished = {reason.value: 0 for reason in FinishReason}
        self._requests = 0
        self._rejected = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self._requests += 1
            self._prompt_tokens += prompt_tokens

    def rejected(self) -> None:
        with self._lock:
            self._rejected += 1

    def finished(self, reason: FinishReason, completion_tokens: int, ttft: float | None,
                 tokens_per_s: float | None) -> None:
        with self._lock:
            self._finished[reason.value] += 1
            self._generation_tokens += completion_tokens
        if ttft is not None:
            self.ttft.observe(ttft)
        if tokens_per_s is not None:
            self.tokens_per_s.observe(tokens_per_s)

    def counters(self) -> dict:
        with self._lock:
            return dict(requests_total=self._requests, rejected_total=self._rejected,
                        finished=dict(self._finished), prompt_tokens_total=self._prompt_tokens,
                        generation_tokens_total=self._generation_tokens)
