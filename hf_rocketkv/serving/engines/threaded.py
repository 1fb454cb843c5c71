"""ThreadedEngine: what every engine of this package shares around the one thread that owns the model.

Both engines run every forward on a thread of their own (compiled and CUDA-graph state is thread-local in torch, and
a model is not safe to run from two threads), so the caller-facing half of the ``Engine`` interface (engine.py) is
the same for both: start the thread, keep the registry of requests submitted and not finished under one lock, refuse
what cannot be queued, cancel a waiting request on the caller's thread, stop (draining or cancelling), report the
load, and send events so that a failing sink never reaches the engine thread. What differs, how requests wait and how
the thread serves them, is each engine's: the hooks below.
"""

from __future__ import annotations

import logging
import threading

import torch

from ...integration.decode_graphs import on_device
from ..errors import EngineStopped
from ..outputs import FinishReason
from .interface import EngineEvent, EngineLoad, EngineRequest, EventSink


class ThreadedEngine:
    """The thread, the request registry and the interface methods of an engine (see the module docstring).

    Owns: ``_thread`` (started once by ``start``), ``_sink``, ``_requests`` (request id -> the engine's entry for a
    request submitted and not finished; an entry has ``request_id`` and ``cancelled``), ``_lock`` guarding the
    registry and the engine's queue, ``_wakeup`` (a condition on that lock the engine thread may wait on) and
    ``_closed`` (``stop`` began). A subclass sets ``device`` (the thread runs with it as the current device) and
    gives:

        _loop()                the thread's body, run with grad off and ``device`` current
        _enqueue(request)      (lock held) queue a new request or raise (``_refuse_when_closed``,
                               ``_refuse_duplicate``, in the engine's order); returns its registry entry (None: not
                               registered here, e.g. held for a lockstep inbox)
        _drop_waiting(id)      (lock held) remove a request that has not started; returns its entry or None
        _close(drain)          refuse new requests (``_closed``); unless ``drain``, cancel everything admitted;
                               returns the requests dropped before they started (``stop`` sends their final events)
        _queue_load()          (lock held) ``(running, waiting, max_queue)``
    """

    _thread_name = "hf-rocketkv-engine"
    _log_name = "hf_rocketkv engine"  # the prefix of this engine's log messages
    _logger = logging.getLogger(__name__)

    device: torch.device

    def __init__(self) -> None:
        self._requests: dict = {}  # submitted, not finished
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._closed = False
        self._sink: EventSink | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------ interface
    def start(self, sink: EventSink) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__}.start: already started")
        self._sink = sink
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def submit(self, request: EngineRequest) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise EngineStopped("the engine is not running (never started, stopped, or its thread ended)")
        with self._lock:
            entry = self._enqueue(request)  # Overloaded / EngineStopped / ValueError propagate: nothing recorded
            if entry is not None:
                self._requests[request.request_id] = entry
            self._wakeup.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None:
                return  # finished already, or never admitted: nothing to do
            entry.cancelled.set()  # an admitted one stops at its next step boundary
            dropped = self._drop_waiting(request_id)
            if dropped is not None:
                del self._requests[request_id]
            self._wakeup.notify()
        if dropped is not None:  # it never ran: it ends here, on the caller's thread
            self._emit(EngineEvent(request_id, finish_reason=FinishReason.CANCELLED))

    def load(self) -> EngineLoad:
        with self._lock:
            running, waiting, max_queue = self._queue_load()
        alive = self._thread is not None and self._thread.is_alive() and not self._closed
        return EngineLoad(running=running, waiting=waiting, alive=alive, max_queue=max_queue)

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Admit nothing new; ``drain``: finish every admitted request; else cancel them all. Joins the thread."""
        for request in self._close(drain):
            request.cancelled.set()
            self._emit(EngineEvent(request.request_id, finish_reason=FinishReason.CANCELLED))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------------ helpers
    def _refuse_duplicate(self, request: EngineRequest) -> None:
        """(lock held) A request id names one request until its final event."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already admitted")

    def _refuse_new(self) -> None:
        """(lock held) ``stop`` began: no request is queued from now on."""
        self._closed = True

    def _refuse_when_closed(self) -> None:
        """(lock held) No request is queued once ``stop`` began."""
        if self._closed:
            raise EngineStopped("the engine is stopping or stopped; no new requests are admitted")

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is thread-local: this thread never builds autograd graphs
        with on_device(self.device):  # this thread's current CUDA device: the model's GPU
            self._loop()

    def _emit(self, event: EngineEvent) -> None:
        """Send to the sink; a failing sink is logged and never reaches the engine thread."""
        try:
            self._sink(event)
        except Exception:  # noqa: BLE001
            self._logger.exception("%s: the event sink failed on %s", self._log_name, event)

    # ------------------------------------------------------------------------------------------------ hooks
    def _loop(self) -> None:
        raise NotImplementedError

    def _enqueue(self, request: EngineRequest):
        raise NotImplementedError

    def _drop_waiting(self, request_id: str):
        raise NotImplementedError

    def _close(self, drain: bool) -> list:
        raise NotImplementedError

    def _queue_load(self) -> tuple[int, int, int]:
        raise NotImplementedError
