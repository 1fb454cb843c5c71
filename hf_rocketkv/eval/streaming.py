"""StreamingLLM baseline (attention sinks + recent window) as a RocketKV cache whose stage 1 ignores scores.

Stage 1 keeps the first ``sink_tokens`` tokens of each row plus the most recent ``prompt_budget - sink_tokens``
(the recent part always contains the SnapKV observation window, so it is the same budget RocketKV keeps). Stage 2
is unchanged: with ``topk`` at least the number of pages it attends every kept token (see eval/methods.py).

Differences from the StreamingLLM paper, on purpose, so the comparison isolates *which* prompt tokens are kept:
eviction happens once after prefill like RocketKV's stage 1 (the window does not roll during decode), and kept tokens
keep their original positions (no re-rotation into the cache's own positions), as kvpress' StreamingLLMPress does.
"""

from __future__ import annotations

import functools

import torch

from ..cache.cache import RocketKVCache
from ..cache.layer import RocketKVLayer
from ..config import RocketKVConfig


def sink_recent_slots(start: int, end: int, budget: int, sink_tokens: int, heads: int, device) -> torch.Tensor:
    """Slots kept for one row, ``[heads, n]`` ascending: all when ``end - start <= budget``, else sinks + recent."""
    if end - start <= budget:
        slots = torch.arange(start, end, device=device)
    else:
        sinks = min(sink_tokens, budget)
        slots = torch.cat(
            [
                torch.arange(start, start + sinks, device=device),
                torch.arange(end - (budget - sinks), end, device=device),
            ]
        )
    return slots.expand(heads, slots.shape[0])


class StreamingLayer(RocketKVLayer):
    """A RocketKVLayer whose stage 1 keeps sink + recent tokens instead of the SnapKV choice."""

    def __init__(self, config: RocketKVConfig, hints, sink_tokens: int = 4):
        self.sink_tokens = sink_tokens
        super().__init__(config, hints)

    def reset(self) -> None:
        self.__init__(self.config, self.hints, self.sink_tokens)

    def compress(self) -> None:
        if self.compressed:  # a later turn: re-select among the stored tokens
            start, end, columns = torch.zeros_like(self.lengths), self.lengths, self.positions
        else:
            start, end, columns = self.row_start, torch.full_like(self.row_start, self.keys.shape[2]), None
        heads = self.keys.shape[1]
        kept = [
            sink_recent_slots(s, e, self.config.prompt_budget, self.sink_tokens, heads, self.device)
            for s, e in zip(start.tolist(), end.tolist())
        ]
        self._compact(kept, columns)
        self.pending_queries = None
        self.row_start = None


class StreamingCache(RocketKVCache):
    """``RocketKVCache`` built from StreamingLayer; needs the ``rocketkv`` attention like its parent."""

    def __init__(self, config: RocketKVConfig | None = None, sink_tokens: int = 4, **overrides):
        super().__init__(config, **overrides)
        self.sink_tokens = sink_tokens
        self.layer_class_to_replicate = functools.partial(StreamingLayer, self.config, self.hints, sink_tokens)

    def _init_kwargs(self) -> dict:
        return {"sink_tokens": self.sink_tokens}
