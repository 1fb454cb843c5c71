"""StreamingLLM (attention sinks + recent window): keep each row's first ``sink_tokens`` and its latest tokens.

Expressed as a score so it shares the selection of every scorer: the first ``sink_tokens`` valid slots of a row rank
above everything (earliest first), then slots rank by recency. A row longer than the budget therefore keeps
``min(sink_tokens, budget - w_b)`` sinks and the ``budget - sinks`` most recent tokens (which contain the
observation window). Query- and key-agnostic. Cost: O(B N).

Differences from the StreamingLLM paper, on purpose, so comparisons isolate *which* prompt tokens are kept: eviction
happens once after prefill like RocketKV's stage 1 (the window does not roll during decode), and kept tokens keep
their original positions (no re-rotation), as kvpress' StreamingLLMPress does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import KeptSlots, Stage1Inputs, select_by_scores


@dataclass(frozen=True)
class StreamingPolicy:
    """Attention sinks + recent tokens.

    Parameters
    ----------
    sink_tokens : int
        Tokens kept at the start of each row (4 in the StreamingLLM paper); 0 keeps only the most recent tokens.
    """

    sink_tokens: int = 4
    name: ClassVar[str] = "streaming"

    def __post_init__(self) -> None:
        if not isinstance(self.sink_tokens, int) or isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            raise ValueError(f"StreamingPolicy.sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")

    def score(self, inputs: Stage1Inputs) -> torch.Tensor:
        """float64 ``[B, Hkv, N]``: slot j scores j, a sink (``start <= j < start + sink_tokens``) scores
        ``2N - j``; exact integers, so there are no ties."""
        batch, heads, num_slots = inputs.keys.shape[:3]
        slot = torch.arange(num_slots, device=inputs.keys.device, dtype=torch.float64)
        offset = slot[None, :] - inputs.start[:, None].to(slot.dtype)  # [B, N]
        is_sink = (offset >= 0) & (offset < self.sink_tokens)
        scores = torch.where(is_sink, 2 * num_slots - slot[None, :], slot[None, :])
        return scores[:, None, :].expand(batch, heads, num_slots)

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        return select_by_scores(inputs, self.score, "StreamingPolicy.score")
