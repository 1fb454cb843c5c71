"""Every stage-1 policy against a brute-force float64 oracle written from its definition (tests/policies/oracle.py),
over random shapes: GQA ratios 1-8, left padding, rows shorter than the budget, windows longer than a row, per-row
window lengths, dense and compressed (per-row end) stores.
"""

from __future__ import annotations

import random

import pytest
import torch

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
from hf_rocketkv.policies.adakv import allot_row
from hf_rocketkv.selection.stage1_snapkv import snapkv_keep_slots
from tests.policies import oracle
from tests.policies.oracle import (
    assert_top_up_to_ties,
    assert_uniform_selection,
    random_case,
)

SEEDS = range(16)


def kernel_for(seed: int) -> int:
    return random.Random(seed).choice([1, 3, 5, 7])


# ------------------------------------------------------------------------------------------------ snapkv
@pytest.mark.parametrize("seed", SEEDS)
def test_snapkv_gives_exactly_todays_kept_slots(seed):
    """Without window_len the policy is today's selection/stage1_snapkv.snapkv_keep_slots, slot for slot."""
    case = random_case(seed, with_window_len=False)
    kernel = kernel_for(seed)
    kept = SnapKVPolicy(kernel_size=kernel).select(case.inputs())
    today = snapkv_keep_slots(
        case.q_window(), case.keys, torch.tensor(case.start), torch.tensor(case.end), window_size=case.w,
        prompt_budget=case.budget, kernel_size=kernel, scaling=case.scaling,
    )
    assert [row.slots.tolist() for row in kept] == [t.tolist() for t in today]


@pytest.mark.parametrize("seed", SEEDS)
def test_snapkv_matches_oracle(seed):
    case = random_case(seed)
    kernel = kernel_for(seed)
    kept = SnapKVPolicy(kernel_size=kernel).select(case.inputs())
    assert_uniform_selection(case, kept, lambda c, b: oracle.snapkv_prefix_scores(c, b, kernel))


@pytest.mark.parametrize("seed", range(24))
def test_snapkv_pooled_scores_equal_the_oracle_at_every_prefix_slot(seed):
    """The scores the package selects by (``SnapKVPolicy.score``: the cache's stage 1) against the oracle's pooled
    prefix scores, slot by slot, not only through a top-k: window attention over the prefix summed over the window
    and the GQA group, max-pooled over the row's prefix ``[start, end - w_b)`` only (kernels up to wider than the
    prefix), -inf everywhere else. A pooling that lets the window's scores leak into the prefix edge changes the
    last ``kernel // 2`` prefix values even when the top-k set survives."""
    case = random_case(seed, max_slots=48)
    kernel = random.Random(seed).choice([3, 5, 7, 9, 15, 63])
    inputs = case.inputs()
    scores = SnapKVPolicy(kernel_size=kernel).score(inputs).double()
    for b in range(len(case.start)):
        if not case.selects(b):
            continue
        s, e, w = case.start[b], case.end[b], case.window_of(b)
        expected = torch.tensor(oracle.snapkv_prefix_scores(case, b, kernel), dtype=torch.float64)
        torch.testing.assert_close(scores[b, :, s : e - w], expected, rtol=1e-5, atol=1e-6)
        assert torch.all(scores[b, :, :s] == float("-inf")) and torch.all(scores[b, :, e - w :] == float("-inf"))


def hand_made_scores(raw, starts):
    """A ``scores_fn`` returning fixed raw window scores: row b of ``raw`` ``[B, Hkv, N]`` for the row starting at
    ``starts[b]`` (the policy scores rows of each window length in a call of their own)."""
    return lambda q_window, keys, start, end, scaling: raw[[starts.index(s) for s in start.tolist()]].clone()


def test_snapkv_pooling_never_sees_the_window_or_the_padding():
    """Hand-made raw scores (one KV head), pooled by hand with kernel 5 (reach 2), each row over its prefix only.

    Row 0: prefix 0-15 at 0.1 with peaks 0.4 at slot 0 and 1.0 at slot 7; window 16-19 (4 queries) at 9.0.
    Row 1: left padding 0-2 at 7.0 (garbage no pooling may read), prefix 3-17 at 0.1 with peaks 0.5 at slots 6 and
    12; window 18-19 (``window_len`` 2) at 9.0.
    Pooled: row 0 is 0.4 at 0-2, 1.0 at 5-9, 0.1 at 3-4 and 10-15 (14, 15 beside the window included); row 1 is 0.5
    at 4-8 and 10-14, 0.1 at 3, 9 and 15-17 (3 beside the padding, 16-17 beside the window included). Budget 12:
    row 0 keeps its 8 raised slots and its window, row 1 its 10 and its window. A pooling that reads the window or
    the padding raises the edge slots to 9.0 / 7.0 and keeps them instead."""
    raw = torch.full((2, 1, 20), 0.1)
    raw[0, 0, 0], raw[0, 0, 7], raw[0, 0, 16:] = 0.4, 1.0, 9.0
    raw[1, 0, :3], raw[1, 0, 6], raw[1, 0, 12], raw[1, 0, 18:] = 7.0, 0.5, 0.5, 9.0
    policy = SnapKVPolicy(kernel_size=5, scores_fn=hand_made_scores(raw, [0, 3]))
    inputs = Stage1Inputs(torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 20, 8), torch.tensor([0, 3]),
                          torch.tensor([20, 20]), budget=12, scaling=1.0, window_len=torch.tensor([4, 2]))
    inf = float("-inf")
    row0 = [0.4] * 3 + [0.1] * 2 + [1.0] * 5 + [0.1] * 6 + [inf] * 4
    row1 = [inf] * 3 + [0.1] + [0.5] * 5 + [0.1] + [0.5] * 5 + [0.1] * 3 + [inf] * 2
    pooled = policy.score(inputs)
    torch.testing.assert_close(pooled[:, 0], torch.tensor([row0, row1]))
    kept = policy.select(inputs)
    assert kept[0].slots.tolist() == [[0, 1, 2, 5, 6, 7, 8, 9, 16, 17, 18, 19]]
    assert kept[1].slots.tolist() == [[4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 18, 19]]


def test_snapkv_scores_only_rows_over_the_budget():
    """A row of at most ``budget`` tokens is kept whole and scores -inf at every slot, also with left padding (3
    slots here, so start + end exceeds the budget); the row one token over it is pooled over its prefix."""
    raw = torch.rand(2, 1, 16)
    policy = SnapKVPolicy(kernel_size=3, scores_fn=lambda *args: raw.clone())
    inputs = Stage1Inputs(torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 16, 8), torch.tensor([3, 3]),
                          torch.tensor([13, 14]), budget=10, scaling=1.0)
    pooled = policy.score(inputs)
    assert bool(torch.isneginf(pooled[0]).all())  # 10 tokens, budget 10
    assert bool(torch.isfinite(pooled[1, :, 3:10]).all())  # 11 tokens: the prefix 3-9 before the window of 4
    assert bool(torch.isneginf(pooled[1, :, :3]).all()) and bool(torch.isneginf(pooled[1, :, 10:]).all())


def test_snapkv_window_len_equals_a_shorter_window():
    """A row with window_len n scores exactly as that row alone with only its last n window queries."""
    case = random_case(3, max_batch=1, with_window_len=False, dense=True)
    case.window_len = None
    full = case.inputs()
    for n in range(1, case.w + 1):
        short = SnapKVPolicy(kernel_size=3).raw_scores(
            type(full)(full.q_window[:, :, case.w - n :], full.keys, full.start, full.end, case.budget, case.scaling)
        )
        masked = SnapKVPolicy(kernel_size=3).raw_scores(
            type(full)(full.q_window, full.keys, full.start, full.end, case.budget, case.scaling, torch.tensor([n]))
        )
        assert torch.equal(short, masked)


def test_snapkv_padding_queries_contribute_nothing():
    """Garbage in the padded window queries (before the last window_len) does not change the scores."""
    case = random_case(5, dense=True, with_window_len=True)
    inputs = case.inputs()
    noisy = inputs.q_window.clone()
    for b, n in enumerate(case.window_len):
        noisy[b, :, : case.w - n] = 1e3 * torch.randn_like(noisy[b, :, : case.w - n])
    policy = SnapKVPolicy(kernel_size=3)
    again = type(inputs)(noisy, inputs.keys, inputs.start, inputs.end, inputs.budget, inputs.scaling, inputs.window_len)
    assert torch.equal(policy.raw_scores(inputs), policy.raw_scores(again))


# ------------------------------------------------------------------------------------------------ knorm / streaming
@pytest.mark.parametrize("seed", SEEDS)
def test_knorm_matches_oracle(seed):
    case = random_case(seed)
    assert_uniform_selection(case, KnormPolicy().select(case.inputs()), oracle.knorm_prefix_scores)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sinks", [0, 1, 4, 50])
def test_streaming_matches_oracle(seed, sinks):
    case = random_case(seed)
    kept = StreamingPolicy(sink_tokens=sinks).select(case.inputs())
    for b, row in enumerate(kept):
        assert row.slots.tolist() == [oracle.streaming_slots(case, b, sinks)] * case.keys.shape[1]


def test_streaming_keeps_the_old_baselines_slots():
    """The eval baseline's former sink_recent_slots(2, 30, budget 10, 4 sinks): [2..5] + [24..29]."""
    keys = torch.zeros(1, 2, 30, 4)
    q = torch.zeros(1, 2, 4, 4)
    kept = StreamingPolicy(4).select(
        oracle.Stage1Inputs(q, keys, torch.tensor([2]), torch.tensor([30]), budget=10, scaling=1.0)
    )
    assert kept[0].slots.tolist() == [[2, 3, 4, 5, 24, 25, 26, 27, 28, 29]] * 2


# ------------------------------------------------------------------------------------------------ h2o
def accumulate_in_chunks(case, policy: H2OPolicy, cuts: list[int]):
    """Accumulate a dense case as prefill chunks ending at ``cuts``: chunk c has the queries of its slots and the
    keys stored so far (what the cache layer passes)."""
    batch, kv_heads = case.keys.shape[:2]
    state = policy.new_state(batch, kv_heads, case.keys.device)
    previous = 0
    for cut in cuts:
        policy.accumulate(
            state, case.queries[:, :, previous:cut], case.keys[:, :, :cut], torch.tensor(case.start),
            torch.full((batch,), cut), case.scaling,
        )
        previous = cut
    return state


@pytest.mark.parametrize("seed", range(10))
def test_h2o_matches_oracle(seed):
    case = random_case(seed, dense=True)
    policy = H2OPolicy(block_size=random.Random(seed).choice([1, 3, 64]))
    state = accumulate_in_chunks(case, policy, [case.keys.shape[2]])
    for b in range(len(case.start)):
        reference = oracle.h2o_scores(case, b)
        reference = torch.tensor(reference, dtype=torch.float64)
        assert torch.allclose(state.scores[b].double(), reference, rtol=1e-4, atol=1e-5)
    kept = policy.select(case.inputs(state))
    assert_uniform_selection(case, kept, lambda c, b: oracle.prefix_of(c, b, oracle.h2o_scores(c, b)))


@pytest.mark.parametrize("seed", range(8))
def test_h2o_chunked_accumulation_equals_one_shot(seed):
    case = random_case(seed, dense=True)
    slots = case.keys.shape[2]
    rng = random.Random(seed)
    cuts = sorted(set(rng.sample(range(1, slots), min(3, slots - 1)))) + [slots]
    policy = H2OPolicy(block_size=rng.choice([2, 5, 128]))
    one_shot = accumulate_in_chunks(case, policy, [slots])
    chunked = accumulate_in_chunks(case, policy, cuts)
    assert chunked.queries_seen == one_shot.queries_seen == slots
    torch.testing.assert_close(chunked.scores, one_shot.scores, rtol=1e-5, atol=1e-6)


def test_h2o_on_a_compressed_store_scores_with_the_new_queries_only():
    """Per-row ends (a later turn on a compressed store): n new queries sit in slots end-n .. end-1 of each row."""
    case = random_case(11, dense=False, max_batch=3)
    n = min(min(e - s for s, e in zip(case.start, case.end)), 4)
    policy = H2OPolicy(block_size=2)
    state = policy.new_state(*case.keys.shape[:2], case.keys.device)
    new_queries = torch.stack([case.queries[b, :, e - n : e] for b, e in enumerate(case.end)])
    policy.accumulate(state, new_queries, case.keys, torch.tensor(case.start), torch.tensor(case.end), case.scaling)
    for b, (s, e) in enumerate(zip(case.start, case.end)):
        expected = torch.zeros(case.keys.shape[1], case.keys.shape[2], dtype=torch.float64)
        for query_head in range(case.queries.shape[1]):
            for slot in range(e - n, e):
                for j, p in oracle.attention_row(case, b, query_head, case.queries[b, query_head, slot], slot).items():
                    expected[query_head // case.group, j] += p
        assert torch.allclose(state.scores[b].double(), expected, rtol=1e-4, atol=1e-5)


def test_h2o_needs_its_state():
    case = random_case(1, dense=True)
    case.budget, case.start = case.w, [0] * len(case.start)  # every row exceeds the budget: scores are needed
    with pytest.raises(ValueError, match=r"^H2OPolicy needs its accumulation state in Stage1Inputs\.state \(new_state\(\), "
                                         r"then accumulate\(\) once per prefill chunk\), got NoneType$"):
        H2OPolicy().select(case.inputs())
    with pytest.raises(ValueError, match=r"prefill chunk\), got object$"):
        H2OPolicy().select(case.inputs(object()))
    state = H2OPolicy().new_state(*case.keys.shape[:2], "cpu")
    batch, heads, slots = case.keys.shape[:3]
    grown = accumulate_in_chunks(case, H2OPolicy(), [slots])
    with pytest.raises(ValueError, match=rf"^H2OPolicy\.accumulate: the state already covers {slots} slots but keys has only "
                                         rf"{slots - 1}; the store must only grow between calls$"):
        H2OPolicy().accumulate(grown, case.queries[:, :, :1], case.keys[:, :, : slots - 1],
                               torch.tensor(case.start), torch.full((batch,), slots - 1), case.scaling)
    with pytest.raises(ValueError, match=rf"^H2OPolicy: the accumulated scores cover \({batch}, {heads}, 0\) \(B, Hkv, N\) "
                                         rf"but keys is \({batch}, {heads}, {slots}\); accumulate\(\) must see the same store"):
        H2OPolicy().select(case.inputs(state))


@pytest.mark.parametrize("seed", range(3))
def test_adakv_forwards_accumulation_to_its_scorer(seed):
    """AdaKVPolicy(H2OPolicy()): new_state() and accumulate() are the scorer's, so two prefill chunks accumulate the
    attention of every prompt query (the H2O oracle); AdaKV over SnapKV has no state."""
    case = random_case(seed, dense=True)
    slots = case.keys.shape[2]
    policy = AdaKVPolicy(H2OPolicy(block_size=3))
    state = accumulate_in_chunks(case, policy, sorted({max(1, slots // 2), slots}))
    for b in range(len(case.start)):
        reference = torch.tensor(oracle.h2o_scores(case, b), dtype=torch.float64)
        assert torch.allclose(state.scores[b].double(), reference, rtol=1e-4, atol=1e-5)
    assert AdaKVPolicy().new_state(*case.keys.shape[:2], "cpu") is None


# ------------------------------------------------------------------------------------------------ adakv


def test_allot_row_by_hand():
    """Two heads, prefix slots 0 and 1 (scores h0: 3, 1; h1: 2, 0), window slot 2, 2 slots to allot across heads:
    the best two are h0's slot 0 (3) and h1's slot 0 (2), so each head keeps slots 0 and 2. Without the forced
    argument no slot is forced."""
    kept = allot_row(torch.tensor([[3.0, 1.0], [2.0, 0.0]]), 2, 0, 3, 1)
    assert kept.slots.tolist() == [[0, 2], [0, 2]] and kept.counts.tolist() == [2, 2]
    kept = allot_row(torch.tensor([[3.0, 1.0], [2.0, 0.0]]), 3, 0, 3, 1)  # the third best: h0's slot 1 (1)
    assert kept.slots.tolist() == [[0, 1, 2], [0, 2, -1]] and kept.counts.tolist() == [3, 2]


@pytest.mark.parametrize("seed", SEEDS)
def test_adakv_matches_oracle(seed):
    """Per row: every head keeps its window; the Hkv * (budget - w_b) best prefix scores ACROSS heads are kept."""
    case = random_case(seed)
    kernel = kernel_for(seed)
    kept = AdaKVPolicy(SnapKVPolicy(kernel_size=kernel)).select(case.inputs())
    heads = case.keys.shape[1]
    for b, row in enumerate(kept):
        s, e, w = case.start[b], case.end[b], case.window_of(b)
        counts = row.counts.tolist()
        slots = row.slots.tolist()
        if not case.selects(b):
            assert slots == [list(range(s, e))] * heads and counts == [e - s] * heads
            continue
        assert sum(counts) == heads * case.budget
        reference = oracle.snapkv_prefix_scores(case, b, kernel)
        flat_scores, flat_chosen = [], []
        for h in range(heads):
            own = slots[h][: counts[h]]
            assert all(x == -1 for x in slots[h][counts[h] :])
            assert own[-w:] == list(range(e - w, e)) if w else True
            prefix = own[: counts[h] - w]
            assert prefix == sorted(prefix) and len(set(prefix)) == len(prefix)
            flat_chosen += [h * (e - w - s) + (j - s) for j in prefix]
            flat_scores += reference[h]
        assert_top_up_to_ties(flat_chosen, flat_scores, heads * (case.budget - w))


def test_adakv_allots_by_score():
    """Head 0's scores dominate head 1's: head 0 takes every prefix slot the total allows."""
    keys = torch.zeros(1, 2, 20, 4)

    def scores(inputs):
        out = torch.zeros(1, 2, 20)
        out[0, 0] = 100 + torch.arange(20.0)
        out[0, 1] = torch.arange(20.0)
        return out

    inputs = oracle.Stage1Inputs(torch.zeros(1, 2, 2, 4), keys, torch.tensor([0]), torch.tensor([20]), 8, 1.0)
    row = AdaKVPolicy(ScorerPolicy(scores)).select(inputs)[0]
    assert row.counts.tolist() == [14, 2]  # 2 * (8 - 2) = 12 prefix slots, all to head 0 (it has 18)
    assert row.slots[0].tolist() == list(range(6, 20))
    assert row.slots[1].tolist() == [18, 19] + [-1] * 12


# ------------------------------------------------------------------------------------------------ random / scorer
def test_random_is_seeded():
    case = random_case(2, dense=True)
    case.budget = case.w + 1
    first = [r.slots for r in RandomPolicy(seed=7).select(case.inputs())]
    again = [r.slots for r in RandomPolicy(seed=7).select(case.inputs())]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    many = {tuple(RandomPolicy(seed=s).select(case.inputs())[0].slots[0].tolist()) for s in range(8)}
    assert len(many) > 1


@pytest.mark.parametrize("seed", range(8))
def test_scorer_policy_keeps_the_best_scores(seed):
    case = random_case(seed)
    kept = ScorerPolicy(lambda inputs: inputs.keys.float().sum(dim=-1), name="key_sum").select(case.inputs())
    def key_sums(c, b):
        return [row[c.start[b] : c.end[b] - c.window_of(b)] for row in c.keys[b].double().sum(-1).tolist()]

    assert_uniform_selection(case, kept, key_sums)


def test_scorer_policy_bad_output_names_the_function():
    case = random_case(0, dense=True)
    case.budget, case.start = case.w, [0] * len(case.start)
    with pytest.raises(ValueError, match=r"ScorerPolicy\('mine'\).fn must return floating scores of shape"):
        ScorerPolicy(lambda inputs: torch.zeros(3), name="mine").select(case.inputs())
    with pytest.raises(ValueError, match="ScorerPolicy.fn must be callable"):
        ScorerPolicy(42)
