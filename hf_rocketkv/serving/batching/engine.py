"""BatchingEngine: continuous batching over the KV block pool, behind the same ``Engine`` interface as
SequentialEngine (engine.py has the contract).

One engine thread owns the model. Each iteration of its loop:

    1. cancel flags: every admitted request whose flag is set ends ("cancelled"), its pages released first
    2. admission (``Scheduler.next_step``): the head of the FIFO is admitted when the pool can set its cold prefill
       peak aside (``pool.reserve``: the prompt pages and the view for all ``max_tokens``, so a decoding request never
       runs out of pages); a prompt that can never fit the pool ends with ``error``
    3. one batched decode step over every decoding row (decode_step.py: overlapped with the host's reading of the
       previous step's tokens, on CUDA through one captured graph per bucket); rows end on a stop id, ``max_tokens``
       or their cancel flag and release their pages at once (the last row moves into a freed row, so the batch stays
       packed)
    4. the prefill chunks the scheduler planned within its token budget (``prefill_chunk_tokens`` per forward,
       ``prefill_token_budget`` per decode step): each admitted request has its own ``RocketKVCache(cfg,
       pool=pool)`` of batch 1, entered at its first chunk (prefix reuse through the pool) and prefilled chunk by
       chunk across iterations (chunked_prefill.py); at its last chunk stage 1 runs, its first token is sampled and
       it joins the decoding rows, so a long prompt never stalls them for more than one chunk

This module holds the engine itself: its iteration, the prefills and the endings of requests. Its parts have files of
their own: the thread, request registry and interface methods (threaded.py, shared with SequentialEngine), a
request's pool pages from admission to release (admission.py), a prompt's chunks (chunked_prefill.py), the decode
step (decode_step.py), the graph capture before serving (warm_up.py) and, under tensor parallelism, the inboxes every
rank applies in lockstep (inboxes.py).

A request's events are its tokens as they are sampled, then one final event sent after its pages are back in the
pool. Failures: a prefill or sampling error ends that request only; an error in the batched decode forward cannot be
pinned on one row, so it ends every row of that step (the engine and the waiting requests go on).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

from ...cache import BatchedDecodeCache, position_scaled_layers
from ...config import RocketKVConfig
from ...integration.batch_graphs import BatchedDecodeGraphs
from ...integration.generate import get_config
from ...memory import KVBlockPool
from ..engines.interface import EngineEvent, EngineRequest, EventSink
from ..engines.sampler import new_generator, sample_tokens
from ..engines.threaded import ThreadedEngine
from ..errors import Overloaded
from ..outputs import FinishReason
from ..parallel.inboxes import EngineQueue, LockstepInboxes
from ..parallel.lockstep import Lockstep, check_lockstep_for
from .admission import PoolAdmission, check_pool_fits
from .decode_step import BatchDecoder, RowEndings
from .prefill_graphs import LookaheadGraphs, PrefillGraphs
from .prefill_worker import PrefillWorker
from .running import RunningRequest
from .scheduler import BatchingConfig, QueueFull, Scheduler
from .warm_up import DEFAULT_WARMUP_MAX_TOKENS, WARMUP_CACHE_SALT, WARMUP_REQUEST_ID, EngineParts, warm_up

__all__ = ["BatchingEngine", "BatchingStats", "DEFAULT_WARMUP_MAX_TOKENS", "STEP_HISTORY", "WARMUP_CACHE_SALT",
           "WARMUP_REQUEST_ID"]

logger = logging.getLogger(__name__)

STEP_HISTORY = 65536  # decode step times kept in BatchingStats.step_ms


@dataclass
class BatchingStats:
    """Counters of the engine thread (``BatchingEngine.stats()`` returns a copy), for benchmarks and tests.

    decode_seconds / prefill_seconds: host wall time of the decode steps / prefills (every chunk of a request's
    prefill summed), each ending with the host reading the sampled tokens (so the device work is included; a chunk
    before the last reads nothing, its device work is counted where the next read waits for it)."""

    decode_steps: int = 0
    decode_rows: int = 0  # real rows summed over decode steps (decode_rows / decode_steps = mean batch)
    padded_rows: int = 0  # padding rows summed over decode steps
    decode_seconds: float = 0.0
    prefills: int = 0  # requests whose prefill finished (their first token sampled)
    packed_steps: int = 0  # decode steps that carried a prefill chunk in the same forward (packed_steps)
    prefill_chunks: int = 0  # prefill forwards (a prompt of one chunk counts one)
    prefill_seconds: float = 0.0
    # the latest decode steps' wall times in ms, oldest first (bounded: a server runs for days)
    step_ms: deque = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))

    def count_decode_step(self, rows: int, padded: int, seconds: float) -> None:
        """A decode step of ``rows`` real and ``padded`` padding rows, ``seconds`` of wall time."""
        self.decode_steps += 1
        self.decode_rows += rows
        self.padded_rows += padded
        self.decode_seconds += seconds
        self.step_ms.append(seconds * 1e3)

    def count_packed(self) -> None:
        """A decode step that carried a prefill chunk (counted as a decode step too, once its tokens are read)."""
        self.packed_steps += 1

    def count_prefill(self, chunks: int = 0, seconds: float = 0.0, finished: bool = False) -> None:
        """``chunks`` prefill forwards and ``seconds`` of prefill wall time; ``finished``: a request's prefill
        ended with its first token."""
        self.prefill_chunks += chunks
        self.prefill_seconds += seconds
        self.prefills += int(finished)


class BatchingEngine(ThreadedEngine):
    """Continuous batching over a ``KVBlockPool`` (see the module docstring).

    Owns the scheduler (waiting requests, prefills, packed decoding rows), the decode batch view (``batch``), the
    prefills and the endings of requests. Its parts: the thread and interface (``ThreadedEngine``), the pool pages
    of each request (``PoolAdmission``), the decode steps (``BatchDecoder``; ``graphs``: the decode graphs they
    run through) and, under lockstep, the inboxes (``LockstepInboxes``). Under lockstep the leader's ``stop`` ends
    every rank's engine (once its last inbox is applied); a follower's ``stop`` only waits for that.

    Args:
        model: a causal LM whose attention is ``rocketkv``.
        config: the RocketKVConfig of every request (default ``hf_rocketkv.get_config(model)``);
            ``multi_turn="keep_all"`` and ``token_budget`` are refused (one turn per request; the pool fixes the
            KT page size).
        pool: the ``KVBlockPool`` every request's pages come from (required: admission is its accounting).
        batching: ``BatchingConfig`` (max_running, decode buckets, prefills_per_step, max_queue, prefill chunk
            and token budget, overlap_decode).
        decode_graphs: how the decode step runs: None (default) captures one CUDA graph per bucket when
            ``config.decode_runner == "cuda_graphs"`` and the model is on CUDA, else eager; False: always eager; or a
            ``BatchedDecodeGraphs`` (integration/batch_graphs.py; tests pass one with a CPU stand-in backend).
        lockstep: under tensor parallelism, a ``Lockstep`` (serving/parallel/lockstep.py) built on every rank: the
            leader rank's engine takes requests and sends each iteration's inbox, the others ``follow()``. None
            (default): one process.
    """

    _thread_name = "hf-rocketkv-batching"
    _log_name = "hf_rocketkv batching engine"
    _logger = logger

    def __init__(self, model, config: RocketKVConfig | None = None, pool: KVBlockPool | None = None,
                 batching: BatchingConfig | None = None, decode_graphs: BatchedDecodeGraphs | bool | None = None,
                 lockstep: Lockstep | None = None):
        self.model = model
        self.config = config if config is not None else get_config(model)
        _check_config(self.config, pool)
        self.pool = pool
        self.batching = batching if batching is not None else BatchingConfig()
        if not isinstance(self.batching, BatchingConfig):
            raise TypeError(f"batching must be a BatchingConfig, got {type(self.batching).__name__}")
        self.device = next(model.parameters()).device
        self._position_scaled = position_scaled_layers(model.config)  # Llama 4's NoPE layers (the batch's rows)
        self.batch = BatchedDecodeCache(pool, self.batching.buckets[-1], self._position_scaled)
        if decode_graphs is None:
            decode_graphs = BatchedDecodeGraphs(model) if self.config.decode_runner == "cuda_graphs" else False
        self._admission = PoolAdmission(model, self.config, pool, self.device)
        self._scheduler: Scheduler[RunningRequest] = Scheduler(self.batching, self._admission.admit,
                                                               key=lambda r: r.request_id,
                                                               prompt_left=lambda r: r.prompt_left)
        super().__init__()  # _requests: submitted, not finished, each a RunningRequest
        self._stats = BatchingStats()
        self._decoder = BatchDecoder(self, RowEndings(lambda: self._scheduler.rows, self._accept, self._end_row,
                                                      self._fail_all_rows), decode_graphs or None, self._stats)
        if lockstep is not None and not isinstance(lockstep, Lockstep):
            raise TypeError(f"lockstep must be a hf_rocketkv.serving.Lockstep or None, got {type(lockstep).__name__}")
        check_lockstep_for(model, lockstep, "BatchingEngine")
        self.lockstep = lockstep
        self._inboxes = None if lockstep is None else LockstepInboxes(EngineQueue(
            self._lock, self._wakeup, self._scheduler, self._requests, self.batching.max_queue, self._emit,
            lambda: self._closed, self._refuse_new), lockstep)
        self._failure: BaseException | None = None  # what ended a lockstep engine thread, for follow() to raise
        self._worker: PrefillWorker | None = None  # concurrent_prefill_tokens: prefills beside the decode steps
        # warm_up's plan of cuDNN prefill graphs, built by the prefilling thread before start() returns
        self.prefill_graphs: PrefillGraphs | None = None
        if self.batching.concurrent_prefill_tokens is not None:
            if lockstep is not None:
                raise NotImplementedError(
                    "BatchingEngine: BatchingConfig.concurrent_prefill_tokens cannot run under lockstep (a prefill "
                    "thread's progress depends on timing, every rank must take the same decisions); leave it None")
            self._worker = PrefillWorker(self._admission, self.batching.concurrent_prefill_tokens,
                                         self.batching.prefill_chunk_tokens, self.device, self._wake)
            self._decoder.capture_under(self._worker.capture_lock)
        # packed_steps, except beside a prefill thread, under lockstep, or for position-scaled queries (docs/engine.md)
        self._packs = self.batching.packed_steps and not (self._worker or lockstep or self._position_scaled)
        # the next prompt's cuDNN graphs, built while the device runs a chunk (where this thread prefills)
        self._lookahead = (LookaheadGraphs(model, pool, self.device, self.batching.prefill_chunk_tokens)
                           if self._worker is None and lockstep is None else None)

    # ------------------------------------------------------------------------------------------------ interface
    def start(self, sink: EventSink) -> None:
        """Start the engine thread; after ``warm_up``, return once the prefilling thread built the prefill
        attention graphs it planned (prefill_graphs.py)."""
        super().start(sink)
        if self.prefill_graphs is not None:
            self.prefill_graphs.wait(self._thread.is_alive)

    def cancel(self, request_id: str) -> None:
        if self._inboxes is not None:
            self._inboxes.cancel(request_id)
            return
        super().cancel(request_id)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ``InvalidRequest`` (``context_length_exceeded``, naming prompt or max_tokens) when a request of this
        size could never be admitted, even into an empty pool. The manager calls it before ``submit``; a request
        submitted anyway ends with ``error`` at admission."""
        check_pool_fits(self.config, self.pool, prompt_len, max_new_tokens)

    @property
    def steps(self) -> int:
        """Decode forwards run so far."""
        return self._stats.decode_steps

    def stats(self) -> BatchingStats:
        """A snapshot of the engine's counters."""
        return replace(self._stats, step_ms=deque(self._stats.step_ms, maxlen=STEP_HISTORY))

    @property
    def graphs(self) -> BatchedDecodeGraphs | None:
        """The decode graphs the steps run through (None: eager; set to None when a capture fails)."""
        return self._decoder.graphs

    @property
    def graphs_in_use(self) -> bool:
        """Whether decode steps run through captured graphs (on CUDA by default; False once a capture failed)."""
        return self.graphs is not None and self.graphs.wants(self.device)

    @property
    def warm_up_prompt_len(self) -> int:
        """Prompt tokens of ``warm_up``'s synthetic request: more than ``prompt_budget``, so stage 1 keeps the full
        budget and its view is as wide as any request's (the observation window on top, so the policy has a window
        and a budget to choose from, as for any long prompt)."""
        return self.config.prompt_budget + self.config.window_size + 1

    def warm_up(self, max_new_tokens: int = DEFAULT_WARMUP_MAX_TOKENS, buckets: tuple[int, ...] | None = None,
                prefill_tokens: int | None = None) -> dict:
        """Capture the decode graph of every bucket now, on the caller's thread, before ``start()`` (RuntimeError
        after it; warm_up.py has the details): a synthetic request decodes two steps per bucket, so requests with
        ``max_tokens <= max_new_tokens`` never capture while serving. ``buckets``: default every bucket up to
        ``bucket_for(max_running)``. ``prefill_tokens``: prompts of up to this many tokens meet no new cuDNN
        attention graph while serving, their graphs built by ``start()`` (default: two prefill chunks; 0: none).
        Returns ``{"seconds", "buckets", "captures", "table_pages", "max_new_tokens", "prefill_shapes"}``;
        raises ``ValueError`` for bad arguments, ``PoolExhaustedError`` when the pool cannot hold the request."""
        if self._thread is not None:
            raise RuntimeError("BatchingEngine.warm_up must run before start(): once started, the engine thread owns "
                               "the decode batch")
        return warm_up(self, EngineParts(self._admission, self._decoder, self._reset_batch), max_new_tokens, buckets,
                       prefill_tokens)

    def follow(self, sink: EventSink | None = None) -> None:
        """A follower rank's whole serving life: start the engine thread and return once the leader has stopped
        (after warm_up, like ``start``). ``sink`` receives the same events as the leader's (default: dropped)."""
        if self.lockstep is None or self.lockstep.is_leader:
            raise RuntimeError("BatchingEngine.follow is for the other ranks of a Lockstep; the leader rank starts "
                               "the engine with start() (e.g. through a GenerationManager)")
        self.start(sink if sink is not None else (lambda event: None))
        self._thread.join()
        if self._failure is not None:
            raise self._failure

    # ------------------------------------------------------------------------------------------------ queue hooks
    def _enqueue(self, request: EngineRequest) -> RunningRequest | None:
        self._refuse_when_closed()
        self._refuse_duplicate(request)
        if self._inboxes is not None:
            self._inboxes.submit(request)  # sent to every rank with the next inbox
            return None
        running = RunningRequest(request)
        try:
            self._scheduler.submit(running)
        except QueueFull:
            raise Overloaded(len(self._scheduler.waiting), self.batching.max_queue) from None
        return running

    def _drop_waiting(self, request_id: str) -> RunningRequest | None:
        return self._scheduler.cancel_waiting(request_id)

    def plan_prefill_graphs(self, prefill_tokens: int) -> PrefillGraphs:
        """Plan the prefill attention graphs of prompts of up to ``prefill_tokens`` tokens (``prefill_graphs.py``): the
        prefilling thread builds them before ``start()`` returns."""
        self.prefill_graphs = PrefillGraphs(self.model, self.pool, self.device, self.batching.prefill_chunk_tokens,
                                            prefill_tokens)
        return self.prefill_graphs

    def _queue_load(self) -> tuple[int, int, int]:
        waiting = len(self._scheduler.waiting) + (len(self._inboxes.outbox) if self._inboxes is not None else 0)
        return self._scheduler.running, waiting, self.batching.max_queue

    def _close(self, drain: bool) -> list:
        if self._inboxes is not None:
            return self._inboxes.stop(drain)
        dropped: list[RunningRequest] = []
        with self._lock:
            self._refuse_new()
            if not drain:
                while self._scheduler.waiting:
                    running = self._scheduler.waiting.popleft()
                    dropped.append(running)
                    self._requests.pop(running.request_id, None)
                for running in self._requests.values():
                    running.request.cancelled.set()
            self._wakeup.notify_all()
        return dropped

    # ------------------------------------------------------------------------------------------------ engine thread
    def _wake(self) -> None:
        with self._lock:
            self._wakeup.notify_all()

    def _loop(self) -> None:
        try:
            if self._worker is not None:
                self._worker.start(self.prefill_graphs)
                with self._worker.decode_stream_context():
                    while self._wait_for_work():
                        self._guarded_iteration()
            elif self._inboxes is None:
                if self.prefill_graphs is not None:
                    self.prefill_graphs.build()  # on this thread, which prefills: cuDNN's graphs are per thread
                    self._lookahead.built.update(self.prefill_graphs.shapes)
                while self._wait_for_work():
                    self._guarded_iteration()
            else:
                while self._inboxes.apply(self._inboxes.next()):
                    if not self._scheduler.idle():
                        self._guarded_iteration()
        except Exception as err:  # lockstep only (the loop above never raises): the thread ends, follow() raises it
            self._failure = err
            logger.critical("hf_rocketkv batching engine (lockstep rank %s) stopped: %s",
                            getattr(self.lockstep, "rank", 0), err)
        finally:
            if self._worker is not None:
                self._worker.stop()
            if self.prefill_graphs is not None:
                self.prefill_graphs.release()  # (a start() still waiting for them returns)
            self.batch.close()

    def _guarded_iteration(self) -> None:
        try:
            self._iteration()
        except Exception:  # noqa: BLE001 - the thread must outlive any one step
            logger.exception("hf_rocketkv batching engine: unexpected failure in a step")
            self._fail_all_rows("the engine step failed (see the server log)")
            self._fail_orphans("the engine step failed (see the server log)")

    def _wait_for_work(self) -> bool:
        """Block while nothing is admitted; False once stopped with nothing left."""
        with self._lock:
            while self._scheduler.idle():
                if self._closed:
                    return False
                self._wakeup.wait()
            return True

    def _iteration(self) -> None:
        self._finish_cancelled()
        if self._worker is not None:
            self._take_prefills()
        with self._lock:
            step = self._scheduler.next_step()
        for src, dst in step.moves:
            self.batch.move(src, dst)
        if self._worker is not None:
            self._worker.decoding(len(self._scheduler.rows))
        # packed_steps: the first chunk rides on the decode step; else the step runs before the chunks
        beside = self._decoder.beside() if self._packs and step.prefill and self._scheduler.rows else None
        if self._scheduler.rows and beside is None:
            self._decoder.step()
        for running, tokens in step.prefill:
            if running not in self._scheduler.prefilling:  # ended by an earlier chunk of this step
                continue
            if self._worker is None:
                beside = self._prefill_chunk(running, tokens, beside)
            elif not self._worker.holds(running) and not self._ended_before_prefill(running):
                self._worker.submit(running)  # it hands the request back when done (_take_prefills)
        if beside is not None and self._scheduler.rows:  # its chunk never ran (the request had ended)
            self._decoder.step()
        if not self._scheduler.rows and (not step.prefill or self._worker is not None):
            # the head waits for pages that nobody running will free (another user of the pool holds them), or
            # for the prefill worker (it wakes the thread when it hands a request back)
            with self._lock:
                if self._worker is None or not self._worker.has_results():  # (one handed back already: no wait)
                    self._wakeup.wait(0.01 if self._worker is None else 0.05)

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill_chunk(self, running: RunningRequest, tokens: int, beside=None):
        """The next ``tokens`` of a request's prompt (its first chunk enters its cache's prefill), in the decode
        step's forward ``beside`` (``BatchDecoder.beside``; returned unused if the request had ended); after the last
        chunk, its first token is sampled and it joins the decoding rows."""
        request = running.request
        if self._ended_before_prefill(running):
            return beside
        started = time.perf_counter()
        try:
            prefill = running.prefill
            if prefill is None:
                prefill = self._admission.start_prefill(running, self.batching.prefill_chunk_tokens)
            logits = prefill.run(tokens, beside)
            self._stats.count_prefill(chunks=1)
            if self._lookahead is not None:  # the device runs the chunk: the next chunks' graphs meanwhile
                self._lookahead.after_chunk(self._scheduler, self._lock, running)
        except Exception as err:  # noqa: BLE001 - one request's failure ends that request only
            logger.warning("hf_rocketkv batching engine: request %s failed in prefill: %s", request.request_id, err,
                           exc_info=True)
            self._finish(running, FinishReason.ERROR, f"{type(err).__name__}: {err}")
            return None
        if logits is not None:
            self._prefilled(running, logits, started)
        else:
            self._stats.count_prefill(seconds=time.perf_counter() - started)
        return None

    def _ended_before_prefill(self, running: RunningRequest) -> bool:
        """End a request that failed or was cancelled before its next chunk ran; True when it did."""
        if running.error is not None:
            self._finish(running, FinishReason.ERROR, running.error)
        elif running.request.cancelled.is_set():
            self._finish(running, FinishReason.CANCELLED)
        else:
            return False
        return True

    def _take_prefills(self) -> None:
        """The requests the prefill worker handed back: each joins the decoding rows (after its device work), or
        ends (cancelled between chunks, failed)."""
        for result in self._worker.take_done():
            self._stats.count_prefill(chunks=result.chunks, seconds=result.seconds)
            if result.error is not None:
                self._finish(result.running, FinishReason.ERROR, result.error)
            elif result.logits is None:
                self._finish(result.running, FinishReason.CANCELLED)
            else:
                result.wait()
                self._prefilled(result.running, result.logits)

    def _prefilled(self, running: RunningRequest, logits, started: float | None = None) -> None:
        """A request's prompt is in its cache: its first token is sampled from ``logits`` ``[1, V]`` and it joins
        the decoding rows (unless that token ends it). ``started``: when the engine thread began its last chunk (its
        prefill seconds then end with the token read, so they hold the chunk's device work)."""
        request = running.request
        try:
            if not request.params.is_greedy:
                running.sample_with(new_generator(request.params.seed, self.device))
            token = int(sample_tokens(logits, request.params, running.generator)[0])
            self._stats.count_prefill(seconds=time.perf_counter() - started if started is not None else 0.0,
                                      finished=True)
        except Exception as err:  # noqa: BLE001 - one request's failure ends that request only
            logger.warning("hf_rocketkv batching engine: request %s failed sampling its first token: %s",
                           request.request_id, err, exc_info=True)
            self._finish(running, FinishReason.ERROR, f"{type(err).__name__}: {err}")
            return
        self._decoder.drain()  # the batch changes: its tokens out first, and no step in flight holds it
        if self._accept(running, token):
            with self._lock:
                row = self._scheduler.prefilled(running)
            try:
                self.batch.join(row, running.cache)  # the row takes the request's pages; its cache is left empty
                running.drop_cache()
            except Exception as err:  # noqa: BLE001
                self._end_row(running, FinishReason.ERROR, f"{type(err).__name__}: {err}")

    # ------------------------------------------------------------------------------------------------ endings
    def _accept(self, running: RunningRequest, token: int) -> bool:
        """Emit a sampled token; end the request on a stop id or max_tokens. True while it goes on decoding."""
        request = running.request
        running.took(token)
        self._emit(EngineEvent(request.request_id, (token,)))
        if token in request.stop_token_ids:
            reason = FinishReason.STOP
        elif running.tokens >= request.max_new_tokens:
            reason = FinishReason.LENGTH
        else:
            return True
        self._end_row(running, reason)
        return False

    def _finish_cancelled(self) -> None:
        """Every request whose flag is set ends now: decoding rows leave, requests being prefilled leave their
        prefill, waiting ones are dropped (a flag set without ``cancel()``, e.g. a stop string or a manager's stop,
        never waits for the head of the queue)."""
        if self._decoder.in_flight is not None and any(r.request.cancelled.is_set() for r in self._scheduler.rows):
            self._decoder.drain()  # no row leaves the batch while a step that holds it runs
        for running in [r for r in self._scheduler.rows if r.request.cancelled.is_set()]:
            self._end_row(running, FinishReason.CANCELLED)
        for running in [r for r in self._scheduler.prefilling if r.request.cancelled.is_set() and not self._held(r)]:
            self._finish(running, FinishReason.CANCELLED)  # mid-prefill: the prefill is left, its pages go back
        with self._lock:
            dropped = [r for r in self._scheduler.waiting if r.request.cancelled.is_set()]
            for running in dropped:
                self._scheduler.cancel_waiting(running.request_id)
        for running in dropped:
            self._finish(running, FinishReason.CANCELLED)

    def _held(self, running: RunningRequest) -> bool:
        """Whether the prefill worker holds ``running`` (it comes back through ``_take_prefills``, cancelled or not)."""
        return self._worker is not None and self._worker.holds(running)

    def _end_row(self, running: RunningRequest, reason: FinishReason, error: str | None = None) -> None:
        """A request ends: out of the decoding rows (if it joined), its pages back, then its final event."""
        if running in self._scheduler.rows:
            row = self._scheduler.rows.index(running)
            if self.batch.holds(row):
                self.batch.leave(row)  # its pages go back
            with self._lock:
                self._scheduler.finish(running)
            self._apply_moves_now()
            if not self._scheduler.rows:
                self.batch.release_scratch()  # an idle engine holds no page: pool accounting reads "all free"
        self._finish(running, reason, error)

    def _apply_moves_now(self) -> None:
        """Apply the scheduler's pending row moves to the batch at once (rows stay packed between finishes)."""
        with self._lock:
            moves = self._scheduler.take_moves()
        for src, dst in moves:
            self.batch.move(src, dst)

    def _finish(self, running: RunningRequest, reason: FinishReason, error: str | None = None) -> None:
        """Release everything the request holds, forget it, then send its final event (pages are back by then)."""
        try:
            self._admission.release(running)
        except Exception:  # noqa: BLE001 - the final event must still be sent
            logger.exception("hf_rocketkv batching engine: releasing request %s failed", running.request_id)
        with self._lock:
            self._scheduler.prefill_ended(running)
            self._requests.pop(running.request_id, None)
        self._emit(EngineEvent(running.request_id, finish_reason=reason, error=error))

    def _fail_all_rows(self, message: str) -> None:
        """A failed decode step: every decoding row ends with an error and the batch starts afresh (its state may be
        half-updated; the rows' pages go back). A step in flight is dropped unread."""
        self._decoder.drop()
        if self._worker is not None and self._worker.decode_stream is not None:
            self._worker.decode_stream.synchronize()  # the dropped step's reads end before the worker reuses pages
        self._reset_batch()
        rows = list(self._scheduler.rows)
        with self._lock:
            for running in rows:
                self._scheduler.finish(running)
            self._scheduler.take_moves()
        for running in rows:
            self._finish(running, FinishReason.ERROR, message)

    def _reset_batch(self) -> None:
        """Every row's pages back to the pool, and a fresh batch in place of this one (after a failed step its state
        may be half-updated; the graphs of the old one are captured again for the new one)."""
        self.batch.release_rows()
        self.batch.close()
        self.batch = BatchedDecodeCache(self.pool, self.batching.buckets[-1], self._position_scaled)

    def _fail_orphans(self, message: str) -> None:
        """After an unexpected failure: every admitted request that is neither waiting nor decoding (its prefill
        was interrupted, or is under way and may be half-updated) still gets its one final event."""
        with self._lock:
            placed = {id(r) for r in self._scheduler.waiting} | {id(r) for r in self._scheduler.rows}
            orphans = [r for r in self._requests.values() if id(r) not in placed and not self._held(r)]
        for running in orphans:
            self._finish(running, FinishReason.ERROR, message)


def _check_config(config, pool) -> None:
    """What the batching engine cannot serve is refused when it is built, naming the field."""
    if not isinstance(config, RocketKVConfig):
        raise TypeError(f"config must be a RocketKVConfig, got {type(config).__name__}")
    if not isinstance(pool, KVBlockPool):
        raise TypeError(f"BatchingEngine(pool=...) needs a hf_rocketkv.KVBlockPool (admission is its page "
                        f"accounting), got {type(pool).__name__}")
    if config.multi_turn != "evict":
        raise NotImplementedError(
            f"BatchingEngine serves one turn per request: RocketKVConfig.multi_turn must be 'evict', got "
            f"{config.multi_turn!r}")
    if config.decode_budget is not None:
        raise NotImplementedError(
            f"BatchingEngine: RocketKVConfig.decode_budget={config.decode_budget} (decode-time compression) "
            f"is not run by the batched decode step (BatchedDecodeCache never calls maybe_compress_decode), while "
            f"the pool admits only prompt kept + decode_budget + decode_interval slots per row: every request "
            f"would fail at that length. Use engine='sequential' or decode_budget=None")
    if config.token_budget is not None:
        raise NotImplementedError(
            "BatchingEngine: RocketKVConfig.token_budget derives page_size per request, but the pool fixes it; "
            "set prompt_budget / topk / page_size / topr instead")
    pool.check_config(config)
