"""Continuous batching, the bookkeeping half: which request waits, which is prefilled next, which rows decode.

No model and no tensors here (the engine, batching.py and decode_step.py, does the work); that keeps the policy small and testable
by random request sequences (tests/serving/test_scheduler.py).

    waiting (FIFO, bounded) --admit--> prefill (a few per step) --> decoding rows [0, n) --> finished (row freed)

* Admission asks ``admit(request)`` (the KV block pool's accounting: it reserves the request's pages to completion,
  so a decoding request never runs out of pages; False = not now, try again after a request finishes). The head of
  the queue is admitted first: no request starves behind later, smaller ones.
* At most ``prefills_per_step`` requests are prefilled between two decode steps, so a burst of long prompts never
  stalls the running requests for long.
* Decoding requests occupy rows ``0 .. n-1`` of the batch, packed: when a row finishes, the last row moves into its
  place (``Step.moves``), so a decode step runs on the smallest bucket >= n (``BatchingConfig.buckets``: the batch
  sizes whose decode graphs are captured) and padding rows are only ever at the end.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

Request = TypeVar("Request")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class BatchingConfig:
    """max_running: decoding requests at once (<= the largest bucket). buckets: batch sizes of the decode step, each
    captured once. prefills_per_step: requests prefilled between two decode steps. max_queue: waiting requests
    before ``submit`` refuses (the server answers 429). overlap_decode: launch each decode step before reading the
    previous step's tokens (from those tokens on the device), so the host's per-step work (reading, stop checks,
    events) overlaps the device's next step instead of leaving it idle; False: every step is read before the next
    one is launched (serving/decode_step.py has the details)."""

    max_running: int = 64
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    prefills_per_step: int = 1
    max_queue: int = 256
    overlap_decode: bool = True

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"BatchingConfig.buckets must be increasing positive batch sizes, got {self.buckets}")
        if not 1 <= self.max_running <= self.buckets[-1]:
            raise ValueError(
                f"BatchingConfig.max_running must be in [1, {self.buckets[-1]}] (the largest bucket), "
                f"got {self.max_running}"
            )
        if not isinstance(self.overlap_decode, bool):
            raise ValueError(f"BatchingConfig.overlap_decode must be True or False, got {self.overlap_decode!r}")
        for name in ("prefills_per_step", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchingConfig.{name} must be >= 1, got {getattr(self, name)}")

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket that holds ``rows`` decoding rows."""
        index = bisect.bisect_left(self.buckets, rows)
        if index == len(self.buckets):
            raise ValueError(f"{rows} rows exceed the largest bucket {self.buckets[-1]}")
        return self.buckets[index]


class QueueFull(RuntimeError):
    """``submit`` on a full waiting queue."""


@dataclass
class Step(Generic[Request]):
    """One engine iteration: requests to prefill now, then one decode step over rows ``[0, len(decode))``.

    ``moves`` (from_row, to_row) were applied to the rows since the last step (a finished row filled by the last
    one): the executor moves its per-row state the same way before decoding. ``bucket``: the decode batch size."""

    prefill: list[Request] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)
    bucket: int = 0


class Scheduler(Generic[Request]):
    """FIFO admission, bounded prefills per step, packed decoding rows. ``key(request)`` names a request."""

    def __init__(self, config: BatchingConfig, admit: Callable[[Request], bool], key: Callable[[Request], Hashable]):
        self.config = config
        self.admit = admit
        self.key = key
        self.waiting: deque[Request] = deque()
        self.rows: list[Request] = []  # decoding, row i = rows[i]
        self.prefilling: list[Request] = []  # admitted, prefill pending (next step)
        self._moves: list[tuple[int, int]] = []

    # ----------------------------------------------------------------------------------------------- intake
    def submit(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_queue={self.config.max_queue})")
        self.waiting.append(request)

    def cancel_waiting(self, request_key: Hashable) -> Request | None:
        """Drop a request that was not admitted yet; returns it (None if it is not waiting)."""
        for request in self.waiting:
            if self.key(request) == request_key:
                self.waiting.remove(request)
                return request
        return None

    # ----------------------------------------------------------------------------------------------- steps
    def next_step(self) -> Step[Request]:
        """Admit from the head of the queue (while rows and pages allow), then plan this iteration."""
        room = self.config.max_running - len(self.rows) - len(self.prefilling)
        while self.waiting and room > 0 and len(self.prefilling) < self.config.prefills_per_step:
            if not self.admit(self.waiting[0]):
                break  # the head does not fit yet: nobody overtakes it
            self.prefilling.append(self.waiting.popleft())
            room -= 1
        prefill, self.prefilling = self.prefilling, []
        moves, self._moves = self._moves, []
        return Step(prefill=prefill, decode=list(self.rows), moves=moves,
                    bucket=self.config.bucket_for(len(self.rows)) if self.rows else 0)

    def prefilled(self, request: Request) -> int:
        """A prefilled request joins the decoding rows; returns its row."""
        self.rows.append(request)
        return len(self.rows) - 1

    def finish(self, request: Request) -> None:
        """A decoding request ended (stop, length, cancel, error): its row is freed and the last row moves into it."""
        row = self.rows.index(request)
        last = len(self.rows) - 1
        if row != last:
            self.rows[row] = self.rows[last]
            self._moves.append((last, row))
        self.rows.pop()

    def take_moves(self) -> list[tuple[int, int]]:
        """The row moves recorded since the last step (or the last call), oldest first; the next ``Step`` will not
        carry them. An executor that packs its rows as soon as a request finishes applies them right away."""
        moves, self._moves = self._moves, []
        return moves

    @property
    def running(self) -> int:
        return len(self.rows) + len(self.prefilling)

    def idle(self) -> bool:
        return not (self.waiting or self.rows or self.prefilling)
