"""The batching engine's decode step: one forward over every decoding row, overlapped with the host's work.

A step takes the rows' last tokens (host ints, or the previous step's sampled tokens still on the device), runs one
decode forward over the batch view (``BatchedDecodeCache``: the rows' own pages through one block table, rows padded
up to the scheduler's bucket; on CUDA one captured graph per bucket, ``integration/batch_graphs.py``) with per-row
position ids, samples each row's next token with its request's own parameters and generator, and starts the tokens'
copy to the host. Reading them decides each row's fate (a token accepted, or the row's end), through the engine.

Overlapped decode (``BatchingConfig.overlap_decode``, on by default), as vLLM's asynchronous scheduling: step N+1 is
launched from step N's sampled tokens while they are still on the device, then step N's tokens are read (their copy
to pinned memory and an event were queued right after step N, so the read waits for step N only) and accepted while
step N+1 runs. The device no longer waits for the host between two steps (about 1 ms per step on an H100 host). A
step is launched ahead only when its rows are exactly the previous step's and none of them can end on the previous
step's token for a reason known beforehand (max_tokens, a cancel flag, a failed draw); anything else that changes
the batch (a prefill, a cancel, a row that ended) first reads the step in flight. A row that ends on a stop id is
known only once its token is read: the step launched after it is then read at once, its tokens are accepted for the
rows that go on and dropped for the row that ended, before the row leaves. Tokens are the same as without overlap,
except that such a step computed one more row than a synchronous engine would have (the bucket may differ; on a
random model's near-tied logits that can change a later token, as any change of batch size can).

A packed step (``BatchingConfig.packed_steps``, ``beside``) is a decode step whose forward also carries a prompt
chunk (cache/packed_step.py): it is launched like any step (from the device tokens of the step in flight when
``step`` would be), runs eagerly, and is the step in flight afterwards.

An error in the batched forward cannot be pinned on one row, so it ends every row of that step; a failed draw ends
its row only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...cache import PackedStepCache
from ...host_copy import device_tensor
from ...integration import compat
from ...integration.batch_graphs import BatchedDecodeGraphs, GraphCaptureFailed
from ...integration.fused_modeling import fused_modeling
from ..engines.sampler import sample_tokens
from ..outputs import FinishReason
from .running import RunningRequest

logger = logging.getLogger(__name__)


class _TokensToHost:
    """A step's sampled tokens on their way to the host: on CUDA an asynchronous copy into pinned memory and an
    event, enqueued right after the step, so reading them waits for that step only and not for a step launched
    after it (a plain ``.tolist()`` would wait for everything queued on the stream)."""

    def __init__(self, tokens: torch.Tensor):
        if tokens.device.type == "cuda":
            self.values = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.values.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values, self.event = tokens, None

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()


@dataclass(eq=False)
class _StepInFlight:
    """A launched decode step: its rows (in row order), bucket, device tokens ``[rows]`` (the next step's inputs),
    their copy on the way to the host, the rows whose draw raised, and its launch time."""

    rows: list[RunningRequest]
    bucket: int
    tokens: torch.Tensor
    host: _TokensToHost
    failed: dict[int, Exception]
    started: float


@dataclass(frozen=True)
class RowEndings:
    """What the decode steps do with their rows, handed over by the engine, which owns the rows:

        rows       the decoding requests in batch order (the engine's scheduler's ``rows``), read at every step
        accept     ``(running, token) -> bool``: emit the token, end the row when it is done; whether it goes on
        end_row    ``(running, reason, error)``: end a row without a token (cancelled, failed)
        fail_all   ``(message)``: end every row after a failed batched forward
    """

    rows: Callable[[], list]
    accept: Callable[[RunningRequest, int], bool]
    end_row: Callable[[RunningRequest, FinishReason, str | None], None]
    fail_all: Callable[[str], None]


class BatchDecoder:
    """The decode steps of one ``BatchingEngine`` (see the module docstring).

    Owns the step in flight (``in_flight``: launched, its tokens not read yet), the time of the latest read, the
    decode graphs (``graphs``; None: every step runs eagerly) and the decode counters of the engine's
    ``BatchingStats``. It steps the engine's current rows through its current batch view (``batch``, replaced after a
    failed step) and hands every token it reads to the engine's endings (``RowEndings``)."""

    def __init__(self, engine, endings: RowEndings, graphs: BatchedDecodeGraphs | None, stats):
        self._engine = engine
        self._endings = endings
        self.graphs = graphs
        self._stats = stats
        self.capture_lock = None  # the prefill worker's (concurrent_prefill_tokens): held while a step captures
        self.in_flight: _StepInFlight | None = None
        self._last_read = 0.0  # when the latest step's tokens were read (perf_counter)

    def capture_under(self, lock) -> None:
        """Hold ``lock`` (the prefill worker's, ``concurrent_prefill_tokens``) around each step that captures a graph:
        no launch of the prefill thread lands inside the capture."""
        self.capture_lock = lock

    def step(self) -> None:
        """One decode step over the running rows. With ``BatchingConfig.overlap_decode`` the step is launched before
        the tokens of the step still in flight are read, from those tokens on the device (module docstring)."""
        rows, in_flight = self._next_launch()
        if not rows:
            return
        step = self._launch(rows, in_flight)
        if step is not None:
            self._now_in_flight(step, in_flight)

    def drain(self) -> None:
        """Read and accept the tokens of the step in flight (no step is in flight afterwards)."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            self._complete(in_flight)

    def drop(self) -> None:
        """Forget the step in flight unread (its forward's batch is being thrown away)."""
        self.in_flight = None

    def step_logits(self, rows: int, bucket: int, last_tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """One decode forward over rows ``[0, rows)`` (their last tokens in: host ints, or a ``[rows]`` device
        tensor), padded to ``bucket`` rows, through the bucket's graph or eagerly; returns the real rows' logits
        ``[rows, V]`` as float32."""
        engine = self._engine
        batch = engine.batch
        batch.prepare(rows, bucket)
        if isinstance(last_tokens, torch.Tensor):
            ids = last_tokens.new_zeros(bucket, 1)
            ids[:rows, 0] = last_tokens
        else:
            ids = device_tensor(last_tokens + [0] * (bucket - rows), torch.long, engine.device).view(bucket, 1)
        positions = batch.next_positions(bucket)
        with fused_modeling(engine.model, engine.config):
            logits = self._graphed_step(ids, positions)
            if logits is None:
                out = engine.model(input_ids=ids, position_ids=positions, use_cache=True,
                                   **compat.cache_kwargs(batch))
                logits = out.logits[:, -1]
        batch.stepped()
        return logits[:rows].float()

    def beside(self) -> Callable | None:
        """A forward that runs a prompt chunk together with the next decode step of the running rows, for
        ``ChunkedPrefill.run(tokens, forward)``; None when no row decodes. That step is launched like any other
        (from the tokens of the step in flight while they are still on the device, when ``step`` would be) and is
        the step in flight afterwards."""
        rows, in_flight = self._next_launch()
        return functools.partial(self._packed_forward, rows, in_flight) if rows else None

    def _packed_forward(self, rows: list[RunningRequest], in_flight: _StepInFlight | None, ids: torch.Tensor,
                        positions: torch.Tensor, cache, start: int) -> torch.Tensor:
        """One forward over ``rows``' next tokens then the chunk ``ids`` ``[1, C]`` at ``positions`` of ``cache``
        (``cache/packed_step.py``); returns the chunk's last logits ``[1, V]``. The rows' tokens are sampled and
        this step is in flight; ``in_flight`` (the step whose device tokens it ran on) is read. A failed forward
        ends every row before the error reaches the prefill (which ends its request)."""
        engine = self._engine
        batch, count, tokens = engine.batch, len(rows), ids.shape[1]
        started = time.perf_counter()
        try:
            batch.prepare(count, count)
            last = in_flight.tokens if in_flight is not None else device_tensor(
                [r.last_token for r in rows], torch.long, engine.device)
            packed_ids = torch.cat([last, ids[0]])[None]
            packed_positions = torch.cat([batch.next_positions(count)[:, 0], positions[0]])[None]
            keep = torch.arange(count + 1, device=engine.device)
            keep[-1] = count + tokens - 1  # the rows' logits and the chunk's last
            out = engine.model(input_ids=packed_ids, position_ids=packed_positions, use_cache=True,
                               logits_to_keep=keep,
                               **compat.cache_kwargs(PackedStepCache(batch, count, cache, start, tokens)))
            batch.stepped()
        except Exception as err:
            self._forward_failed(err)
            raise
        logits = out.logits[0]
        self._stats.count_packed()
        self._now_in_flight(self._sampled(rows, count, logits[:count].float(), started), in_flight)
        return logits[count:]

    # ------------------------------------------------------------------------------------------------ one step
    def _can_launch_after(self, in_flight: _StepInFlight, rows: list[RunningRequest]) -> bool:
        """Whether the next step may run on the tokens still in flight: the same rows in the same order, and none of
        them can end on those tokens for a reason known now (max_tokens, a cancel flag, a failed draw). A stop id
        is known only once read: ``_complete`` then takes the later step's tokens back too."""
        if len(rows) != len(in_flight.rows) or any(a is not b for a, b in zip(rows, in_flight.rows)):
            return False
        if in_flight.failed:
            return False
        return all(r.tokens + 1 < r.request.max_new_tokens and not r.request.cancelled.is_set() for r in rows)

    def _next_launch(self) -> tuple[list[RunningRequest], _StepInFlight | None]:
        """The rows the next step runs and the step in flight it runs on (None: from the rows' host tokens); the step
        in flight is read first when the next one may not run on its tokens (``_can_launch_after``)."""
        rows, in_flight = list(self._endings.rows()), self.in_flight
        if in_flight is not None and not self._can_launch_after(in_flight, rows):
            self.drain()
            rows, in_flight = list(self._endings.rows()), None
        return rows, in_flight

    def _now_in_flight(self, step: _StepInFlight, previous: _StepInFlight | None) -> None:
        """``step`` was launched on ``previous``'s device tokens (or on host tokens): it is in flight now, and
        ``previous`` is read (with ``overlap_decode`` off, ``step`` too)."""
        self.in_flight = step
        if previous is not None:
            self._complete(previous, after=step)
        if not self._engine.batching.overlap_decode:
            self.drain()

    def _launch(self, rows: list[RunningRequest], in_flight: _StepInFlight | None) -> _StepInFlight | None:
        """Launch one step over ``rows`` (their last tokens from the host, or the in-flight step's device tokens) and
        its sampling; the tokens start their way to the host. None when the forward failed (every row ended)."""
        engine = self._engine
        bucket = engine.batching.bucket_for(len(rows))
        if bucket > len(rows) and not engine.batch.ensure_scratch():
            bucket = len(rows)  # no free page for the padding rows: this step runs on the exact batch size
        started = time.perf_counter()
        last_tokens = in_flight.tokens if in_flight is not None else [r.last_token for r in rows]
        try:
            logits = self.step_logits(len(rows), bucket, last_tokens)
        except Exception as err:  # noqa: BLE001 - a batched forward cannot be pinned on one row
            self._forward_failed(err)
            return None
        return self._sampled(rows, bucket, logits, started)

    def _forward_failed(self, err: Exception) -> None:
        """A batched forward raised: it cannot be pinned on one row, so every row ends."""
        logger.warning("hf_rocketkv batching engine: the decode step failed: %s", err, exc_info=True)
        self._endings.fail_all(f"the batched decode step failed: {type(err).__name__}: {err}")

    def _sampled(self, rows: list[RunningRequest], bucket: int, logits: torch.Tensor,
                 started: float) -> _StepInFlight:
        """The step whose forward gave ``logits`` ``[rows, V]``: each row's token drawn, on its way to the host."""
        tokens, failed = self._sample_rows(rows, logits)
        return _StepInFlight(rows, bucket, tokens, _TokensToHost(tokens), failed, started)

    def _graphed_step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The step through its bucket's CUDA graph; None: run it eagerly (no graphs, or a capture that failed,
        after which every step runs eagerly)."""
        if self.graphs is None or not self.graphs.wants(self._engine.device):
            return None
        batch = self._engine.batch
        capturing = self.capture_lock is not None and self.graphs.will_capture(batch)
        try:
            with self.capture_lock if capturing else contextlib.nullcontext():  # no prefill thread's launches meanwhile
                return self.graphs.run(batch, ids, positions)
        except GraphCaptureFailed as err:
            logger.warning("hf_rocketkv batching engine: %s; decoding eagerly from now on", err)
            self.graphs = None
            return None

    def _sample_rows(self, rows: list[RunningRequest],
                     logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, Exception]]:
        """Next token per row on the device ``[rows]``, and the exception of each row whose draw raised: the argmax
        for greedy rows, a draw with the row's own parameters and generator for the others (``sample_tokens`` on
        that row's logits). Nothing is read back here."""
        tokens = logits.argmax(dim=-1)
        failed: dict[int, Exception] = {}
        for index, running in enumerate(rows):
            params = running.request.params
            if params.is_greedy:
                continue
            try:
                tokens[index] = sample_tokens(logits[index : index + 1], params, running.generator)[0]
            except Exception as err:  # noqa: BLE001 - one row's failure ends that row only
                failed[index] = err
        return tokens, failed

    # ------------------------------------------------------------------------------------------------ reading
    def _complete(self, step: _StepInFlight, after: _StepInFlight | None = None) -> None:
        """Read ``step``'s tokens (waiting for that step only) and accept them. ``after``: the step launched on
        them, still in flight; when a row of ``step`` ends, ``after`` is read as well and its tokens accepted for the
        rows that go on (a row that ended gets none), so no row leaves the batch while a step that holds it runs."""
        values = step.host.read()
        self._count_step(step)
        outcomes = [self._outcome(running, step.failed.get(index, values[index]))
                    for index, running in enumerate(step.rows)]
        later = None
        if after is not None and any(reason is not None for reason, _ in outcomes):
            self.in_flight = None
            later = after.host.read()
            self._count_step(after)
        for index, (running, (reason, error)) in enumerate(zip(step.rows, outcomes)):
            token = values[index]
            if self._settle(running, token, reason, error) and later is not None:
                next_token = after.failed.get(index, later[index])
                self._settle(running, later[index], *self._outcome(running, next_token))

    def _count_step(self, step: _StepInFlight) -> None:
        """A step's tokens were read: its wall time runs from its launch, or from the previous read when it was
        launched before that (then it is the time between two tokens of a row)."""
        now = time.perf_counter()
        seconds = now - max(step.started, self._last_read)
        self._last_read = now
        self._stats.count_decode_step(len(step.rows), step.bucket - len(step.rows), seconds)

    def _outcome(self, running: RunningRequest, token) -> tuple[FinishReason | None, str | None]:
        """How a row stands after ``token`` (an int, or the exception its draw raised), before accepting it:
        (None, None) while it goes on, else the reason it ends and the error message."""
        if isinstance(token, Exception):
            return FinishReason.ERROR, f"{type(token).__name__}: {token}"
        if running.request.cancelled.is_set():
            return FinishReason.CANCELLED, None  # nothing after the step that saw the flag
        if token in running.request.stop_token_ids:
            return FinishReason.STOP, None
        if running.tokens + 1 >= running.request.max_new_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def _settle(self, running: RunningRequest, token: int, reason: FinishReason | None, error: str | None) -> bool:
        """Emit ``token`` (unless the row failed or was cancelled) and end the row for ``reason``. True while it
        goes on decoding."""
        if reason in (FinishReason.ERROR, FinishReason.CANCELLED):
            self._endings.end_row(running, reason, error)
            return False
        return self._endings.accept(running, token)

