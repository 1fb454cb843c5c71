"""Lockstep: the batching engine under tensor parallelism, every rank stepping with rank 0.

Under ``tp_plan="auto"`` every decoder layer ends in an all-reduce, so every rank must run the same forwards in the
same order: the same prefills and the same decode steps over the same rows. The engine's decisions (admission by
the pool's accounting, buckets, row moves, overlapped steps, the sampled tokens) are deterministic functions of what
it was given and of the logits, which are the same on every rank (the LM head's output is gathered). What differs
between ranks is only what arrives from outside: requests and cancellations, at times of their own.

So only rank 0 (the leader) takes requests. At the top of every engine iteration it sends the others an ``Inbox``
(the requests submitted since the previous one, the ids whose cancel flag was set, whether to exit), and every rank,
the leader included, applies that same inbox before the iteration. Cancel flags the engine reads are the engine's
own copies, set only when an inbox is applied; a client's flag set mid-iteration waits for the next inbox, so no
rank can see it earlier than another. A request without a sampling seed gets one drawn on the leader, so every rank
draws the same tokens.

An idle leader still sends an empty inbox every ``heartbeat_s`` seconds: the followers wait inside a collective, and
a collective that waits longer than its process group's timeout aborts the process.

The inboxes travel on a gloo process group (host memory, made here from the default group's ranks): they are small
Python objects, and the NCCL group stays for the model's tensors.

    # every rank, under torchrun, after from_pretrained(..., tp_plan="auto")
    engine = BatchingEngine(model, config, pool, lockstep=Lockstep())
    if engine.lockstep.is_leader:
        manager = GenerationManager(model, tokenizer, config, engine=engine, pool=pool)   # serve as usual
        ...
        manager.stop()                  # the followers' engines end too
    else:
        engine.follow()                 # steps with the leader until it stops

Every inbox carries the leader's engine state (inboxes applied, a CRC of its running and waiting request ids); a
follower whose own state differs stops with ``LockstepDiverged`` (``follow()`` raises it; ``hf-rocketkv serve``
exits 1, so torchrun stops every rank) rather than run forwards that no longer match the leader's.

Limits: a failure that happens on one rank only (an out-of-memory error on one GPU) is not shared. If it happens
outside the model's collectives, the next inbox shows the divergence; inside them, the other ranks wait in the
all-reduce until the process group's timeout. Run every rank with the same memory headroom.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from ..sampling import SamplingParams

DEFAULT_HEARTBEAT_S = 1.0
SEED_RANGE = 2**63 - 1  # a drawn seed is a non-negative 64-bit integer, as SamplingParams accepts


@dataclass(frozen=True)
class Submission:
    """A request as every rank rebuilds it (plain data: the cancel flag is each rank's own)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_token_ids: frozenset[int]


@dataclass
class Inbox:
    """What the leader sends before one engine iteration.

    ``state``: the leader's engine state before applying it (``engine_state``); a follower whose own state differs
    has diverged (a failure on one rank, or a decision that was not deterministic) and stops with
    ``LockstepDiverged`` instead of running forwards that no longer match the leader's."""

    submits: list[Submission] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    exit: bool = False  # the leader stopped and nothing is left: every rank's engine ends after this inbox
    state: tuple[int, int] | None = None

    def __bool__(self) -> bool:
        return bool(self.submits or self.cancels or self.exit)


class LockstepDiverged(RuntimeError):
    """A follower's engine no longer matches the leader's (raised by ``BatchingEngine.follow``)."""


def engine_state(inboxes: int, running_ids, waiting_ids) -> tuple[int, int]:
    """``(inboxes applied, CRC-32 of the running and waiting request ids in order)``: equal on every rank of a
    lockstep (zlib's CRC, not ``hash``: string hashes differ between processes)."""
    text = "\x1f".join(running_ids) + "\x1e" + "\x1f".join(waiting_ids)
    return inboxes, zlib.crc32(text.encode())


class Lockstep:
    """The leader's channel to the other ranks (see the module docstring).

    Args:
        src: the leader's global rank (default 0).
        heartbeat_s: longest time between two inboxes while the leader is idle (> 0, and well below the process
            group's timeout).
        group: the process group the inboxes travel on; default: a new gloo group over every rank (a collective
            call: build the ``Lockstep`` on every rank at the same point).
    """

    def __init__(self, src: int = 0, heartbeat_s: float = DEFAULT_HEARTBEAT_S, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Lockstep needs torch.distributed initialised (run under torchrun; from_pretrained(tp_plan='auto') "
                "initialises it)")
        if not isinstance(heartbeat_s, (int, float)) or isinstance(heartbeat_s, bool) or not heartbeat_s > 0:
            raise ValueError(f"Lockstep.heartbeat_s must be a number of seconds > 0, got {heartbeat_s!r}")
        world = dist.get_world_size()
        if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < world:
            raise ValueError(f"Lockstep.src must be a rank in [0, {world}), got {src!r}")
        self.src = src
        self.heartbeat_s = float(heartbeat_s)
        self.group = group if group is not None else _host_group()
        self.rank = dist.get_rank()
        self.world_size = world

    @property
    def is_leader(self) -> bool:
        return self.rank == self.src

    def exchange(self, inbox: Inbox | None) -> Inbox:
        """The leader's ``inbox`` on every rank (the leader passes it, the others None and wait for it)."""
        if self.is_leader and not isinstance(inbox, Inbox):
            raise TypeError(f"Lockstep.exchange: the leader must send an Inbox, got {type(inbox).__name__}")
        box = [inbox if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


def _host_group():
    """A gloo group over every rank (the default group itself when it is gloo already)."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def tensor_parallel_size(model) -> int:
    """Ranks the model is sharded over: transformers' public ``PreTrainedModel.tp_size`` (None before sharding)."""
    size = getattr(model, "tp_size", None)
    return size if isinstance(size, int) and size > 1 else 1


def check_lockstep_for(model, lockstep, engine: str) -> None:
    """An engine on a tensor-parallel model runs forwards whose collectives every rank must join: without a
    ``Lockstep`` each rank's engine would schedule on its own and the ranks would hang or compute garbage."""
    size = tensor_parallel_size(model)
    if size > 1 and lockstep is None:
        raise ValueError(
            f"{engine}: the model is sharded over {size} ranks (tp_plan; model.tp_size={size}), so every rank must run "
            f"the same forwards: use BatchingEngine(..., lockstep=hf_rocketkv.serving.Lockstep()) on every rank "
            f"(rank 0 serves, the others follow(); docs/parallel.md)")


def resolve_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a drawn seed when it samples without one, so that every rank draws the same tokens."""
    if params.is_greedy or params.seed is not None:
        return params
    return replace(params, seed=random.SystemRandom().randrange(SEED_RANGE))
