"""get_stage1_policy and the KeepFirst wrapper: the keyword settings reach the policies they feed, one wrapper is
kept, refusals name what was given, and KeepFirst's check of the forced first slots catches a policy that drops
them (in any row over the budget, in any KV head)."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv.policies import KeptSlots, Stage1Inputs, get_stage1_policy
from hf_rocketkv.policies.keep_first import KeepFirst
from hf_rocketkv.policies.knorm import KnormPolicy


def test_keywords_reach_the_named_policies():
    def window_scores(*args, **kwargs):
        raise AssertionError("not called here")

    assert get_stage1_policy("streaming").sink_tokens == 4
    snapkv = get_stage1_policy("snapkv", kernel_size=5, window_scores_fn=window_scores)
    assert (snapkv.kernel_size, snapkv.scores_fn) == (5, window_scores)
    adakv = get_stage1_policy("adakv", kernel_size=9, window_scores_fn=window_scores)
    assert (adakv.scorer.kernel_size, adakv.scorer.scores_fn) == (9, window_scores)


def test_one_wrapper_and_refusals():
    wrapped = KeepFirst(KnormPolicy(), 3)
    assert get_stage1_policy(wrapped, keep_first=3) is wrapped  # already forces as many
    assert get_stage1_policy(wrapped, keep_first=4).tokens == 4
    with pytest.raises(ValueError, match=r"^unknown stage-1 policy 'nope'; allowed: \['snapkv', "):
        get_stage1_policy("nope")
    with pytest.raises(ValueError, match=r"^a stage-1 policy must be one of \['snapkv', .*method, got int$"):
        get_stage1_policy(3)


def test_keep_first_attributes_of_a_bare_wrapper():
    """A wrapper without its fields (as copy / pickle build one) answers AttributeError, not a recursion."""
    bare = KeepFirst.__new__(KeepFirst)
    with pytest.raises(AttributeError, match=r"^policy$"):
        _ = bare.name
    with pytest.raises(AttributeError, match=r"^tokens$"):
        _ = bare.tokens


class DropsSlot:
    """A policy (no ``name``) that keeps every slot of each row but ``drop`` in head ``head`` of row ``row``."""

    def __init__(self, row: int, head: int, drop: int):
        self.row, self.head, self.drop = row, head, drop

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        kept = []
        for b, (s, e, _) in enumerate(inputs.rows()):
            slots = torch.arange(s, e).expand(inputs.num_kv_heads, e - s).clone()
            if b == self.row:
                slots[self.head, self.drop - s] = e - 1  # a duplicate of the last slot instead of ``drop``
            kept.append(KeptSlots(slots, None))
        return kept


def inputs(budget: int) -> Stage1Inputs:
    """Two rows, 2 KV heads, window 2: row 0 holds 4 tokens (within the budget), row 1 holds 12 (over it)."""
    keys = torch.zeros(2, 2, 12, 4)
    return Stage1Inputs(torch.zeros(2, 2, 2, 4), keys, torch.tensor([8, 0]), torch.tensor([12, 12]), budget=budget,
                        scaling=1.0)


@pytest.mark.parametrize("tokens, drop", [(1, 0), (3, 2)])
def test_keep_first_check_finds_a_dropped_first_slot_in_a_later_row_and_head(tokens, drop):
    """Row 1, head 1 lacks first slot ``drop`` (< tokens): refused naming the policy's type and the row; row 0,
    within the budget, is not checked. Dropping a slot past the first ``tokens`` is fine."""
    with pytest.raises(ValueError, match=rf"^stage-1 policy 'DropsSlot' did not keep the first {tokens} slots of row 1"):
        KeepFirst(DropsSlot(1, 1, drop), tokens).select(inputs(budget=6))
    KeepFirst(DropsSlot(1, 1, tokens), tokens).select(inputs(budget=6))


def test_adakv_names_its_scorer_when_the_scores_are_misshaped():
    from hf_rocketkv.policies import AdaKVPolicy, ScorerPolicy

    bad = AdaKVPolicy(ScorerPolicy(lambda inputs: torch.zeros(1), name="bad"))
    with pytest.raises(ValueError, match=r"^AdaKVPolicy\.scorer\.score must return floating scores of shape"):
        bad.select(inputs(budget=6))
