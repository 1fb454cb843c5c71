"""SequentialEngine: one request at a time through ``model.generate``, on one engine thread. Correct and simple.

Each request gets its own ``RocketKVCache`` (and, with a pool, its pages reserved for its lifetime), its own
sampling parameters and torch.Generator, a streamer that forwards every token as it is produced, and a stopping
criterion that reads its cancel flag, so a cancelled request stops within one decode step. When generate() returns,
the cache is dropped and the pages are released *before* the final event is sent.

Why one thread: torch.compile's CUDA-graph trees and other compiled state are thread-local, and generate() is not
safe to run concurrently on one model, so the thread that owns the model runs every forward.

The continuous-batching engine (batching.py: admission by pool reservations, prefills interleaved with a bucketed
decode step) implements the same ``Engine`` interface (engine.py); both share their thread and request registry
(threaded.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from ...cache import RocketKVCache
from ...config import RocketKVConfig
from ...integration import compat
from ...integration.generate import get_config
from ..batching.admission import check_pool_fits
from ..outputs import FinishReason
from ..parallel.lockstep import check_lockstep_for
from .generate_hooks import CancelCriteria, SamplingLogitsProcessor, TokenStreamer
from .interface import EngineEvent, EngineRequest
from .request_queue import RequestQueue
from .sampler import new_generator
from .threaded import ThreadedEngine

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 64
CacheFactory = Callable[[RocketKVConfig], RocketKVCache]


class SequentialEngine(ThreadedEngine):
    """Runs admitted requests one after another (FIFO) with ``model.generate`` on its own thread.

    Owns the bounded queue of waiting requests and the one running request; the thread, the registry and the
    interface methods are ``ThreadedEngine``'s (serving/engines/threaded.py).

    Args:
        model: a causal LM whose attention is ``rocketkv`` (``hf_rocketkv.enable(model)``).
        config: the RocketKVConfig of every request's cache (default: ``hf_rocketkv.get_config(model)``).
        pool: optional ``KVBlockPool``: each request reserves its pages (``pool.admit``) while it runs and releases
            them before its final event; a request that does not fit even alone ends with ``error``.
        max_queue: requests that may wait (the running one not counted); one more raises ``Overloaded``.
        cache_factory: builds a request's cache from ``config`` (default ``RocketKVCache(config)``).
    """

    _thread_name = "hf-rocketkv-engine"
    _log_name = "hf_rocketkv engine"
    _logger = logger

    def __init__(
        self,
        model,
        config: RocketKVConfig | None = None,
        *,
        pool=None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        cache_factory: CacheFactory | None = None,
    ):
        self.model = model
        self.config = config if config is not None else get_config(model)
        if not isinstance(self.config, RocketKVConfig):
            raise TypeError(f"config must be a RocketKVConfig, got {type(self.config).__name__}")
        check_lockstep_for(model, None, "SequentialEngine")  # only the batching engine runs in lockstep
        if pool is not None:
            pool.check_config(self.config)  # a KT geometry the pool cannot hold fails here, not per request
        self.pool = pool
        self.cache_factory = cache_factory if cache_factory is not None else RocketKVCache
        self.device = next(model.parameters()).device
        self.pad_token_id = _pad_token_id(model)
        self._queue = RequestQueue(max_queue)
        super().__init__()  # _requests: admitted and not finished (waiting or running), each an EngineRequest
        self._running: EngineRequest | None = None

    # ------------------------------------------------------------------------------------------------ queue hooks
    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """With a pool: ``InvalidRequest`` for a request the pool could never hold, even empty
        (``admission.check_pool_fits``); the manager calls it before ``submit``."""
        if self.pool is not None:
            check_pool_fits(self.config, self.pool, prompt_len, max_new_tokens)

    def _enqueue(self, request: EngineRequest) -> EngineRequest:
        self._refuse_duplicate(request)
        self._queue.put(request)  # Overloaded, or EngineStopped once the queue is closed
        return request

    def _drop_waiting(self, request_id: str) -> EngineRequest | None:
        return self._queue.remove(request_id)

    def _queue_load(self) -> tuple[int, int, int]:
        return (1 if self._running is not None else 0), len(self._queue), self._queue.max_size

    def _close(self, drain: bool) -> list[EngineRequest]:
        self._refuse_new()
        self._queue.close()
        if drain:
            return []
        with self._lock:
            dropped = self._queue.drain()
            for request in dropped:
                request.cancelled.set()
                self._requests.pop(request.request_id, None)
            if self._running is not None:
                self._running.cancelled.set()
        return dropped

    # ------------------------------------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while True:
            with self._lock:
                request = self._queue.get(timeout=0)
                self._running = request
            if request is None:
                if self._queue.closed:
                    return
                self._queue.wait()
                continue
            try:
                self._serve(request)
            except BaseException:  # noqa: BLE001 - the thread must outlive any one request
                logger.exception("hf_rocketkv engine: unexpected failure while finishing request %s",
                                 request.request_id)

    def _serve(self, request: EngineRequest) -> None:
        streamer = TokenStreamer(request, self._emit)
        reason, error = FinishReason.CANCELLED, None
        if not request.cancelled.is_set():
            try:
                self._generate_with_pages(request, streamer)
                reason = _finish_reason(request, streamer)
            except Exception as err:  # noqa: BLE001 - one request's failure ends that request only
                logger.warning("hf_rocketkv engine: request %s failed: %s", request.request_id, err, exc_info=True)
                reason, error = FinishReason.ERROR, f"{type(err).__name__}: {err}"
        with self._lock:  # its cache and pages are gone by now: the final event may be read as "freed"
            self._running = None
            self._requests.pop(request.request_id, None)
        self._emit(EngineEvent(request.request_id, finish_reason=reason, error=error))

    def _generate_with_pages(self, request: EngineRequest, streamer: TokenStreamer) -> None:
        admission = None
        if self.pool is not None:
            admission = self.pool.admit(request.prompt_len, request.max_new_tokens, self.config)
        try:
            self._generate(request, streamer)
        finally:
            if admission is not None:
                self.pool.release(admission)

    def _generate(self, request: EngineRequest, streamer: TokenStreamer) -> None:
        """One generate() call; the cache lives only in this frame, so it is freed when the call returns."""
        ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        processors = LogitsProcessorList()
        if not request.params.is_greedy:
            generator = new_generator(request.params.seed, self.device)
            processors.append(SamplingLogitsProcessor(request.params, generator))
        self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **compat.cache_kwargs(self.cache_factory(self.config)),
            max_new_tokens=request.max_new_tokens,
            do_sample=False,  # sampling, when asked, is SamplingLogitsProcessor's (per-request generator)
            num_beams=1,
            min_new_tokens=0,
            repetition_penalty=1.0,  # the request's parameters are the whole contract: model defaults are not
            no_repeat_ngram_size=0,  # applied (the batched engine will not apply them either)
            eos_token_id=sorted(request.stop_token_ids) or None,
            pad_token_id=self.pad_token_id,
            logits_processor=processors,
            stopping_criteria=StoppingCriteriaList([CancelCriteria(request.cancelled)]),
            streamer=streamer,
        )


def _finish_reason(request: EngineRequest, streamer: TokenStreamer) -> FinishReason:
    tokens = streamer.tokens
    if tokens and tokens[-1] in request.stop_token_ids:
        return FinishReason.STOP
    if len(tokens) >= request.max_new_tokens:
        return FinishReason.LENGTH
    if request.cancelled.is_set():
        return FinishReason.CANCELLED
    return FinishReason.LENGTH  # generate stopped for a limit of its own (e.g. the model's max_length)


def _pad_token_id(model) -> int:
    """generate() needs a pad id for finished rows; any valid id does for a single row."""
    config = model.generation_config
    for value in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
