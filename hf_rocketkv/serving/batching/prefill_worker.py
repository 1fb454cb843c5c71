"""Prefills beside the decode steps: one host thread and one CUDA stream of their own
(``BatchingConfig.concurrent_prefill_tokens``).

Without it the engine thread runs a prefill chunk between two decode steps, so every chunk's forward (tens of ms for
a few hundred tokens of a long prompt: kernel launches of an eager forward and attention over the prefix) is a gap
in every running request's tokens. Here the engine thread hands an admitted request to this worker and goes on
decoding; the worker prefills it chunk by chunk (``ChunkedPrefill``, its own pool-backed cache, as the engine would)
on a stream of the lowest priority while the decode steps' graphs replay on a stream of the highest, so the GPU runs
both at once and hands its SMs to decode kernels first. When the prompt's last chunk is in, the worker records an
event on its stream and hands back the last logits; the engine thread makes its stream wait for that event, samples
the first token and the request joins the decoding rows.

Who touches what: the worker only ever touches the requests it holds (their cache and prefill), from ``submit`` to
the engine thread's ``take_done``; everything else (the scheduler, the batch, events to the client, releasing a
request) stays on the engine thread. The pool is shared (its lock guards every public method). Pages the engine frees
were last used by decode steps already read back, so the worker may write them at once; pages and tensors the worker
fills are used by the engine only after the event. A CUDA graph capture must not meet another thread's CUDA calls:
the worker holds ``capture_lock`` around each chunk and the engine takes it around a step that captures.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from .running import RunningRequest

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillResult:
    """A request handed back: ``logits`` ``[1, V]`` of its prompt's last position (None: cancelled between chunks,
    or failed: ``error``), the event recorded after its last chunk on the worker's stream (None on the CPU), and its
    chunks and host seconds."""

    running: RunningRequest
    logits: torch.Tensor | None
    error: str | None
    event: torch.cuda.Event | None
    chunks: int
    seconds: float

    def wait(self) -> None:
        """Make the caller's current stream wait for this prefill's device work (its pages, cache and logits)."""
        if self.event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.event)
            self.logits.record_stream(stream)


class PrefillWorker:
    """The thread that prefills the requests the engine hands it, one after another (see the module docstring).

    Args:
        admission: the engine's ``PoolAdmission`` (``start_prefill`` gives a request its cache and enters it).
        chunk_tokens: tokens per forward while rows decode (``concurrent_prefill_tokens``).
        idle_chunk_tokens: tokens per forward while none does (``prefill_chunk_tokens``: throughput).
        device: the model's device; on CUDA the worker runs on a stream of the lowest priority.
        notify: called (from the worker thread) after a request is handed back: wakes the engine thread.
    """

    def __init__(self, admission, chunk_tokens: int, idle_chunk_tokens: int, device: torch.device, notify):
        self._admission = admission
        self.chunk_tokens, self.idle_chunk_tokens = chunk_tokens, idle_chunk_tokens
        self.device = device
        self._notify = notify
        self.rows_decoding = 0  # the engine thread's rows decoding (``decoding``): the chunk size follows it
        self.capture_lock = threading.Lock()
        self.stream = self.decode_stream = None
        if device.type == "cuda":
            lowest, highest = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(device, priority=lowest)
            self.decode_stream = torch.cuda.Stream(device, priority=highest)
        self._jobs: queue.SimpleQueue[RunningRequest | None] = queue.SimpleQueue()
        self._done: list[PrefillResult] = []
        self._held: set[int] = set()  # id() of the requests submitted and not taken back yet
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- engine thread
    def start(self, graphs=None) -> None:
        """Start the thread; ``graphs`` (a ``PrefillGraphs``, or None) is built on it first."""
        self._thread = threading.Thread(target=self._run, args=(graphs,), name="hf-rocketkv-prefill", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread after the request it is on (the engine cancels what it must first)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def submit(self, running: RunningRequest) -> None:
        with self._lock:
            self._held.add(id(running))
        self._jobs.put(running)

    def holds(self, running: RunningRequest) -> bool:
        """Whether ``running`` is with the worker (submitted, not taken back): the engine must not release it."""
        with self._lock:
            return id(running) in self._held

    def busy(self) -> bool:
        with self._lock:
            return bool(self._held)

    def has_results(self) -> bool:
        """Whether a request was handed back and not taken yet."""
        with self._lock:
            return bool(self._done)

    def take_done(self) -> list[PrefillResult]:
        """The requests handed back since the last call, in order; they are the engine's again."""
        with self._lock:
            done, self._done = self._done, []
            for result in done:
                self._held.discard(id(result.running))
        return done

    def decode_stream_context(self):
        """The engine thread's stream while it serves: the highest priority, after the caller's work so far (the
        warm-up's captures and buffers) on the default stream."""
        if self.decode_stream is None:
            return contextlib.nullcontext()
        self.decode_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.decode_stream)

    # ------------------------------------------------------------------------------------------- worker thread
    def _run(self, graphs) -> None:
        try:
            torch.set_grad_enabled(False)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                if graphs is not None:
                    graphs.build(self.capture_lock)  # this thread prefills: cuDNN's graphs are per thread
                while (running := self._jobs.get()) is not None:
                    result = self._prefill(running)
                    with self._lock:
                        self._done.append(result)
                    self._notify()
        finally:
            if graphs is not None:
                graphs.release()  # (the engine's start() never waits on a thread that ended)

    def decoding(self, rows: int) -> None:
        """The engine thread's rows decoding now (each iteration): with none, the chunks grow to the idle size."""
        self.rows_decoding = rows

    def _chunk(self) -> int:
        return self.chunk_tokens if self.rows_decoding else self.idle_chunk_tokens

    def _prefill(self, running: RunningRequest) -> PrefillResult:
        started = time.perf_counter()
        chunks, logits, error, event = 0, None, None, None
        try:
            tokens = self._chunk()
            with self.capture_lock:
                prefill = running.prefill or self._admission.start_prefill(running, tokens)
            while logits is None:  # as the engine thread would: chunks until the last one returns the logits
                if running.request.cancelled.is_set():
                    prefill.abort()  # without stage 1; the engine releases the request
                    break
                with self.capture_lock:
                    logits = prefill.run(tokens)
                chunks += 1
                tokens = self._chunk()
            if logits is not None and self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        except Exception as err:  # noqa: BLE001 - one request's failure ends that request only
            logger.warning("hf_rocketkv batching engine: request %s failed in prefill: %s", running.request_id, err,
                           exc_info=True)
            error, logits = f"{type(err).__name__}: {err}", None
        return PrefillResult(running, logits, error, event, chunks, time.perf_counter() - started)
