"""Stage-2 options (forced sink and recent pages, stage2="none") and the stage-1 "keep the first tokens" mechanism.

Oracles: the policies' brute-force float64 scores (tests/policies/oracle.py) for keep_first; for decode, the forced
page sets written from their definition (first ceil(s/P) pages, newest 1 + ceil(r/P) pages) and the top-k of the
reference page scores over the other pages, checked at every decode step of a tiny model.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.policies import (
    AdaKVPolicy,
    H2OPolicy,
    KeepFirst,
    KnormPolicy,
    ScorerPolicy,
    SnapKVPolicy,
    every_page,
    fit_forced_pages,
    forced_page_counts,
    get_stage1_policy,
)
from hf_rocketkv.kernels.paged import gather_pages
from hf_rocketkv.selection import stage2_pages
from tests.policies import oracle
from tests.policies.oracle import assert_top_up_to_ties, random_case
from tests.support.tiny_models import compressing_config, greedy, make_models, random_ids
from hf_rocketkv.integration.compat import cache_kwargs

SEEDS = range(10)


# ------------------------------------------------------------------------------------------------ config
def test_config_stage2_fields_default_and_validate():
    config = RocketKVConfig()
    assert (config.stage2, config.stage2_sink_tokens, config.stage2_recent_tokens) == ("kt_pages", 0, 0)
    assert config.stage2_forced_pages == (0, 1)  # RocketKV's rule: the newest page only
    with pytest.raises(ValueError, match=r"RocketKVConfig.stage2 must be one of \['kt_pages', 'none'\], got 'dense'"):
        RocketKVConfig(stage2="dense")
    with pytest.raises(ValueError, match="RocketKVConfig.stage2_sink_tokens must be an integer >= 0, got -1"):
        RocketKVConfig(stage2_sink_tokens=-1)
    with pytest.raises(ValueError, match="RocketKVConfig.stage2_recent_tokens must be an integer >= 0, got 1.5"):
        RocketKVConfig(stage2_recent_tokens=1.5)
    with pytest.raises(ValueError, match=r"forced stage-2 pages must fit in topk=4: .* = 5"):
        RocketKVConfig(topk=4, page_size=4, stage2_sink_tokens=4, stage2_recent_tokens=12)
    # fits exactly; stage2="none" and token-budget mode skip the check (no selection / topk derived later)
    assert RocketKVConfig(topk=4, page_size=4, stage2_sink_tokens=4, stage2_recent_tokens=8).stage2_forced_pages == (1, 3)
    RocketKVConfig(topk=4, stage2="none", stage2_recent_tokens=1000)
    trimmed = RocketKVConfig(topk=4, token_budget=64, stage2_sink_tokens=8, stage2_recent_tokens=12)
    assert trimmed.stage2_forced_pages == (0, 4)


def test_config_stage2_yaml_round_trip():
    config = RocketKVConfig(stage2="none", stage2_sink_tokens=4, stage2_recent_tokens=60)
    text = config.to_yaml()
    assert "stage2: none" in text and "stage2_recent_tokens: 60" in text
    assert RocketKVConfig.from_yaml(text) == config
    with pytest.raises(ValueError, match="did you mean 'stage2_recent_tokens'"):
        RocketKVConfig.from_dict({"stage2_recent_token": 4})


@pytest.mark.parametrize("page", [1, 2, 4, 8])
def test_forced_page_counts_cover_the_tokens(page):
    """Brute force: the newest 1 + ceil(r/P) pages hold at least the r newest tokens whatever the fill of the last page;
    the first ceil(s/P) pages hold the first s tokens; neither is larger than needed."""
    for s in range(0, 20):
        for r in range(0, 20):
            sink, recent = forced_page_counts(s, r, page)
            assert sink * page >= s and (sink - 1) * page < s or sink == 0 == s
            for length in range(max(r, 1), 60):
                newest = (length - 1) // page
                covered = set(range(max(0, (newest - recent + 1) * page), length))
                assert set(range(length - r, length)) <= covered
    assert fit_forced_pages(3, 9, 8) == (0, 8) and fit_forced_pages(3, 4, 8) == (3, 4) and fit_forced_pages(3, 4, 6) == (2, 4)


def test_every_page_marks_the_pages_in_use():
    idx, valid = every_page(torch.tensor([0, 5, 8]), 2, 3, 4)
    assert idx.shape == valid.shape == (3, 2, 3) and idx[1, 1].tolist() == [0, 1, 2]
    assert valid[:, 0].tolist() == [[False] * 3, [True, True, False], [True, True, False]]
    _, per_head = every_page(torch.tensor([[1, 9]]), 2, 3, 4)
    assert per_head[0].tolist() == [[True, False, False], [True, True, True]]


# ------------------------------------------------------------------------------------------------ keep_first
def _keep(case: oracle.Case, b: int, keep_first: int) -> int:
    s, e, w = case.start[b], case.end[b], case.window_of(b)
    return min(keep_first, case.budget - w, e - w - s)


@pytest.mark.parametrize("seed", SEEDS)
def test_keep_first_scorers_match_oracle(seed):
    """knorm and snapkv with keep_first: per head the first f slots, the window, and a top-(budget - w - f) set of the
    policy's oracle scores over the other prefix slots."""
    case = random_case(seed)
    keep_first = seed % 6
    for policy, scores_fn in (
        (KnormPolicy(), oracle.knorm_prefix_scores),
        (SnapKVPolicy(kernel_size=3), lambda c, b: oracle.snapkv_prefix_scores(c, b, 3)),
    ):
        kept = policy.select(dataclasses.replace(case.inputs(), keep_first=keep_first))
        for b, row in enumerate(kept):
            s, e, w = case.start[b], case.end[b], case.window_of(b)
            if not case.selects(b):
                assert row.slots.tolist() == [list(range(s, e))] * case.keys.shape[1]
                continue
            f = _keep(case, b, keep_first)
            reference = scores_fn(case, b)
            for h, slots in enumerate(row.slots.tolist()):
                assert len(slots) == case.budget and slots == sorted(slots)
                assert slots[:f] == list(range(s, s + f)) and slots[case.budget - w :] == list(range(e - w, e))
                middle = [j - s - f for j in slots[f : case.budget - w]]
                assert_top_up_to_ties(middle, reference[h][f:], case.budget - w - f)


@pytest.mark.parametrize("seed", SEEDS)
def test_keep_first_adakv_matches_oracle(seed):
    """AdaKV: every head keeps the first f slots and its window; the rest of the row total goes across heads."""
    case = random_case(seed)
    keep_first = 1 + seed % 4
    kept = AdaKVPolicy(SnapKVPolicy(kernel_size=1)).select(dataclasses.replace(case.inputs(), keep_first=keep_first))
    heads = case.keys.shape[1]
    for b, row in enumerate(kept):
        if not case.selects(b):
            continue
        s, e, w = case.start[b], case.end[b], case.window_of(b)
        f = _keep(case, b, keep_first)
        assert sum(row.counts.tolist()) == heads * case.budget
        reference = oracle.snapkv_prefix_scores(case, b, 1)
        flat_scores, flat_chosen = [], []
        for h in range(heads):
            own = row.slots[h, : row.counts[h]].tolist()
            assert own[:f] == list(range(s, s + f)) and (own[len(own) - w :] == list(range(e - w, e)) or w == 0)
            flat_chosen += [h * (e - w - s - f) + (j - s - f) for j in own[f : len(own) - w]]
            flat_scores += reference[h][f:]
        assert_top_up_to_ties(flat_chosen, flat_scores, heads * (case.budget - w - f))


def test_keep_first_wrapper_forwards_and_checks():
    wrapped = get_stage1_policy("h2o", keep_first=4)
    assert isinstance(wrapped, KeepFirst) and wrapped.name == "h2o" and hasattr(wrapped, "accumulate")
    assert not hasattr(get_stage1_policy("knorm", keep_first=2), "accumulate")
    assert get_stage1_policy("snapkv") is not None and not isinstance(get_stage1_policy("snapkv"), KeepFirst)
    assert getattr(get_stage1_policy(AdaKVPolicy(), keep_first=1), "per_head_budgets")
    assert isinstance(get_stage1_policy(H2OPolicy(), keep_first=1).policy, H2OPolicy)

    class LastOnly:  # a full-control policy that ignores keep_first: keeps the last `budget` slots
        name = "last_only"

        def select(self, inputs):
            from hf_rocketkv.policies import KeptSlots

            return [KeptSlots.same_for_every_head(torch.arange(e - inputs.budget, e).expand(inputs.num_kv_heads, -1))
                    for _, e, _ in inputs.rows()]

    case = random_case(3, dense=True)
    case.budget, case.start = case.w + 2, [0] * len(case.start)
    with pytest.raises(ValueError, match="'last_only' did not keep the first 2 slots of row 0"):
        KeepFirst(LastOnly(), 2).select(case.inputs())
    with pytest.raises(ValueError, match="KeepFirst.tokens must be an integer >= 0"):
        KeepFirst(KnormPolicy(), -1)
    with pytest.raises(ValueError, match="Stage1Inputs.keep_first must be an integer >= 0"):
        dataclasses.replace(case.inputs(), keep_first=-2)


def test_keep_first_scorer_policy_never_scores_the_forced_slots():
    """The forced slots win even when the scorer ranks them last."""
    keys = torch.zeros(1, 1, 30, 4)
    inputs = oracle.Stage1Inputs(torch.zeros(1, 1, 4, 4), keys, torch.tensor([2]), torch.tensor([30]), 10, 1.0,
                                 keep_first=3)
    row = ScorerPolicy(lambda i: torch.arange(30.0).view(1, 1, 30)).select(inputs)[0]
    assert row.slots[0].tolist() == [2, 3, 4, 23, 24, 25, 26, 27, 28, 29]


# ------------------------------------------------------------------------------------------------ decode, tiny model
def _recording(ops, calls: list):
    """Records every decode page selection (the paged op; the KT pages gathered through the block table)."""

    def paged_top_pages(q, kt_pages, table, lengths, page_size, topr, topk, sink_pages=0, recent_pages=1,
                        per_head_bound=False, counters=None):
        assert per_head_bound is False  # the default stage2_score ("group_sign")
        out = ops.paged_top_pages(q, kt_pages, table, lengths, page_size, topr, topk, sink_pages=sink_pages,
                                  recent_pages=recent_pages, per_head_bound=per_head_bound, counters=counters)
        kt = gather_pages(kt_pages, table)
        calls.append((q.clone(), kt.clone(), lengths.clone(), page_size, topr, topk, sink_pages, recent_pages, out))
        return out

    return dataclasses.replace(ops, paged_top_pages=paged_top_pages)


@pytest.mark.parametrize("sinks,recent", [(4, 8), (1, 3), (0, 10), (6, 0)])
def test_decode_attends_the_forced_pages(sinks, recent):
    """At every decode step of every layer: the first ceil(s/P) pages and the newest 1 + ceil(r/P) pages are among
    the selected ones (brute force from the lengths), the others are the best by the reference page scores, and the
    sink pages hold the prompt's first s tokens (the cache layer's stage 1 kept them: the config alone asks)."""
    rocket, _ = make_models()
    config = compressing_config(topk=6, stage2_sink_tokens=sinks, stage2_recent_tokens=recent)
    page = config.page_size
    cache = RocketKVCache(config)
    ids = random_ids(1, 60, seed=7)
    calls: list = []
    with torch.no_grad():
        out = rocket(ids, **cache_kwargs(cache), use_cache=True)
        for layer in cache.layers:
            assert layer.positions[0, :, :sinks].tolist() == [list(range(sinks))] * layer.positions.shape[1]
            layer.ops = _recording(layer.ops, calls)
        token = out.logits[:, -1:].argmax(-1)
        for step in range(12):
            out = rocket(token, **cache_kwargs(cache), use_cache=True, position_ids=torch.tensor([[60 + step]]))
            token = out.logits[:, -1:].argmax(-1)
    assert len(calls) == 12 * len(cache.layers)
    want_sink, want_recent = math.ceil(sinks / page), 1 + math.ceil(recent / page)
    for q, kt, lengths, page_size, topr, topk, sink_pages, recent_pages, (idx, valid) in calls:
        assert (sink_pages, recent_pages) == (want_sink, want_recent)
        n = -(-int(lengths[0]) // page_size)
        forced = set(range(min(want_sink, n))) | set(range(max(0, n - want_recent), n))
        probs = stage2_pages.page_scores(q, kt, stage2_pages.num_pages(lengths, page_size), topr)
        for h in range(idx.shape[1]):
            chosen = [p for p, v in zip(idx[0, h].tolist(), valid[0, h].tolist()) if v]
            assert len(chosen) == len(set(chosen)) == min(topk, n) and forced <= set(chosen)
            others = [p for p in range(n) if p not in forced]
            rest = [others.index(p) for p in chosen if p not in forced]
            assert_top_up_to_ties(rest, [float(probs[0, h, p]) for p in others], len(rest))


def test_decode_compression_leaves_the_stage2_sinks_in_place():
    """Decode-time compression re-scores generated tokens only: after several compressions every layer's first slots
    still hold prompt positions 0 .. s-1 (the config's sinks, kept by stage 1 without a policy object)."""
    rocket, _ = make_models()
    config = compressing_config(stage2_sink_tokens=4, decode_budget=8, decode_interval=4, decode_window=4)
    cache = RocketKVCache(config)
    greedy(rocket, random_ids(1, 40, seed=9), 30, cache=cache)
    for layer in cache.layers:
        assert int(layer.lengths[0]) <= 24 + 8 + 4  # compressed: 29 generated tokens stored would not fit
        assert layer.positions[0, :, :4].tolist() == [[0, 1, 2, 3]] * layer.positions.shape[1]


def test_stage2_none_equals_attending_every_kept_page():
    """stage2="none" gives the tokens of stage 1 followed by attention over everything kept (topk above the page count)."""
    rocket, _ = make_models()
    ids = random_ids(2, 50, seed=3)
    none = greedy(rocket, ids, 10, cache=RocketKVCache(compressing_config(stage2="none")))
    every = greedy(rocket, ids, 10, cache=RocketKVCache(compressing_config(topk=4096)))
    sparse = greedy(rocket, ids, 10, cache=RocketKVCache(compressing_config(topk=1)))
    assert torch.equal(none, every)
    assert not torch.equal(none, sparse)  # the check can tell a sparse stage 2 apart


def test_forced_pages_same_tokens_on_the_triton_backend():
    """The forced counts reach the Triton top_pages too (interpreted on CPU): same greedy tokens as the torch twin."""
    rocket, _ = make_models(seed=2)
    with torch.no_grad():  # sharper attention: page scores far from ties, so both backends pick the same pages
        for layer in rocket.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    ids = random_ids(1, 28, seed=4)
    config = compressing_config(prompt_budget=16, window_size=4, kernel_size=3, topk=5, page_size=2,
                                kt_cache_dtype="float32", stage2_sink_tokens=2, stage2_recent_tokens=4)
    config = config.replace(stage1=get_stage1_policy("snapkv", kernel_size=3, keep_first=2))
    cache = RocketKVCache(config.replace(backend="triton"))
    out_triton = greedy(rocket, ids, 4, cache=cache)
    assert cache.layers[0].ops.name == "triton"
    assert torch.equal(out_triton, greedy(rocket, ids, 4, cache=RocketKVCache(config)))
