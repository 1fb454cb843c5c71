"""AdaKV-style head-adaptive budgets: the same total per row and layer, allotted across KV heads by score.

Each KV head keeps its observation window (``w_b`` tokens) and the row's first ``keep_first`` slots (stage 2's
sinks, see Stage1Inputs). The remaining ``Hkv * (budget - w_b - forced)`` slots of a row go
to the best prefix scores of the row *across all KV heads at once* (Feng et al., 2024, "Ada-KV"), so a head whose
attention is concentrated keeps few tokens and a head whose attention is spread keeps many. The total per row is
``Hkv * budget`` exactly like a uniform policy; each head keeps between ``w_b`` and ``w_b + (n - w_b)`` slots.
Scores come from a wrapped scorer (SnapKV by default: its scores are sums of softmax probabilities, comparable
across heads). Cost: the scorer's, plus one top-k over ``Hkv * n`` scores per row.

Output: per-head counts. ``KeptSlots.slots`` is ``[Hkv, n_max]`` with head h's ascending slots in
``[:counts[h]]`` and -1 after. ``RocketKVConfig(stage1="adakv")`` makes the cache layer store one length per row and
KV head (``lengths`` ``[B, Hkv]``, docs/policies.md "Per-head budgets in the cache"); a KVBlockPool refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .base import KeptSlots, Stage1Inputs, checked_scores, whole_row
from .snapkv import SnapKVPolicy


@dataclass(frozen=True)
class AdaKVPolicy:
    """Head-adaptive allocation of a uniform total budget.

    Parameters
    ----------
    scorer : object with ``score(inputs) -> [B, Hkv, N]``
        The per-slot scores to allot by (default: ``SnapKVPolicy()``). Its ``new_state``/``accumulate`` hooks, if
        any, are forwarded (so ``AdaKVPolicy(H2OPolicy())`` works).
    """

    scorer: Any = field(default_factory=SnapKVPolicy)
    name: ClassVar[str] = "adakv"
    per_head_budgets: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not callable(getattr(self.scorer, "score", None)):
            raise ValueError(
                f"AdaKVPolicy.scorer must have a score(inputs) -> [B, Hkv, N] method, got {type(self.scorer).__name__}"
            )

    def new_state(self, batch: int, num_kv_heads: int, device: torch.device):
        new_state = getattr(self.scorer, "new_state", None)
        return new_state(batch, num_kv_heads, device) if new_state is not None else None

    def accumulate(self, state, queries, keys, start, end, scaling) -> None:
        self.scorer.accumulate(state, queries, keys, start, end, scaling)

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        heads, device, budget = inputs.num_kv_heads, inputs.keys.device, inputs.budget
        scores = None
        if inputs.needs_selection():
            scores = checked_scores(self.scorer.score(inputs), inputs, "AdaKVPolicy.scorer.score")
        kept = []
        for b, (s, e, w) in enumerate(inputs.rows()):
            if e - s <= budget:
                kept.append(whole_row(s, e, heads, device))
            else:
                forced = inputs.forced_count(s, e, w)
                total = heads * (budget - w - forced)
                kept.append(allot_row(scores[b, :, s + forced : e - w], total, s, e, w, forced))
        return kept


def allot_row(
    prefix_scores: torch.Tensor, total: int, start: int, end: int, window: int, forced: int = 0
) -> KeptSlots:
    """Keep the ``total`` best of a row's ``[Hkv, n_selectable]`` scores (slots ``start + forced .. end - window - 1``)
    across heads, plus every head's first ``forced`` slots and its window.

    Returns per-head ascending slots padded with -1 (see the module docstring).
    """
    heads, n_prefix = prefix_scores.shape
    device = prefix_scores.device
    chosen = prefix_scores.contiguous().flatten().topk(total).indices
    keep = torch.zeros(heads * n_prefix, dtype=torch.bool, device=device)
    keep[chosen] = True
    always = lambda n: torch.ones(heads, n, dtype=torch.bool, device=device)  # noqa: E731
    keep = torch.cat([always(forced), keep.view(heads, n_prefix), always(window)], dim=1)
    counts = keep.sum(dim=1)
    # kept slots first in ascending order, then a sentinel past every slot, which becomes -1
    sentinel = end
    slots = torch.where(keep, torch.arange(start, end, device=device), sentinel).sort(dim=1).values
    slots = slots[:, : int(counts.max())]
    return KeptSlots(slots.masked_fill(slots == sentinel, -1), counts)
