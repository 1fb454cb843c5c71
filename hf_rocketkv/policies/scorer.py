"""A user-defined stage-1 policy from one scoring function.

    def value_norm(inputs):                       # inputs: hf_rocketkv.policies.Stage1Inputs
        return inputs.keys.float().norm(dim=-1)   # [B, Hkv, N], higher = keep

    config = RocketKVConfig(stage1=ScorerPolicy(value_norm, name="key_norm_high"))

``fn(inputs)`` returns floating scores ``[B, Hkv, N]`` for every stored slot (higher = keep); only each row's prefix
slots ``[start, end - w_b)`` are read. Every KV head then keeps its observation window plus its ``budget - w_b`` best
prefix slots, like the built-in scorers. ``fn`` runs only when some row exceeds the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .base import KeptSlots, Stage1Inputs, select_by_scores


@dataclass(frozen=True)
class ScorerPolicy:
    """Stage 1 from a scoring function.

    Parameters
    ----------
    fn : callable
        ``fn(inputs: Stage1Inputs) -> Tensor [B, Hkv, N]`` (floating; higher = keep).
    name : str
        Shown in reports and errors.
    """

    fn: Callable[[Stage1Inputs], torch.Tensor]
    name: str = "custom"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"ScorerPolicy.fn must be callable (inputs -> [B, Hkv, N] scores), got {self.fn!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ScorerPolicy.name must be a non-empty string, got {self.name!r}")

    def score(self, inputs: Stage1Inputs) -> torch.Tensor:
        return self.fn(inputs)

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        return select_by_scores(inputs, self.score, f"ScorerPolicy({self.name!r}).fn")
