"""Random eviction (a floor for comparisons): every KV head keeps its window plus uniformly random prefix slots.

Seeded: the same seed and shapes give the same choice (each call draws from a fresh generator, so the result does
not depend on what ran before; layers with the same shapes therefore keep the same slots). The file is not named
``random.py`` so that it never shadows the standard library module. Cost: O(B Hkv N).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import KeptSlots, Stage1Inputs, select_by_scores


@dataclass(frozen=True)
class RandomPolicy:
    """Keep random prefix slots per KV head.

    Parameters
    ----------
    seed : int
        Seed of the generator (drawn on the CPU, then moved to the keys' device, so results match across devices).
    """

    seed: int = 0
    name: ClassVar[str] = "random"

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"RandomPolicy.seed must be an integer, got {self.seed!r}")

    def score(self, inputs: Stage1Inputs) -> torch.Tensor:
        """Uniform random fp32 ``[B, Hkv, N]``."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(inputs.keys.shape[:3], generator=generator).to(inputs.keys.device)

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        return select_by_scores(inputs, self.score, "RandomPolicy.score")
