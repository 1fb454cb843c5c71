"""BatchingEngine: continuous batching over the KV block pool, behind the same ``Engine`` interface as
SequentialEngine (engine.py has the contract).

One engine thread owns the model. Each iteration of its loop:

    1. cancel flags: every admitted request whose flag is set ends ("cancelled"), its pages released first
    2. admission (``Scheduler.next_step``): the head of the FIFO is admitted when the pool can set its cold prefill
       peak aside (``pool.reserve``: the prompt pages and the view for all ``max_tokens``, so a decoding request never
       runs out of pages); a prompt that can never fit the pool ends with ``error``
    3. prefill up to ``prefills_per_step`` admitted requests, each with its own ``RocketKVCache(cfg, pool=pool)`` of
       batch 1 (prefix reuse through the pool, stage 1 as generate() runs it); sample its first token
    4. one batched decode forward over every decoding row (``cache/batch_view.py``: the rows' own pages through one
       block table, rows padded up to the scheduler's bucket; on CUDA one captured graph per bucket,
       ``integration/batch_graphs.py``), per-row position ids, sampling per row with the
       request's own parameters and generator; rows end on a stop id, ``max_tokens`` or their cancel flag and
       release their pages at once (the last row moves into a freed row, so the batch stays packed)

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

Before ``start``, ``warm_up`` captures every bucket's decode graph at once (a synthetic request decodes two steps
per bucket), so the captures and the widening of the batch's tables never happen while real requests wait.

A request's events are its tokens as they are sampled, then one final event sent after its pages are back in the
pool. Failures: a prefill or sampling error ends that request only; an error in the batched decode forward cannot be
pinned on one row, so it ends every row of that step (the engine and the waiting requests go on).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from ..integration import compat
from ..cache import BatchedDecodeCache, RocketKVCache, request_pages
from ..config import RocketKVConfig
from ..integration.batch_graphs import BatchedDecodeGraphs, GraphCaptureFailed
from ..integration.decode_graphs import on_device
from ..integration.generate import get_config
from ..integration.rope import fused_rope
from ..memory import KVBlockPool
from ..memory import PoolExhaustedError
from .engine import EngineEvent, EngineLoad, EngineRequest, EventSink
from .errors import EngineStopped, Overloaded
from .lockstep import (Inbox, Lockstep, LockstepDiverged, Submission, check_lockstep_for, engine_state,
                       resolve_seed)
from .outputs import FinishReason
from .sampler import new_generator, sample_tokens
from .sampling import SamplingParams
from .scheduler import BatchingConfig, QueueFull, Scheduler

logger = logging.getLogger(__name__)

STEP_HISTORY = 65536  # decode step times kept in BatchingStats.step_ms
DEFAULT_WARMUP_MAX_TOKENS = 512  # max_tokens covered by BatchingEngine.warm_up (and GenerationManager's) default
# the warm-up request's prefix-index salt: its prompt pages (cached once it ends) can never be a real request's hit
WARMUP_CACHE_SALT = "hf_rocketkv.batching.warm_up"
WARMUP_REQUEST_ID = "hf_rocketkv-warm-up"


@dataclass
class BatchingStats:
    """Counters of the engine thread (``BatchingEngine.stats()`` returns a copy), for benchmarks and tests.

    decode_seconds / prefill_seconds: host wall time of the decode steps / prefills, each ending with the host
    reading the sampled tokens (so the device work is included)."""

    decode_steps: int = 0
    decode_rows: int = 0  # real rows summed over decode steps (decode_rows / decode_steps = mean batch)
    padded_rows: int = 0  # padding rows summed over decode steps
    decode_seconds: float = 0.0
    prefills: int = 0
    prefill_seconds: float = 0.0
    # the latest decode steps' wall times in ms, oldest first (bounded: a server runs for days)
    step_ms: deque = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))


@dataclass(eq=False)  # identity: the scheduler finds a request's row with list.index
class _Running:
    """One admitted request on the engine thread."""

    request: EngineRequest
    reservation: object = None  # the pool pages set aside at admission (given to the cache's admission at prefill)
    cache_salt: str | None = None  # the prefix-index salt of its cache (set only for the warm-up request)
    error: str | None = None  # set at admission: the request can never be served (ends with "error" at prefill)
    cache: RocketKVCache | None = None
    generator: torch.Generator | None = None
    tokens: int = 0
    last_token: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id


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


def _device_ids(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as a long tensor on ``device`` without waiting for it: on CUDA through pinned memory and an
    asynchronous copy (a copy from pageable memory would first wait for the stream, a sync on every step)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


@dataclass(eq=False)
class _StepInFlight:
    """A launched decode step: its rows (in row order), bucket, device tokens ``[rows]`` (the next step's inputs),
    their copy on the way to the host, the rows whose draw raised, and its launch time."""

    rows: list[_Running]
    bucket: int
    tokens: torch.Tensor
    host: _TokensToHost
    failed: dict[int, Exception]
    started: float


class BatchingEngine:
    """Continuous batching over a ``KVBlockPool`` (see the module docstring).

    Args:
        model: a causal LM whose attention is ``rocketkv``.
        config: the RocketKVConfig of every request (default ``hf_rocketkv.get_config(model)``);
            ``multi_turn="keep_all"`` and ``token_budget`` are refused (one turn per request; the pool fixes the
            KT page size).
        pool: the ``KVBlockPool`` every request's pages come from (required: admission is its accounting).
        batching: ``BatchingConfig`` (max_running, decode buckets, prefills_per_step, max_queue).
        decode_graphs: how the decode step runs: None (default) captures one CUDA graph per bucket when
            ``config.decode_runner == "cuda_graphs"`` and the model is on CUDA, else eager; False: always eager; or a
            ``BatchedDecodeGraphs`` (integration/batch_graphs.py; tests pass one with a CPU stand-in backend).
        lockstep: under tensor parallelism, a ``Lockstep`` (serving/lockstep.py) built on every rank: the leader
            rank's engine takes requests and sends each iteration's inbox, the others ``follow()``. None (default):
            one process.
    """

    def __init__(self, model, config: RocketKVConfig | None = None, pool: KVBlockPool | None = None,
                 batching: BatchingConfig | None = None, decode_graphs: BatchedDecodeGraphs | bool | None = None,
                 lockstep: Lockstep | None = None):
        self.model = model
        self.config = config if config is not None else get_config(model)
        if not isinstance(self.config, RocketKVConfig):
            raise TypeError(f"config must be a RocketKVConfig, got {type(self.config).__name__}")
        if not isinstance(pool, KVBlockPool):
            raise TypeError(f"BatchingEngine(pool=...) needs a hf_rocketkv.KVBlockPool (admission is its page "
                            f"accounting), got {type(pool).__name__}")
        if self.config.multi_turn != "evict":
            raise NotImplementedError(
                f"BatchingEngine serves one turn per request: RocketKVConfig.multi_turn must be 'evict', got "
                f"{self.config.multi_turn!r}")
        if self.config.decode_budget is not None:
            raise NotImplementedError(
                f"BatchingEngine: RocketKVConfig.decode_budget={self.config.decode_budget} (decode-time compression) "
                f"is not run by the batched decode step (BatchedDecodeCache never calls maybe_compress_decode), while "
                f"the pool admits only prompt kept + decode_budget + decode_interval slots per row: every request "
                f"would fail at that length. Use engine='sequential' or decode_budget=None")
        if self.config.token_budget is not None:
            raise NotImplementedError(
                "BatchingEngine: RocketKVConfig.token_budget derives page_size per request, but the pool fixes it; "
                "set prompt_budget / topk / page_size / topr instead")
        pool.check_config(self.config)
        self.pool = pool
        self.batching = batching if batching is not None else BatchingConfig()
        if not isinstance(self.batching, BatchingConfig):
            raise TypeError(f"batching must be a BatchingConfig, got {type(self.batching).__name__}")
        self.device = next(model.parameters()).device
        self.batch = BatchedDecodeCache(pool, self.batching.buckets[-1])
        if decode_graphs is None:
            decode_graphs = BatchedDecodeGraphs(model) if self.config.decode_runner == "cuda_graphs" else False
        self.graphs: BatchedDecodeGraphs | None = decode_graphs or None
        self._scheduler: Scheduler[_Running] = Scheduler(self.batching, self._admit, key=lambda r: r.request_id)
        self._requests: dict[str, _Running] = {}  # submitted, not finished
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._closed = False
        self._sink: EventSink | None = None
        self._thread: threading.Thread | None = None
        self._stats = BatchingStats()
        self._in_flight: _StepInFlight | None = None  # a launched decode step whose tokens are not read yet
        self._last_read = 0.0  # when the latest step's tokens were read (perf_counter)
        if lockstep is not None and not isinstance(lockstep, Lockstep):
            raise TypeError(f"lockstep must be a hf_rocketkv.serving.Lockstep or None, got {type(lockstep).__name__}")
        check_lockstep_for(model, lockstep, "BatchingEngine")
        self.lockstep = lockstep
        # the leader's side of lockstep (serving/lockstep.py): requests submitted since the last inbox, and the
        # callers' cancel flags of requests not finished (the engine reads only its own copies of them)
        self._outbox: list[EngineRequest] = []
        self._caller_flags: dict[str, threading.Event] = {}
        self._inboxes = 0  # inboxes applied (every rank counts the same)
        self._failure: BaseException | None = None  # what ended a lockstep engine thread, for follow() to raise

    # ------------------------------------------------------------------------------------------------ interface
    def start(self, sink: EventSink) -> None:
        if self._thread is not None:
            raise RuntimeError("BatchingEngine.start: already started")
        self._sink = sink
        self._thread = threading.Thread(target=self._run, name="hf-rocketkv-batching", daemon=True)
        self._thread.start()

    def submit(self, request: EngineRequest) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise EngineStopped("the engine is not running (never started, stopped, or its thread ended)")
        with self._lock:
            if self._closed:
                raise EngineStopped("the engine is stopping or stopped; no new requests are admitted")
            if request.request_id in self._requests:
                raise ValueError(f"request id {request.request_id!r} is already admitted")
            if self.lockstep is not None:
                self._submit_to_outbox(request)
                return
            running = _Running(request)
            try:
                self._scheduler.submit(running)
            except QueueFull:
                raise Overloaded(len(self._scheduler.waiting), self.batching.max_queue) from None
            self._requests[request.request_id] = running
            self._wakeup.notify()

    def cancel(self, request_id: str) -> None:
        if self.lockstep is not None:
            self._cancel_in_lockstep(request_id)
            return
        with self._lock:
            running = self._requests.get(request_id)
            if running is None:
                return
            running.request.cancelled.set()  # an admitted one stops at the next step boundary
            dropped = self._scheduler.cancel_waiting(request_id)
            if dropped is not None:
                del self._requests[request_id]
            self._wakeup.notify()
        if dropped is not None:  # it never ran: it ends here, on the caller's thread
            self._emit(EngineEvent(request_id, finish_reason=FinishReason.CANCELLED))

    def load(self) -> EngineLoad:
        with self._lock:
            running, waiting = self._scheduler.running, len(self._scheduler.waiting) + len(self._outbox)
        alive = self._thread is not None and self._thread.is_alive() and not self._closed
        return EngineLoad(running=running, waiting=waiting, alive=alive, max_queue=self.batching.max_queue)

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Admit nothing new; ``drain``: finish every admitted request; else cancel them all. Joins the thread.

        Under lockstep the leader's stop ends every rank's engine (once its last inbox is applied); a follower's
        ``stop`` only waits for that."""
        if self.lockstep is not None:
            self._stop_in_lockstep(drain)
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout)
            return
        dropped: list[_Running] = []
        with self._lock:
            self._closed = True
            if not drain:
                while self._scheduler.waiting:
                    running = self._scheduler.waiting.popleft()
                    dropped.append(running)
                    self._requests.pop(running.request_id, None)
                for running in self._requests.values():
                    running.request.cancelled.set()
            self._wakeup.notify_all()
        for running in dropped:
            running.request.cancelled.set()
            self._emit(EngineEvent(running.request_id, finish_reason=FinishReason.CANCELLED))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def steps(self) -> int:
        """Decode forwards run so far."""
        return self._stats.decode_steps

    def stats(self) -> BatchingStats:
        """A snapshot of the engine's counters."""
        return replace(self._stats, step_ms=deque(self._stats.step_ms, maxlen=STEP_HISTORY))

    # ------------------------------------------------------------------------------------------------ warm-up
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

    def warm_up(self, max_new_tokens: int = DEFAULT_WARMUP_MAX_TOKENS, buckets: tuple[int, ...] | None = None) -> dict:
        """Capture the decode graph of every bucket now, before serving (as vLLM and TensorRT-LLM do at start-up).

        Without it the first two steps of each bucket run while real requests wait: an eager warm-up step, then the
        capture; and every row whose view table is wider than any before reallocates the batch's buffers, after
        which every bucket is captured again. Here one synthetic request (``warm_up_prompt_len`` random token ids,
        ``max_tokens = max(max_new_tokens, 2 * len(buckets) + 1)``) is prefilled exactly as a request is (pool
        reservation, its own pool-backed ``RocketKVCache``, stage 1), joins the batch as row 0, and decodes two
        steps per bucket (padded to the bucket: warm-up, then capture); then it leaves and its pages go back.

        Its view table is as wide as that of any request whose ``max_tokens <= max_new_tokens``, whatever its
        prompt length (a view holds ``min(prompt, prompt_budget) + max_tokens`` tokens, docs/memory.md), so such
        requests never trigger a capture or a table widening afterwards. A request with more ``max_tokens`` widens
        the tables and the buckets are captured again, lazily, as without warm-up. The cost of a wide table is
        paid from the first step: the tables stay as wide as the warm-up's.

        Args:
            max_new_tokens: the largest ``max_tokens`` to cover (an int >= 1).
            buckets: the batch sizes to capture, each one of ``BatchingConfig.buckets``; default: every bucket up to
                ``bucket_for(max_running)``, the largest one a step can use.

        Runs on the caller's thread and must come before ``start()`` (RuntimeError after it): the engine thread owns
        the batch once started; graphs captured here replay on it. Without graphs (CPU, ``decode_graphs=False``)
        the steps run eagerly (kernels and allocator warmed) and nothing is captured. The synthetic request's
        prompt pages stay in the prefix index as evictable cached pages under a salt of their own (no real request
        can hit them); the pool's free pages are back to what they were. Raises ``ValueError`` for bad arguments
        and ``PoolExhaustedError`` (pages needed and free) when the pool cannot hold the synthetic request.

        Returns ``{"seconds", "buckets", "captures", "table_pages", "max_new_tokens"}``: wall time, the buckets
        stepped, graphs captured, the batch's table width in pool pages, and the ``max_tokens`` covered.
        """
        if self._thread is not None:
            raise RuntimeError("BatchingEngine.warm_up must run before start(): once started, the engine thread owns "
                               "the decode batch")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"BatchingEngine.warm_up: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        buckets = self._warm_up_buckets(buckets)
        graphs = self.graphs if self.graphs_in_use else None
        captured_before = graphs.captures if graphs is not None else 0
        started = time.perf_counter()
        running = self._warm_up_request(max(max_new_tokens, 2 * len(buckets) + 1), scratch=buckets[-1] > 1)
        try:
            # not inference_mode: the batch's buffers are updated in place on the engine thread; the model's GPU
            # as the current device, as on the engine thread (the graphs captured here replay there)
            with torch.no_grad(), on_device(self.device):
                self._warm_up_steps(running, buckets)
        finally:
            self._release(running)
            self.batch.release_scratch()
        result = {
            "seconds": time.perf_counter() - started,
            "buckets": buckets,
            "captures": graphs.captures - captured_before if graphs is not None else 0,
            "table_pages": self.batch.layers[0].width,
            "max_new_tokens": running.request.max_new_tokens,
        }
        logger.info("hf_rocketkv batching engine: warmed up buckets %s in %.2f s (%d graphs captured, tables of %d "
                    "pages: max_tokens <= %d never captures again)", buckets, result["seconds"], result["captures"],
                    result["table_pages"], result["max_new_tokens"])
        return result

    def _warm_up_buckets(self, buckets: tuple[int, ...] | None) -> tuple[int, ...]:
        """The buckets to warm up, checked; default: those a step can use (up to the bucket of max_running)."""
        config = self.batching
        if buckets is None:
            largest = config.bucket_for(config.max_running)
            return tuple(b for b in config.buckets if b <= largest)
        if isinstance(buckets, int) or not all(isinstance(b, int) and not isinstance(b, bool) for b in buckets):
            raise ValueError(f"BatchingEngine.warm_up: buckets must be a tuple of batch sizes, got {buckets!r}")
        unknown = [b for b in buckets if b not in config.buckets]
        if unknown or not buckets:
            raise ValueError(f"BatchingEngine.warm_up: buckets must be among BatchingConfig.buckets "
                             f"{config.buckets}, got {tuple(buckets)!r}")
        return tuple(sorted(set(buckets)))

    def _warm_up_request(self, max_new_tokens: int, scratch: bool) -> _Running:
        """The synthetic request, its pages set aside as admission does (PoolExhaustedError when they do not fit):
        its prefill peak, or its view plus the padding rows' scratch page if that is more."""
        vocab = int(self.model.config.get_text_config().vocab_size)
        generator = torch.Generator().manual_seed(0)  # reproducible; the salt keeps them out of real hits anyway
        ids = torch.randint(0, vocab, (self.warm_up_prompt_len,), generator=generator).tolist()
        request = EngineRequest(WARMUP_REQUEST_ID, tuple(ids), SamplingParams.greedy(max_new_tokens, ignore_eos=True),
                                frozenset())
        running = _Running(request, cache_salt=WARMUP_CACHE_SALT)
        plan = self._row_pages(request)
        need = max(plan.peak_pages, plan.steady_pages + int(scratch))
        running.reservation = self.pool.reserve(
            need, f"BatchingEngine.warm_up's synthetic request ({request.prompt_len} prompt tokens, max_tokens="
                  f"{max_new_tokens}{', plus a scratch page for padding rows' if scratch else ''}; warm up fewer "
                  f"max_new_tokens or give the pool more memory)")
        return running

    def _warm_up_steps(self, running: _Running, buckets: tuple[int, ...]) -> None:
        """Prefill the synthetic request, join it as row 0, two decode steps per bucket, leave."""
        token = int(self._prefill_forward(running).argmax(dim=-1)[0])
        self.batch.join(0, running.cache)
        try:
            for bucket in buckets:
                if bucket > 1 and not self.batch.ensure_scratch():
                    raise PoolExhaustedError("the padding rows' scratch page (BatchingEngine.warm_up)", 1,
                                             self.pool.free_pages(), self.pool.total_pages())
                for _ in range(2):  # a bucket's first step warms up, its second captures (batch_graphs.py)
                    token = int(self._step_logits(1, bucket, [token]).argmax(dim=-1)[0])
        except BaseException:
            self._reset_batch()  # a failed step may leave the batch half-updated
            raise
        self.batch.leave(0)

    # ------------------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # thread-local: this thread never builds autograd graphs
        with on_device(self.device):  # this thread's current CUDA device: the model's GPU
            self._loop()

    def _loop(self) -> None:
        try:
            if self.lockstep is None:
                while self._wait_for_work():
                    self._guarded_iteration()
            else:
                while self._apply_inbox(self._next_inbox()):
                    if not self._scheduler.idle():
                        self._guarded_iteration()
        except Exception as err:  # lockstep only (the loop above never raises): the thread ends, follow() raises it
            self._failure = err
            logger.critical("hf_rocketkv batching engine (lockstep rank %s) stopped: %s",
                            getattr(self.lockstep, "rank", 0), err)
        finally:
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
        with self._lock:
            step = self._scheduler.next_step()
        for src, dst in step.moves:
            self.batch.move(src, dst)
        if step.prefill and self._in_flight is not None:
            self._drain()  # the running rows' tokens go out before a prefill delays the next step
        for running in step.prefill:
            self._prefill(running)
        self._finish_cancelled()  # a flag set during prefill ends that request before it decodes
        if self._scheduler.rows:
            self._decode()
        elif not step.prefill:
            # the head waits for pages that nobody running will free (another user of the pool holds them)
            with self._lock:
                self._wakeup.wait(0.01)

    # ------------------------------------------------------------------------------------------------ lockstep
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

    def _require_leader(self) -> None:
        if not self.lockstep.is_leader:
            raise RuntimeError(
                f"this rank ({self.lockstep.rank}) follows rank {self.lockstep.src} in lockstep: only the leader "
                f"takes requests (submit/cancel); call follow() here")

    def _submit_to_outbox(self, request: EngineRequest) -> None:
        """The leader's submit (engine lock held): the request waits for the next inbox, counted in the queue."""
        self._require_leader()
        if any(r.request_id == request.request_id for r in self._outbox):
            raise ValueError(f"request id {request.request_id!r} is already admitted")
        waiting = len(self._scheduler.waiting) + len(self._outbox)
        if waiting >= self.batching.max_queue:
            raise Overloaded(waiting, self.batching.max_queue)
        self._outbox.append(request)
        self._caller_flags[request.request_id] = request.cancelled
        self._wakeup.notify()

    def _cancel_in_lockstep(self, request_id: str) -> None:
        """The leader's cancel: a request not sent yet ends here; a sent one is cancelled through the next inbox."""
        self._require_leader()
        with self._lock:
            flag = self._caller_flags.get(request_id)
            if flag is not None:
                flag.set()  # a sent request: the next inbox carries the cancel
            pending = next((r for r in self._outbox if r.request_id == request_id), None)
            if pending is not None:  # not sent: it never reaches any rank
                self._outbox.remove(pending)
                del self._caller_flags[request_id]
            self._wakeup.notify()
        if pending is not None:
            self._emit(EngineEvent(request_id, finish_reason=FinishReason.CANCELLED))

    def _stop_in_lockstep(self, drain: bool) -> None:
        if not self.lockstep.is_leader:
            return  # a follower ends with the leader's last inbox
        with self._lock:
            self._closed = True
            dropped = [] if drain else list(self._outbox)
            if not drain:
                self._outbox.clear()
                for request in dropped:
                    self._caller_flags.pop(request.request_id, None)
                for flag in self._caller_flags.values():
                    flag.set()  # sent as cancels with the next inbox
            self._wakeup.notify_all()
        for request in dropped:
            request.cancelled.set()
            self._emit(EngineEvent(request.request_id, finish_reason=FinishReason.CANCELLED))

    def _next_inbox(self) -> Inbox:
        """The inbox of this iteration on every rank: the leader builds and sends it (waiting while idle, at most a
        heartbeat), the others receive it."""
        if not self.lockstep.is_leader:
            inbox = self.lockstep.exchange(None)
            mine = self._engine_state()
            if inbox.state != mine:
                raise LockstepDiverged(
                    f"rank {self.lockstep.rank} no longer matches rank {self.lockstep.src}: (inboxes, CRC of request "
                    f"ids) {mine} here, {inbox.state} on the leader; a failure on one rank only (see its log) or a "
                    f"decision that is not deterministic. Restart every rank")
            return inbox
        with self._lock:
            if self._scheduler.idle() and not self._outbox and not self._closed:
                self._wakeup.wait(self.lockstep.heartbeat_s)
            inbox = self._take_inbox()
        return self.lockstep.exchange(inbox)

    def _take_inbox(self) -> Inbox:
        """(engine lock held) The requests submitted since the last inbox (sampling seeds drawn here), the ids
        whose caller's flag is set, and whether every engine ends now."""
        submits = [Submission(r.request_id, r.prompt_ids, resolve_seed(r.params), r.stop_token_ids)
                   for r in self._outbox]
        self._outbox.clear()
        sent_now = {s.request_id for s in submits}
        cancels = []
        for request_id, flag in list(self._caller_flags.items()):
            sent = request_id in self._requests or request_id in sent_now
            if not sent or flag.is_set():  # finished, or cancelled once and for all
                del self._caller_flags[request_id]
            if sent and flag.is_set():
                cancels.append(request_id)
        exit_now = self._closed and self._scheduler.idle() and not submits
        return Inbox(submits, cancels, exit_now, self._engine_state())

    def _engine_state(self) -> tuple[int, int]:
        scheduler = self._scheduler
        return engine_state(self._inboxes, [r.request_id for r in scheduler.rows + scheduler.prefilling],
                            [r.request_id for r in scheduler.waiting])

    def _apply_inbox(self, inbox: Inbox) -> bool:
        """Every rank: the inbox's requests join the queue with cancel flags of this engine's own, its cancels set
        them (the iteration ends those requests). False once the leader said to exit."""
        with self._lock:
            for sub in inbox.submits:
                running = _Running(EngineRequest(sub.request_id, sub.prompt_ids, sub.params, sub.stop_token_ids))
                self._scheduler.submit(running)  # never QueueFull: the leader counted its outbox against max_queue
                self._requests[sub.request_id] = running
            for request_id in inbox.cancels:
                running = self._requests.get(request_id)
                if running is not None:
                    running.request.cancelled.set()
            self._inboxes += 1
        return not inbox.exit

    # ------------------------------------------------------------------------------------------------ admission
    def _admit(self, running: _Running) -> bool:
        """The scheduler's admission callback (engine lock held): set the request's cold prefill peak aside, or say
        "not now"; a request that can never fit is admitted only to end with an error at once."""
        request = running.request
        need = self._row_pages(request).peak_pages
        usable = self.pool.total_pages()
        if need > usable:
            running.error = (
                f"the prompt ({request.prompt_len} tokens) with max_tokens={request.max_new_tokens} needs {need} "
                f"KV pool pages at its prefill peak, more than the pool's {usable} usable pages "
                f"(KVBlockPool max_gpu_bytes / page_size={self.pool.page_size}): it can never be admitted; "
                f"send a shorter prompt or fewer max_tokens, or give the pool more memory")
            return True
        try:
            running.reservation = self.pool.reserve(need, f"admitting request {request.request_id}")
        except PoolExhaustedError:
            return False  # not now: pages come back as running requests finish
        return True

    def _row_pages(self, request: EngineRequest):
        """The request's pool pages at its cold prefill peak and once compressed (``cache/page_budget.py``)."""
        return request_pages(self.config, self.pool, request.prompt_len, request.max_new_tokens)

    # ------------------------------------------------------------------------------------------------ prefill
    def _prefill(self, running: _Running) -> None:
        request = running.request
        if running.error is not None:
            self._finish(running, FinishReason.ERROR, running.error)
            return
        if request.cancelled.is_set():
            self._finish(running, FinishReason.CANCELLED)
            return
        started = time.perf_counter()
        try:
            logits = self._prefill_forward(running)
            if not request.params.is_greedy:
                running.generator = new_generator(request.params.seed, self.device)
            token = int(sample_tokens(logits, request.params, running.generator)[0])
            self._stats.prefills += 1
            self._stats.prefill_seconds += time.perf_counter() - started
        except Exception as err:  # noqa: BLE001 - one request's failure ends that request only
            logger.warning("hf_rocketkv batching engine: request %s failed in prefill: %s", request.request_id, err,
                           exc_info=True)
            self._finish(running, FinishReason.ERROR, f"{type(err).__name__}: {err}")
            return
        if self._accept(running, token):
            with self._lock:
                row = self._scheduler.prefilled(running)
            try:
                self.batch.join(row, running.cache)
            except Exception as err:  # noqa: BLE001
                self._end_row(running, FinishReason.ERROR, f"{type(err).__name__}: {err}")

    def _prefill_forward(self, running: _Running) -> torch.Tensor:
        """The request's prompt through the model with its own pool-backed cache; returns the last logits [1, V]."""
        request = running.request
        cache = RocketKVCache(self.config, pool=self.pool, cache_salt=running.cache_salt)
        running.cache = cache
        ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        reservation, running.reservation = running.reservation, None  # the admission takes these pages
        # a prefix hit: columns [0, start) come from the pool
        with cache.prefill(ids, max_new_tokens=request.max_new_tokens, reservation=reservation,
                           max_length=request.prompt_len + request.max_new_tokens) as start:
            positions = torch.arange(start, request.prompt_len, device=self.device)[None]
            out = self.model(input_ids=ids[:, start:], attention_mask=torch.ones_like(ids), position_ids=positions,
                             use_cache=True, logits_to_keep=1, **compat.cache_kwargs(cache))
        return out.logits[:, -1].float()

    # ------------------------------------------------------------------------------------------------ decode
    def _decode(self) -> None:
        """One decode step over the running rows. With ``BatchingConfig.overlap_decode`` the step is launched before
        the tokens of the step still in flight are read, from those tokens on the device (module docstring)."""
        rows = list(self._scheduler.rows)
        in_flight = self._in_flight
        if in_flight is not None and not self._can_launch_after(in_flight, rows):
            self._drain()
            in_flight, rows = None, list(self._scheduler.rows)
            if not rows:
                return
        step = self._launch(rows, in_flight)
        if step is None:
            return
        self._in_flight = step
        if in_flight is not None:
            self._complete(in_flight, after=step)
        if not self.batching.overlap_decode:
            self._drain()

    def _can_launch_after(self, in_flight: "_StepInFlight", rows: list[_Running]) -> bool:
        """Whether the next step may run on the tokens still in flight: the same rows in the same order, and none of
        them can end on those tokens for a reason known now (max_tokens, a cancel flag, a failed draw). A stop id
        is known only once read: ``_complete`` then takes the later step's tokens back too."""
        if len(rows) != len(in_flight.rows) or any(a is not b for a, b in zip(rows, in_flight.rows)):
            return False
        if in_flight.failed:
            return False
        return all(r.tokens + 1 < r.request.max_new_tokens and not r.request.cancelled.is_set() for r in rows)

    def _launch(self, rows: list[_Running], in_flight: "_StepInFlight | None") -> "_StepInFlight | None":
        """Launch one step over ``rows`` (their last tokens from the host, or the in-flight step's device tokens) and
        its sampling; the tokens start their way to the host. None when the forward failed (every row ended)."""
        bucket = self.batching.bucket_for(len(rows))
        if bucket > len(rows) and not self.batch.ensure_scratch():
            bucket = len(rows)  # no free page for the padding rows: this step runs on the exact batch size
        started = time.perf_counter()
        last_tokens = in_flight.tokens if in_flight is not None else [r.last_token for r in rows]
        try:
            logits = self._step_logits(len(rows), bucket, last_tokens)
        except Exception as err:  # noqa: BLE001 - a batched forward cannot be pinned on one row
            logger.warning("hf_rocketkv batching engine: the decode step failed: %s", err, exc_info=True)
            self._fail_all_rows(f"the batched decode step failed: {type(err).__name__}: {err}")
            return None
        tokens, failed = self._sample_rows(rows, logits)
        return _StepInFlight(rows, bucket, tokens, _TokensToHost(tokens), failed, started)

    def _drain(self) -> None:
        """Read and accept the tokens of the step in flight (no step is in flight afterwards)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self._complete(in_flight)

    def _complete(self, step: "_StepInFlight", after: "_StepInFlight | None" = None) -> None:
        """Read ``step``'s tokens (waiting for that step only) and accept them. ``after``: the step launched on
        them, still in flight; when a row of ``step`` ends, ``after`` is read as well and its tokens accepted for the
        rows that go on (a row that ended gets none), so no row leaves the batch while a step that holds it runs."""
        values = step.host.read()
        self._count_step(step)
        outcomes = [self._outcome(running, step.failed.get(index, values[index]))
                    for index, running in enumerate(step.rows)]
        later = None
        if after is not None and any(reason is not None for reason, _ in outcomes):
            self._in_flight = None
            later = after.host.read()
            self._count_step(after)
        for index, (running, (reason, error)) in enumerate(zip(step.rows, outcomes)):
            token = values[index]
            if self._settle(running, token, reason, error) and later is not None:
                next_token = after.failed.get(index, later[index])
                self._settle(running, later[index], *self._outcome(running, next_token))

    def _count_step(self, step: "_StepInFlight") -> None:
        """A step's tokens were read: its wall time runs from its launch, or from the previous read when it was
        launched before that (then it is the time between two tokens of a row)."""
        now = time.perf_counter()
        seconds = now - max(step.started, self._last_read)
        self._last_read = now
        stats = self._stats
        stats.decode_steps += 1
        stats.decode_rows += len(step.rows)
        stats.padded_rows += step.bucket - len(step.rows)
        stats.decode_seconds += seconds
        stats.step_ms.append(seconds * 1e3)

    def _outcome(self, running: _Running, token) -> tuple[FinishReason | None, str | None]:
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

    def _settle(self, running: _Running, token: int, reason: FinishReason | None, error: str | None) -> bool:
        """Emit ``token`` (unless the row failed or was cancelled) and end the row for ``reason``. True while it
        goes on decoding."""
        if reason in (FinishReason.ERROR, FinishReason.CANCELLED):
            self._end_row(running, reason, error)
            return False
        return self._accept(running, token)

    def _step_logits(self, rows: int, bucket: int, last_tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """One decode forward over rows ``[0, rows)`` (their last tokens in: host ints, or a ``[rows]`` device
        tensor), padded to ``bucket`` rows, through the bucket's graph or eagerly; returns the real rows' logits
        ``[rows, V]`` as float32."""
        self.batch.prepare(rows, bucket)
        if isinstance(last_tokens, torch.Tensor):
            ids = last_tokens.new_zeros(bucket, 1)
            ids[:rows, 0] = last_tokens
        else:
            ids = _device_ids(last_tokens + [0] * (bucket - rows), self.device).view(bucket, 1)
        positions = self.batch.next_positions(bucket)
        with fused_rope(self.model, self.config.fused_rope):
            logits = self._graphed_step(ids, positions)
            if logits is None:
                out = self.model(input_ids=ids, position_ids=positions, use_cache=True,
                                 **compat.cache_kwargs(self.batch))
                logits = out.logits[:, -1]
        self.batch.stepped()
        return logits[:rows].float()

    def _graphed_step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The step through its bucket's CUDA graph; None: run it eagerly (no graphs, or a capture that failed,
        after which every step runs eagerly)."""
        if self.graphs is None or not self.graphs.wants(self.device):
            return None
        try:
            return self.graphs.run(self.batch, ids, positions)
        except GraphCaptureFailed as err:
            logger.warning("hf_rocketkv batching engine: %s; decoding eagerly from now on", err)
            self.graphs = None
            return None

    def _sample_rows(self, rows: list[_Running], logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, Exception]]:
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

    def _accept(self, running: _Running, token: int) -> bool:
        """Emit a sampled token; end the request on a stop id or max_tokens. True while it goes on decoding."""
        request = running.request
        running.tokens += 1
        running.last_token = token
        self._emit(EngineEvent(request.request_id, (token,)))
        if token in request.stop_token_ids:
            reason = FinishReason.STOP
        elif running.tokens >= request.max_new_tokens:
            reason = FinishReason.LENGTH
        else:
            return True
        self._end_row(running, reason)
        return False

    # ------------------------------------------------------------------------------------------------ endings
    def _finish_cancelled(self) -> None:
        """Every request whose flag is set ends now: decoding rows leave, waiting ones are dropped (a flag set
        without ``cancel()``, e.g. a stop string or a manager's stop, never waits for the head of the queue)."""
        if self._in_flight is not None and any(r.request.cancelled.is_set() for r in self._scheduler.rows):
            self._drain()  # no row leaves the batch while a step that holds it runs
        for running in [r for r in self._scheduler.rows if r.request.cancelled.is_set()]:
            self._end_row(running, FinishReason.CANCELLED)
        with self._lock:
            dropped = [r for r in self._scheduler.waiting if r.request.cancelled.is_set()]
            for running in dropped:
                self._scheduler.cancel_waiting(running.request_id)
        for running in dropped:
            self._finish(running, FinishReason.CANCELLED)

    def _end_row(self, running: _Running, reason: FinishReason, error: str | None = None) -> None:
        """A request ends: out of the decoding rows (if it joined), its pages back, then its final event."""
        if running in self._scheduler.rows:
            row = self._scheduler.rows.index(running)
            if self.batch.caches[row] is running.cache:
                self.batch.leave(row)
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

    def _finish(self, running: _Running, reason: FinishReason, error: str | None = None) -> None:
        """Release everything the request holds, forget it, then send its final event (pages are back by then)."""
        try:
            self._release(running)
        except Exception:  # noqa: BLE001 - the final event must still be sent
            logger.exception("hf_rocketkv batching engine: releasing request %s failed", running.request_id)
        with self._lock:
            self._requests.pop(running.request_id, None)
        self._emit(EngineEvent(running.request_id, finish_reason=reason, error=error))

    def _release(self, running: _Running) -> None:
        """Close the request's cache (its pages go back) and give back what its reservation still holds."""
        if running.cache is not None:
            running.cache.close()
            running.cache = None
        if running.reservation is not None:
            self.pool.unreserve(running.reservation)
            running.reservation = None

    def _fail_all_rows(self, message: str) -> None:
        """A failed decode step: every decoding row ends with an error and the batch starts afresh (its state may be
        half-updated; the rows' caches are closed without a write-back). A step in flight is dropped unread."""
        self._in_flight = None
        self._reset_batch()
        rows = list(self._scheduler.rows)
        with self._lock:
            for running in rows:
                self._scheduler.finish(running)
            self._scheduler.take_moves()
        for running in rows:
            self._finish(running, FinishReason.ERROR, message)

    def _reset_batch(self) -> None:
        """Every row's cache given back without a write-back, and a fresh batch in place of this one (after a failed
        step its state may be half-updated; the graphs of the old one are captured again for the new one)."""
        for index, cache in enumerate(self.batch.caches):
            if cache is not None:
                cache.give_back()
                self.batch.caches[index] = None
        self.batch.close()
        self.batch = BatchedDecodeCache(self.pool, self.batching.buckets[-1])

    def _fail_orphans(self, message: str) -> None:
        """After an unexpected failure: every admitted request that is neither waiting nor decoding (its prefill
        was interrupted) still gets its one final event."""
        with self._lock:
            placed = {id(r) for r in self._scheduler.waiting} | {id(r) for r in self._scheduler.rows}
            orphans = [r for r in self._requests.values() if id(r) not in placed]
        for running in orphans:
            self._finish(running, FinishReason.ERROR, message)

    def _emit(self, event: EngineEvent) -> None:
        """Send to the sink; a failing sink is logged and never reaches the engine loop."""
        try:
            self._sink(event)
        except Exception:  # noqa: BLE001
            logger.exception("hf_rocketkv batching engine: the event sink failed on %s", event)
