"""The batching engine's side of a tensor-parallel lockstep: the inboxes it sends, receives and applies.

The protocol (``Lockstep``, ``Inbox``, why the ranks must step together) is serving/parallel/lockstep.py's. Here is what
one rank's engine does with it: on the leader, requests submitted and cancels asked for between two iterations wait in
an outbox, and the next inbox carries them; at the top of every iteration every rank gets that inbox (the leader
builds and sends it, the others receive it and check the leader's engine state against their own) and applies it
to its own queue, with cancel flags of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..batching.running import RunningRequest
from ..engines.interface import EngineEvent, EngineRequest
from ..errors import Overloaded
from ..outputs import FinishReason
from .lockstep import Inbox, Lockstep, LockstepDiverged, Submission, engine_state, resolve_seed


@dataclass(frozen=True)
class EngineQueue:
    """What the inboxes work on, handed over by their engine, which owns every piece:

        lock, wakeup   the engine's lock and its wake-up condition (on that lock)
        scheduler      its ``Scheduler`` of waiting, prefilling and decoding requests
        requests       request id -> ``RunningRequest``, submitted and not finished
        max_queue      ``BatchingConfig.max_queue``
        emit           sends an ``EngineEvent`` to the engine's sink
        closed         whether ``stop`` began
        refuse_new     (lock held) ``stop`` began: nothing new is admitted
    """

    lock: threading.Lock
    wakeup: threading.Condition
    scheduler: object
    requests: dict
    max_queue: int
    emit: Callable[[EngineEvent], None]
    closed: Callable[[], bool]
    refuse_new: Callable[[], None]


class LockstepInboxes:
    """One rank's engine in a ``Lockstep`` (see the module docstring).

    Owns the leader's outbox (requests submitted since the last inbox), the callers' cancel flags of requests not
    finished (the engine reads only its own copies of them) and the count of inboxes applied (the same on every
    rank). Works on the pieces of its engine's queue that the engine hands over (``EngineQueue``)."""

    def __init__(self, engine: EngineQueue, lockstep: Lockstep):
        self._engine = engine
        self.lockstep = lockstep
        self.outbox: list[EngineRequest] = []
        self._caller_flags: dict[str, threading.Event] = {}
        self.applied = 0  # inboxes applied (every rank counts the same)

    # ------------------------------------------------------------------------------------------------ the leader
    def submit(self, request: EngineRequest) -> None:
        """The leader's submit (engine lock held): the request waits for the next inbox, counted in the queue."""
        self._require_leader()
        if any(r.request_id == request.request_id for r in self.outbox):
            raise ValueError(f"request id {request.request_id!r} is already admitted")
        engine = self._engine
        waiting = len(engine.scheduler.waiting) + len(self.outbox)
        if waiting >= engine.max_queue:
            raise Overloaded(waiting, engine.max_queue)
        self.outbox.append(request)
        self._caller_flags[request.request_id] = request.cancelled

    def cancel(self, request_id: str) -> None:
        """The leader's cancel: a request not sent yet ends here; a sent one is cancelled through the next inbox."""
        self._require_leader()
        engine = self._engine
        with engine.lock:
            flag = self._caller_flags.get(request_id)
            if flag is not None:
                flag.set()  # a sent request: the next inbox carries the cancel
            pending = next((r for r in self.outbox if r.request_id == request_id), None)
            if pending is not None:  # not sent: it never reaches any rank
                self.outbox.remove(pending)
                del self._caller_flags[request_id]
            engine.wakeup.notify()
        if pending is not None:
            engine.emit(EngineEvent(request_id, finish_reason=FinishReason.CANCELLED))

    def stop(self, drain: bool) -> list[EngineRequest]:
        """The leader's stop: nothing new is taken, and unless ``drain`` every request is cancelled (those not sent
        are returned, they end on the caller's thread). A follower ends with the leader's last inbox instead."""
        if not self.lockstep.is_leader:
            return []
        engine = self._engine
        with engine.lock:
            engine.refuse_new()
            dropped = [] if drain else list(self.outbox)
            if not drain:
                self.outbox.clear()
                for request in dropped:
                    self._caller_flags.pop(request.request_id, None)
                for flag in self._caller_flags.values():
                    flag.set()  # sent as cancels with the next inbox
            engine.wakeup.notify_all()
        return dropped

    def _require_leader(self) -> None:
        if not self.lockstep.is_leader:
            raise RuntimeError(
                f"this rank ({self.lockstep.rank}) follows rank {self.lockstep.src} in lockstep: only the leader "
                f"takes requests (submit/cancel); call follow() here")

    # ------------------------------------------------------------------------------------------------ every rank
    def next(self) -> Inbox:
        """The inbox of this iteration on every rank: the leader builds and sends it (waiting while idle, at most a
        heartbeat), the others receive it."""
        if not self.lockstep.is_leader:
            inbox = self.lockstep.exchange(None)
            mine = self.state()
            if inbox.state != mine:
                raise LockstepDiverged(
                    f"rank {self.lockstep.rank} no longer matches rank {self.lockstep.src}: (inboxes, CRC of request "
                    f"ids) {mine} here, {inbox.state} on the leader; a failure on one rank only (see its log) or a "
                    f"decision that is not deterministic. Restart every rank")
            return inbox
        engine = self._engine
        with engine.lock:
            if engine.scheduler.idle() and not self.outbox and not engine.closed():
                engine.wakeup.wait(self.lockstep.heartbeat_s)
            inbox = self._take()
        return self.lockstep.exchange(inbox)

    def _take(self) -> Inbox:
        """(engine lock held) The requests submitted since the last inbox (sampling seeds drawn here), the ids
        whose caller's flag is set, and whether every engine ends now."""
        engine = self._engine
        submits = [Submission(r.request_id, r.prompt_ids, resolve_seed(r.params), r.stop_token_ids)
                   for r in self.outbox]
        self.outbox.clear()
        sent_now = {s.request_id for s in submits}
        cancels = []
        for request_id, flag in list(self._caller_flags.items()):
            sent = request_id in engine.requests or request_id in sent_now
            if not sent or flag.is_set():  # finished, or cancelled once and for all
                del self._caller_flags[request_id]
            if sent and flag.is_set():
                cancels.append(request_id)
        exit_now = engine.closed() and engine.scheduler.idle() and not submits
        return Inbox(submits, cancels, exit_now, self.state())

    def state(self) -> tuple[int, int]:
        """This engine's ``engine_state``: inboxes applied and a CRC of its running and waiting request ids."""
        scheduler = self._engine.scheduler
        return engine_state(self.applied, [r.request_id for r in scheduler.rows + scheduler.prefilling],
                            [r.request_id for r in scheduler.waiting])

    def apply(self, inbox: Inbox) -> bool:
        """Every rank: the inbox's requests join the queue with cancel flags of this engine's own, its cancels set
        them (the iteration ends those requests). False once the leader said to exit."""
        engine = self._engine
        with engine.lock:
            for sub in inbox.submits:
                running = RunningRequest(EngineRequest(sub.request_id, sub.prompt_ids, sub.params,
                                                       sub.stop_token_ids))
                engine.scheduler.submit(running)  # never QueueFull: the leader counted its outbox against max_queue
                engine.requests[sub.request_id] = running
            for request_id in inbox.cancels:
                running = engine.requests.get(request_id)
                if running is not None:
                    running.request.cancelled.set()
            self.applied += 1
        return not inbox.exit
