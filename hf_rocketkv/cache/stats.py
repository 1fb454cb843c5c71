"""``cache.stats``: what one RocketKVCache's request cost and reused (cumulative over its turns).

    reused_tokens    prompt tokens whose K/V came from the pool's prefix index instead of being computed
    computed_tokens  real (non-padding) tokens the model computed in prefill forwards (every turn; not decode)
    offloaded_bytes  bytes of cached prefix pages the pool moved to host memory to make room for this request
    onloaded_bytes   bytes of prefix pages the pool brought back from host memory for this request's hits
    pages_held       pool pages this request holds now (0 without a pool)
    slots_held       pool sliding-window slots this request holds now (one per row on a pool of a model with
                     sliding layers, else 0)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RequestCounters:
    """The mutable counters behind ``CacheStats`` (one per cache, shared with its layers and pool pages)."""

    reused_tokens: int = 0
    computed_tokens: int = 0
    offloaded_bytes: int = 0
    onloaded_bytes: int = 0

    def computed(self, tokens: int) -> None:
        """Prompt tokens a prefill forward computed (real ones: padding is not counted)."""
        self.computed_tokens += tokens

    def reused(self, tokens: int) -> None:
        """Prompt tokens a prefix hit served from the pool instead."""
        self.reused_tokens += tokens

    def moved(self, offloaded: int, onloaded: int) -> None:
        """Bytes of this request's pages copied to host memory and back."""
        self.offloaded_bytes += offloaded
        self.onloaded_bytes += onloaded

    def add_tokens(self, other: RequestCounters) -> None:
        """A row group's computed and reused tokens, taken over by the whole batch's cache."""
        self.computed_tokens += other.computed_tokens
        self.reused_tokens += other.reused_tokens


@dataclass(frozen=True)
class CacheStats:
    reused_tokens: int
    computed_tokens: int
    offloaded_bytes: int
    onloaded_bytes: int
    pages_held: int = 0
    slots_held: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
