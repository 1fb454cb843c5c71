"""The engine interface: what the manager needs from whatever runs the model.

    engine.start(sink)            # the engine thread starts; every event goes to sink(EngineEvent)
    engine.submit(request)        # queue an EngineRequest, or raise Overloaded (queue full) / EngineStopped
    engine.cancel(request_id)     # a waiting request finishes "cancelled" at once; a running one within one step
    engine.load()                 # EngineLoad(running, waiting, alive, max_queue)
    engine.stop(drain=True)       # drain: finish everything admitted; else cancel it all; then join the thread

The contract an engine keeps, whatever its scheduling (one request at a time, or continuous batching over a block
pool with prefill interleaved with a bucketed compiled decode step):

* every submitted request gets exactly one final event (``finish_reason`` set), after which none of its events
  follow, and by then its cache and pool pages are released (so pool accounting read after the final event is
  exact);
* events of one request arrive in order; ``token_ids`` are new tokens only; a request's events may come from the
  engine thread (tokens, finishes) or from the caller of ``cancel``/``stop`` (a request cancelled while waiting);
* a request's ``cancelled`` flag (a ``threading.Event``) may be set by anyone at any time: the engine reads it at
  every step boundary and stops that request within one step; ``cancel(id)`` additionally drops a waiting request;
* a failure inside one request ends that request with ``error`` and never the engine thread;
* the sink is called without engine locks held and must not block for long (it runs on the engine's hot path).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..outputs import FinishReason
from ..sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One request as an engine sees it: token ids in, resolved limits, a cancel flag.

    max_new_tokens   = params.max_tokens (the manager has checked prompt + max_new_tokens against the context)
    stop_token_ids   ids that end the request: params.stop_token_ids plus the model's EOS ids unless ignore_eos
    cancelled        set by the manager (cancel, stop strings, client disconnect); read by the engine every step
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    cancelled: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class EngineEvent:
    """New tokens of one request, and/or its end. ``finish_reason`` None: the request goes on."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot: requests being decoded, requests waiting for admission, whether the engine thread lives."""

    running: int
    waiting: int
    alive: bool
    max_queue: int


EventSink = Callable[[EngineEvent], None]


@runtime_checkable
class Engine(Protocol):
    """What ``GenerationManager`` drives (see the module docstring for the contract)."""

    def start(self, sink: EventSink) -> None: ...

    def submit(self, request: EngineRequest) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def stop(self, drain: bool = True, timeout: float | None = None) -> None: ...
