"""Continuous batching, the bookkeeping half: which request waits, which is prefilled next and by how many tokens,
which rows decode.

No model and no tensors here (the engine, batching.py and decode_step.py, does the work); that keeps the policy small and testable
by random request sequences (tests/serving/test_scheduler.py).

    waiting (FIFO, bounded) --admit--> prefilling (chunk by chunk) --> decoding rows [0, n) --> finished (row freed)

* Admission asks ``admit(request)`` (the KV block pool's accounting: it reserves the request's pages to completion,
  so a decoding request never runs out of pages; False = not now, try again after a request finishes). The head of
  the queue is admitted first: no request starves behind later, smaller ones.
* Chunked prefill by a token budget: each step plans prefill chunks of at most ``prefill_chunk_tokens`` prompt tokens
  for the requests being prefilled (at most ``prefills_per_step`` of them at once, in admission order). While rows
  decode, each step earns ``prefill_token_budget`` tokens of credit and a chunk runs once its tokens are earned, so a
  long prompt is prefilled a chunk at a time between decode steps and never stalls the running requests for longer
  than one chunk. Without decoding rows one chunk runs per step, unthrottled.
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
# prompts up to 8k in one forward: the throughput of one-forward prefill (docs/engine.md)
DEFAULT_PREFILL_CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class BatchingConfig:
    """max_running: decoding requests at once (<= the largest bucket). buckets: batch sizes of the decode step, each
    captured once. prefills_per_step: requests being prefilled at once (each gets its chunks in admission order; a
    new one is admitted when one has its last chunk in). max_queue: waiting requests before ``submit`` refuses (the
    server answers 429). overlap_decode: launch each decode step before reading the previous step's tokens (from
    those tokens on the device), so the host's per-step work (reading, stop checks, events) overlaps the device's
    next step instead of leaving it idle; False: every step is read before the next one is launched
    (serving/batching/decode_step.py has the details).

    prefill_chunk_tokens: the most prompt tokens in one prefill forward; a longer prompt is prefilled in chunks of
    this size over several steps, and its stage 1 runs once its last chunk is in. prefill_token_budget: prompt
    tokens prefilled per decode step while requests decode: each step earns this many tokens of credit (kept up to
    ``max(prefill_chunk_tokens, prefill_token_budget)``), and a chunk runs once its tokens are earned. Equal to the
    chunk (the default), one chunk runs per decode step; a quarter of it, one chunk every fourth step (the decoding
    rows slowed less, a long prompt's first token later); twice it, two chunks per step.

    concurrent_prefill_tokens: None (default): prefill chunks run on the engine thread between decode steps, as
    above. An int: prompts are prefilled beside the decode steps instead, on a thread and a CUDA stream of their own
    (the decode steps on a stream of the highest priority), in chunks of this many tokens while rows decode
    (``prefill_chunk_tokens`` while none does), so the running requests never wait for a chunk's forward
    (serving/batching/prefill_worker.py; 512 on an H100 at Llama-3.1-8B shapes: docs/engine.md). The scheduler's credit
    still decides admissions; the chunks themselves run back to back.

    packed_steps: False (default): a decode forward, then the step's chunks in forwards of their own. True: the first
    chunk of a step rides in the decode step's forward (one packed row: ``cache/packed_step.py``), so the weights are
    read once for both; eager, not beside a prefill thread, under lockstep or on Llama 4 (those alternate). Measured
    on an H200 it does not pay yet (docs/engine.md)."""

    max_running: int = 64
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    prefills_per_step: int = 1
    max_queue: int = 256
    overlap_decode: bool = True
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    prefill_token_budget: int = DEFAULT_PREFILL_CHUNK_TOKENS
    concurrent_prefill_tokens: int | None = None
    packed_steps: bool = False

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"BatchingConfig.buckets must be increasing positive batch sizes, got {self.buckets}")
        if not 1 <= self.max_running <= self.buckets[-1]:
            raise ValueError(
                f"BatchingConfig.max_running must be in [1, {self.buckets[-1]}] (the largest bucket), "
                f"got {self.max_running}"
            )
        for name in ("overlap_decode", "packed_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BatchingConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("prefills_per_step", "max_queue", "prefill_chunk_tokens", "prefill_token_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BatchingConfig.{name} must be an integer >= 1, got {value!r}")
        value = self.concurrent_prefill_tokens
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"BatchingConfig.concurrent_prefill_tokens must be None or an integer >= 1, got {value!r}")

    @property
    def prefill_credit_cap(self) -> int:
        """The most prefill credit a step can hold (one chunk, or one step's budget if that is more)."""
        return max(self.prefill_chunk_tokens, self.prefill_token_budget)

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
    """One engine iteration: one decode step over rows ``[0, len(decode))``, then the prefill chunks.

    ``prefill``: ``(request, tokens)`` pairs in order, the next ``tokens`` prompt tokens of that request (a request
    may appear more than once when the budget allows). ``moves`` (from_row, to_row) were applied to the rows since
    the last step (a finished row filled by the last one): the executor moves its per-row state the same way before
    decoding. ``bucket``: the decode batch size."""

    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)
    bucket: int = 0


class Scheduler(Generic[Request]):
    """FIFO admission, prefill chunks by a token budget, packed decoding rows. ``key(request)`` names a request;
    ``prompt_left(request)`` says how many of its prompt tokens are still to prefill (the executor advances it as
    chunks run; a prefix hit found at the first chunk may shorten it); default: every request's prefill is one
    token."""

    def __init__(self, config: BatchingConfig, admit: Callable[[Request], bool], key: Callable[[Request], Hashable],
                 prompt_left: Callable[[Request], int] | None = None):
        self.config = config
        self.admit = admit
        self.key = key
        self.prompt_left = prompt_left if prompt_left is not None else (lambda request: 1)
        self.waiting: deque[Request] = deque()
        self.rows: list[Request] = []  # decoding, row i = rows[i]
        self.prefilling: list[Request] = []  # admitted, prefill not finished (in admission order)
        self.credit = config.prefill_credit_cap  # prefill tokens the next step may spend (module docstring)
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
        """Plan this iteration: the prefill credit it may spend, the chunks of the requests being prefilled, then
        admissions from the head of the queue (while rows, pages and credit allow)."""
        config = self.config
        cap = config.prefill_credit_cap
        self.credit = min(self.credit + config.prefill_token_budget, cap) if self.rows else cap
        chunks: list[tuple[Request, int]] = []
        blocked = not self._plan_chunks(self.prefilling, chunks)
        room = config.max_running - len(self.rows) - len(self.prefilling)
        while (not blocked and self.waiting and room > 0 and len(self.prefilling) < config.prefills_per_step
               and self._first_chunk(self.waiting[0]) <= self.credit):
            if not self.admit(self.waiting[0]):
                break  # the head does not fit yet: nobody overtakes it
            request = self.waiting.popleft()
            self.prefilling.append(request)
            room -= 1
            blocked = not self._plan_chunks([request], chunks)
        moves, self._moves = self._moves, []
        return Step(prefill=chunks, decode=list(self.rows), moves=moves,
                    bucket=config.bucket_for(len(self.rows)) if self.rows else 0)

    def _first_chunk(self, request: Request) -> int:
        return max(1, min(self.prompt_left(request), self.config.prefill_chunk_tokens))

    def _plan_chunks(self, requests: list[Request], chunks: list[tuple[Request, int]]) -> bool:
        """Append the chunks the credit pays for, request by request in order, each request's chunks until its
        prompt is planned; False once a chunk is not paid for (nobody after it gets one: FIFO)."""
        for request in requests:
            left = max(1, self.prompt_left(request))
            while left > 0:
                tokens = min(left, self.config.prefill_chunk_tokens)
                if tokens > self.credit:
                    return False
                chunks.append((request, tokens))
                self.credit -= tokens
                left -= tokens
        return True

    def prefilled(self, request: Request) -> int:
        """A request whose prefill is done joins the decoding rows; returns its row."""
        self._forget_prefill(request)
        self.rows.append(request)
        return len(self.rows) - 1

    def prefill_ended(self, request: Request) -> None:
        """A request left while (or right after) being prefilled, without joining the rows (cancelled, failed,
        finished at its first token): it no longer counts as prefilling. No-op for any other request."""
        self._forget_prefill(request)

    def _forget_prefill(self, request: Request) -> None:
        for index, other in enumerate(self.prefilling):
            if other is request:
                del self.prefilling[index]
                return

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
