"""Key-norm eviction (as kvpress' Knorm): keep the keys with the smallest L2 norm.

Score of slot j for KV head h: ``-||k_hj||_2`` (computed in fp32), so low-norm keys rank first; the observation
window is kept as for every policy. Query-agnostic (``q_window`` is not read). Cost: O(B Hkv N D), no attention.
Why low norms: keys with a small norm tend to receive large attention (Devoto et al., 2024, "A Simple and Effective
L2 Norm-Based Strategy for KV Cache Compression").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import KeptSlots, Stage1Inputs, select_by_scores


@dataclass(frozen=True)
class KnormPolicy:
    """Keep the lowest-norm keys of each KV head (plus the window). No parameters."""

    name: ClassVar[str] = "knorm"

    def score(self, inputs: Stage1Inputs) -> torch.Tensor:
        """``-||k||_2`` per slot, fp32 ``[B, Hkv, N]``."""
        return -inputs.keys.float().norm(dim=-1)

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        return select_by_scores(inputs, self.score, "KnormPolicy.score")
