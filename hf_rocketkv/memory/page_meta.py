"""Host-side metadata of one physical page (device tier) or one host slot (host tier)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority on its 0..100 scale
LOADED_PREFIX_PRIORITY = 60  # prefixes loaded from files outlive ordinary cached prompts by default
MIN_PRIORITY, MAX_PRIORITY = 0, 100


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"


@dataclass(slots=True)
class PageMeta:
    """Mutable metadata of one page; owned by the pool and changed only under its lock.

    ref          block tables holding the page (host slots: always 0; a request never holds a host slot)
    hash         the chained prefix hash of the page's content, or None (private / unused)
    depth        the page's index in its prefix chain (0 = first page), -1 when unhashed
    priority     retention priority 0..100: lower is evicted first
    last_access  the pool's logical clock when the page was last taken or released
    pending      the copy event still using this physical page or slot (None: no copy in flight)
    released     CUDA event recorded on the compute stream when the page last became free: a copy that reads or
                 overwrites the page waits for it (not for the whole compute stream, so copies overlap compute)
    """

    index: int
    tier: Tier
    ref: int = 0
    hash: bytes | None = None
    depth: int = -1
    priority: int = DEFAULT_PRIORITY
    last_access: int = 0
    pending: Any = None
    released: Any = None

    @property
    def in_flight(self) -> bool:
        return self.pending is not None

    def forget(self) -> None:
        """Drop the content identity (the bytes stay until overwritten, but nothing can find them)."""
        self.hash = None
        self.depth = -1

    def name(self, page_hash: bytes, depth: int, priority: int, clock: int) -> None:
        """Give the page a content identity: its prefix hash, its depth in the chain and its retention priority."""
        self.hash, self.depth, self.priority = page_hash, depth, priority
        self.last_access = clock

    def take_identity(self, other: "PageMeta", clock: int | None = None) -> None:
        """The content identity of ``other`` (its bytes were copied here: an offload or an onload), not its
        references: a host slot holds none, a page onloaded from one is held by no table yet. Last accessed when
        ``other`` was (an offload), or at ``clock`` (an onload: now)."""
        self.hash, self.depth, self.priority = other.hash, other.depth, other.priority
        self.last_access = other.last_access if clock is None else clock
        self.ref = 0

    def take(self, clock: int) -> None:
        """One more table holds the page."""
        self.ref += 1
        self.last_access = clock

    def drop(self, clock: int) -> bool:
        """One table less holds the page; True when none does any more."""
        self.ref -= 1
        self.last_access = clock
        return self.ref == 0

    def mark_freed(self, event: Any) -> None:
        """The compute-stream event recorded when the page became free (a later copy waits for it)."""
        self.released = event

    def copying(self, event: Any) -> None:
        """A copy (``event``; None: synchronous) reads or writes the page until it completes."""
        self.pending = event

    def copied(self, event: Any) -> None:
        """``event`` completed: the page is no longer in flight unless a later copy uses it."""
        if self.pending is event:
            self.pending = None

    def clear_events(self) -> None:
        """No copy in flight and no release to wait for (every copy was synchronized)."""
        self.pending = self.released = None


@dataclass(frozen=True)
class PageInfo:
    """A read-only snapshot of a page's metadata (``KVBlockPool.page_info``)."""

    index: int
    tier: str
    ref: int
    hash: bytes | None
    depth: int
    priority: int
    last_access: int
    in_flight: bool
    free: bool

    @classmethod
    def of(cls, meta: PageMeta, free: bool) -> "PageInfo":
        return cls(meta.index, meta.tier.value, meta.ref, meta.hash, meta.depth, meta.priority, meta.last_access,
                   meta.in_flight, free)


def check_priority(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"{field} must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {value!r}")
    return value
