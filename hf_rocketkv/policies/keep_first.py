"""Forced sinks for any stage-1 policy: ``KeepFirst(policy, tokens)`` keeps each row's first ``tokens`` slots.

Stage 2 can always attend a few sink tokens (``RocketKVConfig.stage2_sink_tokens``): the first pages of the
compacted store. Those pages hold the prompt's first tokens only if stage 1 kept them, so every policy must learn to
keep them. The mechanism is one field, ``Stage1Inputs.keep_first``, honoured by ``select_by_scores`` (every scorer:
snapkv, streaming, knorm, h2o, random, ScorerPolicy) and by AdaKV. This wrapper sets that field for the policy it
wraps and checks the result, so a policy with its own ``select`` that ignores the field fails loudly instead of
silently giving stage 2 the wrong sinks.

    policy = KeepFirst(SnapKVPolicy(), 4)          # or get_stage1_policy("snapkv", keep_first=4)

The cache layer wraps its policy this way from the config (``RocketKVConfig.stage1_keep_first``, i.e.
``stage2_sink_tokens`` with page selection on), so a cache needs no policy object for its sinks.

The wrapper forwards every other attribute (``name``, ``per_head_budgets``, ``new_state``, ``accumulate``) to the
wrapped policy, so ``hasattr(wrapper, "accumulate")`` is true exactly when it is for the policy.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import KeptSlots, Stage1Inputs


class KeepFirst:
    """``policy`` with the first ``tokens`` valid slots of every row over the budget always kept.

    Parameters
    ----------
    policy : a stage-1 policy object (``name`` + ``select``)
    tokens : int >= 0
        Slots kept at the start of each row (counted in the budget; at most ``budget - w_b`` of them).
    """

    def __init__(self, policy, tokens: int):
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"KeepFirst.tokens must be an integer >= 0, got {tokens!r}")
        if not callable(getattr(policy, "select", None)):
            raise ValueError(f"KeepFirst.policy must have a select(inputs) method, got {type(policy).__name__}")
        self.policy = policy
        self.tokens = tokens

    def __getattr__(self, attr: str):
        # only called for attributes not found on the wrapper itself: name, per_head_budgets, new_state, ...
        if attr in ("policy", "tokens"):
            raise AttributeError(attr)
        return getattr(self.policy, attr)

    def __repr__(self) -> str:
        return f"KeepFirst({self.policy!r}, tokens={self.tokens})"

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        inputs = dataclasses.replace(inputs, keep_first=max(inputs.keep_first, self.tokens))
        kept = self.policy.select(inputs)
        check_first_kept(inputs, kept, getattr(self.policy, "name", type(self.policy).__name__))
        return kept


def check_first_kept(inputs: Stage1Inputs, kept: list[KeptSlots], who: str) -> None:
    """Raise ValueError when a row over the budget lacks one of its forced first slots in some KV head."""
    for b, ((s, e, w), row) in enumerate(zip(inputs.rows(), kept)):
        if e - s <= inputs.budget:
            continue
        forced = inputs.forced_count(s, e, w)
        if forced == 0:
            continue
        first = torch.arange(s, s + forced, device=row.slots.device)
        # [Hkv, n, 1] == [forced]: the -1 padding of per-head counts never matches a slot
        present = (row.slots[:, :, None] == first).any(dim=1).all()
        if not bool(present):
            raise ValueError(
                f"stage-1 policy {who!r} did not keep the first {forced} slots of row {b} (Stage1Inputs.keep_first="
                f"{inputs.keep_first}); a policy with its own select() must keep slots start .. start + keep_first - 1 "
                f"(see select_by_scores)"
            )
