"""Hypothesis properties every stage-1 policy must satisfy, whatever the shapes:

uniform policies: per row and KV head the kept slots are ascending, unique, inside [start, end), end with the row's
observation window, and number min(valid, budget). adakv: the same per head, each head keeps at least its window,
and a row keeps Hkv * min(valid, budget) in total.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_rocketkv.policies import (
    AdaKVPolicy,
    H2OPolicy,
    KnormPolicy,
    RandomPolicy,
    ScorerPolicy,
    SnapKVPolicy,
    Stage1Inputs,
    StreamingPolicy,
)

UNIFORM = {
    "snapkv": SnapKVPolicy(kernel_size=3),
    "streaming": StreamingPolicy(sink_tokens=2),
    "knorm": KnormPolicy(),
    "h2o": H2OPolicy(block_size=4),
    "random": RandomPolicy(seed=1),
    "scorer": ScorerPolicy(lambda inputs: inputs.keys[..., 0].float(), name="first_channel"),
}


@st.composite
def problems(draw):
    """``(Stage1Inputs, queries [B, Hq, N, D])``: a random problem and a query for every slot (for H2O)."""
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    slots = draw(st.integers(1, 24))
    w = draw(st.integers(1, min(6, slots)))
    budget = draw(st.integers(w, slots + 3))
    starts = [draw(st.integers(0, slots - 1)) for _ in range(batch)]
    ends = [draw(st.integers(s + 1, slots)) for s in starts]
    window_len = draw(st.one_of(st.none(), st.lists(st.integers(0, w), min_size=batch, max_size=batch)))
    ties = draw(st.booleans())  # integer-valued keys make many exactly equal scores
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, kv_heads * group, slots, 4, generator=g)
    keys = torch.randn(batch, kv_heads, slots, 4, generator=g)
    if ties:
        keys = keys.round()
    start, end = torch.tensor(starts), torch.tensor(ends)
    window_slots = (end[:, None] - w + torch.arange(w)[None, :]).clamp(min=0)  # [B, w]; slots < 0 see no key anyway
    q_window = queries.gather(2, window_slots[:, None, :, None].expand(-1, queries.shape[1], -1, queries.shape[3]))
    window = torch.tensor(window_len) if window_len is not None else None
    inputs = Stage1Inputs(q_window, keys, start, end, budget=budget, scaling=0.5, window_len=window)
    return inputs, queries


def with_h2o_state(inputs: Stage1Inputs, queries: torch.Tensor) -> Stage1Inputs:
    """H2O's state after accumulating every query of each row (slots start..end-1; one call per row, since a layer
    passes one chunk whose queries end at every row's end)."""
    policy = UNIFORM["h2o"]
    per_row = []
    for b, (_, e, _) in enumerate(inputs.rows()):
        state = policy.new_state(1, inputs.num_kv_heads, "cpu")
        rows = slice(b, b + 1)
        policy.accumulate(state, queries[rows, :, :e], inputs.keys[rows], inputs.start[rows], inputs.end[rows], 0.5)
        per_row.append(state.scores)
    state = policy.new_state(len(per_row), inputs.num_kv_heads, "cpu")
    state.scores = torch.cat(per_row)
    return dataclasses.replace(inputs, state=state)


def row_facts(inputs: Stage1Inputs):
    for b, (s, e, w) in enumerate(inputs.rows()):
        yield b, s, e, (w if e - s > inputs.budget else 0), min(e - s, inputs.budget)


def assert_head_slots(slots: list[int], s: int, e: int, w: int) -> None:
    assert slots == sorted(slots) and len(set(slots)) == len(slots)
    assert all(s <= x < e for x in slots)
    assert slots[len(slots) - w :] == list(range(e - w, e))  # the observation window is always kept


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(sorted(UNIFORM)))
def test_uniform_policy_properties(problem, name):
    inputs = with_h2o_state(*problem) if name == "h2o" else problem[0]
    kept = UNIFORM[name].select(inputs)
    assert len(kept) == inputs.keys.shape[0]
    for b, s, e, w, count in row_facts(inputs):
        row = kept[b]
        assert row.uniform and row.slots.shape == (inputs.num_kv_heads, count)
        assert row.counts.tolist() == [count] * inputs.num_kv_heads
        for head_slots in row.slots.tolist():
            assert_head_slots(head_slots, s, e, w)


@settings(max_examples=30, deadline=None)
@given(problems())
def test_adakv_properties(problem):
    inputs = problem[0]
    kept = AdaKVPolicy(SnapKVPolicy(kernel_size=3)).select(inputs)
    for b, s, e, w, count in row_facts(inputs):
        row = kept[b]
        counts = row.counts.tolist()
        assert sum(counts) == inputs.num_kv_heads * count  # the same total as a uniform policy
        assert row.slots.shape == (inputs.num_kv_heads, max(counts))
        for h, head_slots in enumerate(row.slots.tolist()):
            assert counts[h] >= w and counts[h] <= e - s
            assert all(x == -1 for x in head_slots[counts[h] :])
            assert_head_slots(head_slots[: counts[h]], s, e, w)
