"""GenerationManager: the public entry point for serving many requests on one model.

    manager = GenerationManager(model, tokenizer, RocketKVConfig(prompt_budget=256), max_queue=32)
    rid = manager.add_request("Explain KV caches.", SamplingParams(max_tokens=64, temperature=0.7, seed=1))
    for out in manager.stream(rid):          # GenerationOutput events; async: `async for out in manager.astream(rid)`
        print(out.text, end="", flush=True)
    manager.cancel(rid)                      # any time; the engine stops it within one decode step
    manager.metrics()                        # running, waiting, finished, free pages, TTFT and tokens/s histograms
    manager.stop(drain=True)                 # finish what was admitted, admit nothing new

The manager validates requests (prompt against the model's context, token ids against the vocabulary, sampling
parameters), owns each request's output processing (detokenization, stop strings) and its output channel, and
drives an ``Engine`` (default: ``SequentialEngine``). Every admitted request ends with exactly one final output.
A request's record is dropped once its final output has been read (``stream``/``astream``/``result``), so read every
request you add, or cancel it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from ..config import RocketKVConfig
from .batching.scheduler import BatchingConfig
from .batching.warm_up import DEFAULT_WARMUP_MAX_TOKENS
from .builder import build_engine, check_warmup_max_tokens
from .channel import OutputChannel
from .engines.interface import Engine, EngineEvent, EngineRequest
from .engines.sequential import DEFAULT_MAX_QUEUE
from .errors import EngineStopped, InvalidRequest, Overloaded, UnknownRequest
from .metrics import ManagerMetrics, MetricsRecorder
from .output_processor import RequestOutputProcessor
from .outputs import FinishReason, GenerationOutput, GenerationResult
from .prompts import encode_chat, encode_text
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Record:
    """One admitted request: what the engine sees, its output state and its consumer's channel."""

    request: EngineRequest
    processor: RequestOutputProcessor
    channel: OutputChannel = field(default_factory=OutputChannel)
    lock: threading.Lock = field(default_factory=threading.Lock)
    consumed: bool = False  # a stream was opened on it
    abandoned: bool = False  # its consumer left before the end: drop the record once the engine finishes it

    def consume(self) -> None:
        """Its one consumer opens the stream (ValueError on a second)."""
        if self.consumed:
            raise ValueError(f"request {self.request.request_id!r} already has a consumer (stream it once)")
        self.consumed = True

    def abandon(self) -> None:
        """Its consumer left before the end (call with ``lock`` held)."""
        self.abandoned = True


class GenerationManager:
    """Schedules requests on one model through an engine; see the module docstring.

    Args:
        model: a causal LM with ``rocketkv`` attention.
        tokenizer: its tokenizer (None: prompts must be token ids, outputs carry no text, no stop strings).
        config: RocketKVConfig of every request's cache (default ``hf_rocketkv.get_config(model)``).
        engine: an ``Engine`` instance, or which one to build: ``"batching"`` (``BatchingEngine``: continuous
            batching over ``pool``, required), ``"sequential"`` (``SequentialEngine``: one request at a time) or
            ``"auto"`` (the default: batching when a pool is given, else sequential).
        pool: a ``KVBlockPool`` the engine draws pages from; its free pages appear in ``metrics()``.
        max_queue: requests that may wait for a built engine; one more raises ``Overloaded``.
        batching: the ``BatchingConfig`` of a built batching engine (default: ``BatchingConfig(max_queue=max_queue)``).
        max_model_len: the context (prompt + max_tokens) limit; default the model's ``max_position_embeddings``.
        warmup_max_tokens: a built batching engine whose decode steps run through CUDA graphs captures every
            bucket's graph here, before serving, for requests of up to this many max_tokens
            (``BatchingEngine.warm_up``); 0: capture lazily while serving. Nothing happens on the CPU.
    """

    def __init__(self, model, tokenizer=None, config: RocketKVConfig | None = None,
                 engine: Engine | str | None = "auto", pool=None, max_queue: int = DEFAULT_MAX_QUEUE,
                 max_model_len: int | None = None, batching: BatchingConfig | None = None,
                 warmup_max_tokens: int = DEFAULT_WARMUP_MAX_TOKENS):
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        text_config = model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        if max_model_len is not None and (not isinstance(max_model_len, int) or isinstance(max_model_len, bool)
                                          or max_model_len < 2):
            raise ValueError(f"max_model_len must be None (the model's max_position_embeddings) or an integer >= 2 "
                             f"(prompt + max_tokens), got {max_model_len!r}")
        self.max_model_len = int(max_model_len or text_config.max_position_embeddings)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        check_warmup_max_tokens(warmup_max_tokens)  # before the tokenizer and the engine do anything
        if tokenizer is not None:
            # A fast tokenizer may reset padding/truncation state stored in its file on its first call (a mutation
            # of the Rust object); do it here, on one thread, before requests encode and decode concurrently.
            tokenizer("warm-up", add_special_tokens=True)
        self.engine = build_engine(model, config, pool=pool, engine=engine, batching=batching, max_queue=max_queue,
                                   warmup_max_tokens=warmup_max_tokens, max_model_len=self.max_model_len)
        self._records: dict[str, _Record] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._recorder = MetricsRecorder()
        self.engine.start(self._on_event)

    # ------------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Admit a request (text, or token ids) and return its id. Raises ``InvalidRequest`` (bad prompt, too long,
        bad parameters), ``Overloaded`` (queue full: nothing is kept) or ``EngineStopped``."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = self._prompt_ids(prompt)
        self._check_request(prompt_ids, params)
        request_id = self._new_id(request_id)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        request = EngineRequest(request_id, tuple(prompt_ids), params, stop_ids)
        record = _Record(request, RequestOutputProcessor(request_id, prompt_ids, params.stop, stop_ids,
                                                         self.tokenizer))
        with self._lock:
            if self._stopped:
                raise EngineStopped("the manager was stopped; no new requests are admitted")
            if request_id in self._records:
                raise InvalidRequest(f"request_id {request_id!r} is already in use", "request_id")
            self._records[request_id] = record
        try:
            self.engine.submit(request)
        except Overloaded:
            self._forget(request_id)
            self._recorder.rejected()
            raise
        except BaseException:
            self._forget(request_id)
            raise
        self._recorder.admitted(len(prompt_ids))
        return request_id

    def chat_prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of chat ``messages`` through the tokenizer's chat template (pass them to ``add_request``)."""
        return encode_chat(self.tokenizer, messages)

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """The request's outputs, as they come, ending with the final one. Leaving the loop early (or a timeout)
        cancels the request and discards the rest. ``timeout``: seconds to wait for each output (TimeoutError)."""
        record = self._open(request_id)
        finished = False
        try:
            while not finished:
                output = record.channel.get(timeout)
                finished = output.finished
                yield output
        finally:
            self._close(request_id, finished)

    async def astream(self, request_id: str) -> AsyncIterator[GenerationOutput]:
        """``stream`` for asyncio: awaits outputs without blocking the event loop. Cancellation (the task, or
        leaving the loop early) cancels the request."""
        record = self._open(request_id)
        finished = False
        try:
            while not finished:
                output = await record.channel.aget()
                finished = output.finished
                yield output
        finally:
            self._close(request_id, finished)

    def result(self, request_id: str, timeout: float | None = None) -> GenerationResult:
        """Wait for the request to finish and return everything it produced. It reads the request's stream, so it is
        its one consumer: a ``TimeoutError`` (no output for ``timeout`` seconds) cancels the request, as leaving
        ``stream`` does, and the request cannot be read again."""
        record = self._records.get(request_id)
        for _ in self.stream(request_id, timeout):
            pass
        return record.processor.result()

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: a waiting one ends at once, a running one within one decode step; its cache and pages
        are freed before its final output (``cancelled``). False if it already finished or is unknown."""
        record = self._records.get(request_id)
        if record is None:
            return False
        with record.lock:
            if record.processor.finished:
                return False
            record.request.cancelled.set()
        self.engine.cancel(request_id)
        return True

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Admit nothing new; ``drain``: let every admitted request finish; else cancel them. Waits for the engine
        (``timeout`` seconds at most). Requests the engine could not finish end ``cancelled``."""
        with self._lock:
            self._stopped = True
        self.engine.stop(drain=drain, timeout=timeout)
        if self.engine.load().running == 0:  # the engine is done: nobody else will finish what is left
            for record in list(self._records.values()):
                self._finish(record, FinishReason.CANCELLED, "the manager stopped before this request finished")

    def __enter__(self) -> GenerationManager:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc) -> None:
        self.stop(drain=exc[0] is None)

    # ------------------------------------------------------------------------------------------------ metrics
    def metrics(self) -> ManagerMetrics:
        load = self.engine.load()
        counters = self._recorder.counters()
        free = total = free_slots = total_slots = None
        if self.pool is not None:
            free, total = self.pool.free_pages(), self.pool.total_pages()
            if self.pool.has_sliding_layers:
                free_slots, total_slots = self.pool.free_slots(), self.pool.total_slots()
        return ManagerMetrics(
            running=load.running, waiting=load.waiting, max_queue=load.max_queue, free_pages=free, total_pages=total,
            free_slots=free_slots, total_slots=total_slots,
            time_to_first_token=self._recorder.ttft.snapshot(),
            tokens_per_second=self._recorder.tokens_per_s.snapshot(),
            alive=load.alive and not self._stopped, **counters,
        )

    def healthy(self) -> bool:
        """The engine thread runs and the manager admits requests."""
        return not self._stopped and self.engine.load().alive

    # ------------------------------------------------------------------------------------------------ internals
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = encode_text(self.tokenizer, prompt)
        elif isinstance(prompt, (bytes, bytearray)):  # a Sequence of ints, but text by intent: never token ids
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__} "
                                 f"(decode it to a str first)", "prompt")
        elif isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
            ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
            if not isinstance(ids, list):  # a 0-d tensor or array: one id, not a prompt
                raise InvalidRequest(f"prompt must be a string or a list of token ids, got a single id {ids!r}",
                                     "prompt")
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                 "prompt")
        if not ids:
            raise InvalidRequest("prompt is empty (0 tokens)", "prompt")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]!r}",
                                 "prompt")
        return ids

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        prompt_len = len(prompt_ids)
        if prompt_len >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {prompt_len} tokens but the model's context is {self.max_model_len} tokens "
                f"(prompt + max_tokens must fit)", "prompt", "context_length_exceeded")
        if prompt_len + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of "
                f"{self.max_model_len} tokens; ask for at most {self.max_model_len - prompt_len} tokens",
                "max_tokens", "context_length_exceeded")
        check_fits = getattr(self.engine, "check_fits", None)  # the batching engine: the pool's pages
        if check_fits is not None:
            check_fits(prompt_len, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this manager has none (use stop_token_ids)", "stop")
        bad_ids = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_ids:
            raise InvalidRequest(f"stop_token_ids must be < the vocabulary size {self.vocab_size}, got {bad_ids}",
                                 "stop_token_ids")

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}", "request_id")
        return request_id

    def _on_event(self, event: EngineEvent) -> None:
        """The engine's sink: runs on the engine thread (or a canceller's), per request under its lock."""
        record = self._records.get(event.request_id)
        if record is None:
            return
        if event.token_ids:
            with record.lock:
                if record.processor.finished:
                    return  # ended by a stop string: the engine's remaining step is dropped
                output = record.processor.on_tokens(event.token_ids)
                if output.finished:
                    record.request.cancelled.set()  # a stop string: the engine stops within one step
                    self._observe(record)
                record.channel.push(output)
        if event.finish_reason is not None:
            self._finish(record, event.finish_reason, event.error)

    def _finish(self, record: _Record, reason: FinishReason, error: str | None) -> None:
        with record.lock:
            if record.processor.finished:
                return
            output = record.processor.on_finish(reason, error)
            self._observe(record)  # counted before its consumer can see the end (then reads the metrics)
            record.channel.push(output)
            abandoned = record.abandoned
        if abandoned:
            self._forget(record.request.request_id)

    def _observe(self, record: _Record) -> None:
        processor = record.processor
        timings = processor.timings()
        completion = len(processor.token_ids)
        self._recorder.finished(processor.finish_reason, completion, timings.ttft,
                                timings.decode_tokens_per_s(completion))

    def _open(self, request_id: str) -> _Record:
        with self._lock:
            record = self._records.get(request_id)
            if record is None:
                raise UnknownRequest(request_id)
            record.consume()
            return record

    def _close(self, request_id: str, finished: bool) -> None:
        record = self._records.get(request_id)
        if not finished and record is not None:  # the consumer left early: nobody reads the rest, stop computing it
            self.cancel(request_id)
            with record.lock:
                record.abandon()
                if not record.processor.finished:
                    return  # _finish drops the record when the engine's final event comes
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._records.pop(request_id, None)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """The model's EOS ids (generation config first, then the tokenizer's)."""
    value = getattr(model.generation_config, "eos_token_id", None)
    if value is None and tokenizer is not None:
        value = tokenizer.eos_token_id
    if value is None:
        return frozenset()
    return frozenset(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
