"""The policies wired into RocketKVConfig and RocketKVLayer: config fields and their validation, each policy's
selection through the layer (checked against the oracles), H2O's accumulation hook over prefill chunks, AdaKV's
per-head lengths, and the token-budget mode resolving budgets per request.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig, RocketKVLayer
from hf_rocketkv.cache.layer import GenerationHints
from hf_rocketkv.policies import KeepFirst, KnormPolicy, ScorerPolicy, SnapKVPolicy, derive_budgets
from tests.policies import oracle
from tests.policies.helpers import Ragged, prompt_keys
from tests.support.tiny_models import compressing_config, greedy, left_pad, make_models, random_ids

HKV, G, D = 2, 2, 8


def layer_config(**overrides) -> RocketKVConfig:
    kwargs = dict(prompt_budget=10, window_size=3, kernel_size=3, topk=2, topr=8, page_size=2,
                  kt_cache_dtype="float32", backend="torch")
    kwargs.update(overrides)
    return RocketKVConfig(**kwargs)


def prefill_chunks(layer, case: oracle.Case, cuts: list[int]) -> None:
    """Feed a dense case to a layer as prefill chunks (update, then observe_prefill with the padding offsets)."""
    previous = 0
    for cut in cuts:
        layer.update(case.keys[:, :, previous:cut], case.keys[:, :, previous:cut])
        offsets = torch.tensor([min(s, cut) for s in case.start])  # a chunk inside the padding reports its end
        layer.observe_prefill(case.queries[:, :, previous:cut], offsets, case.scaling)
        previous = cut


def dense_case(seed: int, batch: int = 2, slots: int = 30, budget: int = 10, w: int = 3) -> oracle.Case:
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, HKV * G, slots, D, generator=g) * 1.5
    keys = torch.randn(batch, HKV, slots, D, generator=g) * 1.5
    start = [0] + [7 * b for b in range(1, batch)]
    return oracle.Case(queries, keys, start, [slots] * batch, w, budget, None, D**-0.5)


def kept_positions(layer) -> list[list[list[int]]]:
    lengths = layer.lengths.tolist()
    return [[layer.positions[b, h, :n].tolist() for h in range(HKV)] for b, n in enumerate(lengths)]


# ------------------------------------------------------------------------------------------------ config
def test_config_policy_fields_validate():
    assert RocketKVConfig().stage1 == "snapkv" and RocketKVConfig().sink_tokens == 4
    assert RocketKVConfig().token_budget is None
    with pytest.raises(ValueError, match=r"RocketKVConfig.stage1 must be one of \['snapkv', 'streaming', 'knorm'"):
        RocketKVConfig(stage1="tova")
    with pytest.raises(ValueError, match="RocketKVConfig.stage1 must be one of .* got int"):
        RocketKVConfig(stage1=3)
    with pytest.raises(ValueError, match="RocketKVConfig.sink_tokens must be an integer >= 0, got -1"):
        RocketKVConfig(sink_tokens=-1)
    with pytest.raises(ValueError, match="RocketKVConfig.token_budget must be None .* got 1"):
        RocketKVConfig(token_budget=1)
    with pytest.raises(ValueError, match="RocketKVConfig.token_budget must be None .* got 256.0"):
        RocketKVConfig(token_budget=256.0)
    policy = KnormPolicy()
    assert RocketKVConfig(stage1=policy).replace(topk=3).stage1 is policy


def test_yaml_holds_policy_names_only():
    config = RocketKVConfig(stage1="h2o", sink_tokens=2, token_budget=512)
    assert RocketKVConfig.from_yaml(config.to_yaml()) == config
    with pytest.raises(ValueError, match="stage1 is a policy object \\(KnormPolicy\\); YAML holds policy names only"):
        RocketKVConfig(stage1=KnormPolicy()).to_yaml()
    assert RocketKVConfig(stage1=KnormPolicy()).to_dict()["stage1"] == KnormPolicy()


# ------------------------------------------------------------------------------------------------ layer
@pytest.mark.parametrize("seed", range(3))
def test_layer_knorm_keeps_the_oracles_slots(seed):
    case = dense_case(seed)
    layer = RocketKVLayer(layer_config(stage1="knorm"), GenerationHints(max_length=34))
    prefill_chunks(layer, case, [30])
    layer.compress()
    for b, heads in enumerate(kept_positions(layer)):
        reference = oracle.knorm_prefix_scores(case, b)
        for h, slots in enumerate(heads):
            assert slots[-3:] == [27, 28, 29]
            oracle.assert_top_up_to_ties([j - case.start[b] for j in slots[:-3]], reference[h], 7)


@pytest.mark.parametrize("cuts", [[30], [5, 12, 30], [7, 8, 29, 30]])
def test_layer_h2o_accumulates_every_prefill_chunk(cuts):
    """Chunked prefill (deferred stage 1): the kept slots are the oracle's over EVERY prompt query."""
    case = dense_case(4)
    layer = RocketKVLayer(layer_config(stage1="h2o"), GenerationHints(max_length=34))
    prefill_chunks(layer, case, cuts)
    assert layer.stage1.policy_state.queries_seen == 30
    layer.compress()
    assert layer.stage1.policy_state is None
    for b, heads in enumerate(kept_positions(layer)):
        reference = oracle.prefix_of(case, b, oracle.h2o_scores(case, b))
        for h, slots in enumerate(heads):
            assert len(slots) == 10 and slots[-3:] == [27, 28, 29]
            oracle.assert_top_up_to_ties([j - case.start[b] for j in slots[:-3]], reference[h], 7)


def test_layer_h2o_refuses_a_prefix_written_around_the_attention():
    case = dense_case(1)
    layer = RocketKVLayer(layer_config(stage1="h2o"), GenerationHints(max_length=34))
    layer.update(case.keys[:, :, :20], case.keys[:, :, :20])  # e.g. Cache.update of a shared prefix
    prefill_chunks(layer, dataclass_slice(case, 20), [10])
    with pytest.raises(ValueError, match="only 10 of the 30 stored columns passed through the rocketkv attention"):
        layer.compress()


def dataclass_slice(case: oracle.Case, first: int) -> oracle.Case:
    """The case from slot ``first`` on (the tail a caller feeds through the model)."""
    return oracle.Case(case.queries[:, :, first:], case.keys[:, :, first:], case.start, case.end, case.w,
                       case.budget, None, case.scaling)


def test_layer_later_turn_with_h2o_uses_that_turns_queries():
    case = dense_case(2)
    layer = RocketKVLayer(layer_config(stage1="h2o"), GenerationHints(max_length=100))
    prefill_chunks(layer, case, [30])
    layer.compress()
    new_keys = torch.randn(2, HKV, 5, D)
    layer.update(new_keys, new_keys)  # a later turn of 5 tokens on the compressed layer (staged by update)
    layer.store_new_tokens(None)  # stored by the attention function once it knows the padding (none here)
    layer.observe_prefill(torch.randn(2, HKV * G, 5, D), None, D**-0.5)
    assert layer.stage1.policy_state.queries_seen == 5
    layer.compress()
    assert layer.lengths.tolist() == [10, 10]
    for heads in kept_positions(layer):
        for slots in heads:
            assert slots[-3:] == [32, 33, 34] and slots == sorted(slots)


def test_adakv_runs_in_the_cache_with_per_head_lengths():
    """stage1="adakv" (SnapKV scores allotted across heads): per-head lengths, the row total of a uniform policy."""
    layer = RocketKVLayer(layer_config(stage1="adakv"), GenerationHints())
    prefill_chunks(layer, dense_case(0), [30])
    layer.compress()
    assert layer.lengths.shape == (2, HKV) and layer.lengths.sum(dim=1).tolist() == [HKV * 10] * 2
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config(stage1="adakv"))
    greedy(rocket, random_ids(1, 40), max_new_tokens=2, cache=cache)
    assert all(cache.kept_tokens(i).sum().item() == HKV * 24 + HKV for i in range(len(cache.layers)))


def test_a_custom_policy_with_undeclared_per_head_counts_is_refused_at_stage_1():
    layer = RocketKVLayer(layer_config(stage1=Ragged()), GenerationHints(max_length=34))
    prefill_chunks(layer, dense_case(0), [30])
    with pytest.raises(ValueError, match="stage-1 policy 'ragged' returned different kept counts"):
        layer.compress()


# ------------------------------------------------------------------------------------------------ stage-2 sinks
SINKS = 4  # stage2_sink_tokens of these tests: one page of page_size 4


def sinks_last_case(seed: int) -> oracle.Case:
    """``dense_case`` in which every query points one way and each row's first 6 valid keys point the other way, 8x
    longer: SnapKV and H2O's later queries give them almost no weight (also once max-pooled with their neighbours)
    and knorm ranks their norms last, so stage 1 keeps the first 4 only when forced to."""
    case = dense_case(seed)
    g = torch.Generator().manual_seed(100 + seed)
    direction = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    queries = 2 * direction + 0.1 * torch.randn(case.queries.shape, generator=g)
    keys = case.keys.clone()
    for b, s in enumerate(case.start):
        keys[b, :, s:s + 6] = -8 * direction
    return oracle.Case(queries, keys, case.start, case.end, case.w, case.budget, None, case.scaling)


def sink_config(**overrides) -> RocketKVConfig:
    """page_size 4, so the first sink page holds exactly the SINKS forced tokens."""
    return layer_config(page_size=4, stage2_sink_tokens=SINKS, **overrides)


def first_slots(layer, count: int = SINKS) -> list[list[list[int]]]:
    """The input columns in the first ``count`` slots of each row and KV head of the compacted store."""
    return [[layer.positions[b, h, :count].tolist() for h in range(HKV)] for b in range(layer.positions.shape[0])]


def prompt_starts(case: oracle.Case, count: int = SINKS) -> list[list[list[int]]]:
    """What ``first_slots`` must be when each row's first prompt tokens were kept: columns start .. start + count - 1
    (left padding included) in every KV head."""
    return [[list(range(s, s + count))] * HKV for s in case.start]


def compressed_layer(config: RocketKVConfig, case: oracle.Case, max_length: int = 34) -> RocketKVLayer:
    layer = RocketKVLayer(config, GenerationHints(max_length=max_length))
    prefill_chunks(layer, case, [30])
    layer.compress()
    return layer


@pytest.mark.parametrize("stage1", ["snapkv", "knorm", "h2o", "random", "streaming"])
def test_layer_keeps_the_stage2_sinks_with_every_uniform_policy(stage1):
    """stage2_sink_tokens=4 alone (no policy object): every row's first 4 prompt tokens open the compacted store, in
    every KV head, inside the budget; the window is still kept."""
    case = sinks_last_case(0)
    layer = compressed_layer(sink_config(stage1=stage1), case)
    assert isinstance(layer.policy, KeepFirst) and layer.policy.tokens == SINKS and layer.policy.name == stage1
    assert first_slots(layer) == prompt_starts(case)
    assert layer.lengths.tolist() == [10, 10]
    for heads in kept_positions(layer):
        assert all(slots[-3:] == [27, 28, 29] for slots in heads)


@pytest.mark.parametrize("stage1", ["snapkv", "knorm"])
@pytest.mark.parametrize("options", [dict(stage2_sink_tokens=0), dict(stage2_sink_tokens=SINKS, stage2="none")])
def test_layer_forces_nothing_without_stage2_sinks(stage1, options):
    """No sink pages (none configured, or stage2="none" attending every kept token): the same case loses its first
    tokens, in every KV head, so the test above can tell forced sinks apart."""
    case = sinks_last_case(0)
    layer = compressed_layer(layer_config(page_size=4, stage1=stage1, **options), case)
    assert not isinstance(layer.policy, KeepFirst)
    for b, heads in enumerate(kept_positions(layer)):
        assert all(case.start[b] not in slots for slots in heads)


@pytest.mark.parametrize("tokens", [2, 6])
def test_layer_with_a_keep_first_policy_object_wraps_it_once(tokens):
    """A user's KeepFirst keeps one wrapper: its own when it forces enough, else one forcing the config's sinks."""
    policy = KeepFirst(SnapKVPolicy(kernel_size=3), tokens)
    case = sinks_last_case(1)
    layer = compressed_layer(sink_config(stage1=policy), case)
    assert isinstance(layer.policy.policy, SnapKVPolicy)
    assert layer.policy.tokens == max(tokens, SINKS) and (layer.policy is policy) == (tokens >= SINKS)
    assert first_slots(layer, max(tokens, SINKS)) == prompt_starts(case, max(tokens, SINKS))


def test_layer_later_turn_keeps_the_stage2_sinks():
    """A later turn re-runs stage 1 over the compacted store: its first slots still hold the prompt's first tokens."""
    case = sinks_last_case(2)
    layer = compressed_layer(sink_config(), case, max_length=100)
    new_keys = torch.randn(2, HKV, 5, D, generator=torch.Generator().manual_seed(5))
    layer.update(new_keys, new_keys)
    layer.store_new_tokens(None)
    layer.observe_prefill(case.queries[:, :, :5], None, D**-0.5)  # the same direction: the sinks still score lowest
    layer.compress()
    assert first_slots(layer) == prompt_starts(case)
    assert all(slots[-3:] == [32, 33, 34] for heads in kept_positions(layer) for slots in heads)


def test_layer_token_budget_mode_keeps_the_stage2_sinks():
    """token_budget derives prompt_budget and page_size per request; the forced count is in tokens, so it holds."""
    case = sinks_last_case(3)
    layer = compressed_layer(layer_config(token_budget=4, stage2_sink_tokens=SINKS), case)
    derived = derive_budgets(30, 4, 4, D)
    assert layer.config.prompt_budget == derived.prompt_budget < 23  # both rows are evicted
    assert first_slots(layer) == prompt_starts(case)


def test_adakv_with_stage2_sinks_keeps_them_in_every_head():
    """The KeepFirst wrapper forwards per_head_budgets: per-head lengths, and every head keeps the first tokens."""
    layer = RocketKVLayer(sink_config(stage1="adakv"), GenerationHints())
    assert isinstance(layer.policy, KeepFirst) and layer.policy.per_head_budgets
    case = sinks_last_case(0)
    prefill_chunks(layer, case, [30])
    layer.compress()
    assert layer.lengths.shape == (2, HKV)
    for b, start in enumerate(case.start):
        for h in range(HKV):
            assert layer.positions[b, h, :SINKS].tolist() == list(range(start, start + SINKS))


# ------------------------------------------------------------------------------------------------ generate


@pytest.mark.parametrize(
    "stage1", ["streaming", "knorm", "h2o", "random", ScorerPolicy(lambda i: -i.keys.float().norm(dim=-1), "neg_norm")]
)
def test_generate_with_each_uniform_policy(stage1):
    rocket, sdpa = make_models("llama")
    cache = RocketKVCache(compressing_config(stage1=stage1, sink_tokens=2))
    ids = random_ids(1, 40)
    out = greedy(rocket, ids, max_new_tokens=3, cache=cache)
    assert out.shape == (1, 43)
    for layer_idx in range(len(cache.layers)):
        assert cache.kept_tokens(layer_idx).tolist() == [[26, 26]]  # 24 kept + 2 generated fed back
        kept = cache.kept_positions(layer_idx)[0, :, :24]
        assert torch.all(kept[:, -8:] == torch.arange(32, 40))  # the window
        if stage1 == "streaming":
            assert kept.tolist() == [[0, 1] + list(range(18, 40))] * 2
    if isinstance(stage1, ScorerPolicy):  # the same choice as knorm, computed from the sdpa model's keys
        for layer_idx, keys in enumerate(prompt_keys(sdpa, ids)):
            kept = cache.kept_positions(layer_idx)[0, :, :24]
            for h in range(keys.shape[1]):
                norms = [-float(k.double().norm()) for k in keys[0, h, :32]]
                oracle.assert_top_up_to_ties(kept[h, :16].tolist(), norms, 16)


def test_generate_token_budget_derives_budgets_per_request():
    """Left-padded batch, prefilled one row group at a time: every layer and group derives the same budgets from
    the batch's padded prompt width (40) and the tokens the cache will store after it (3: generate() never feeds back
    its last token); head_dim 16."""
    rocket, _ = make_models("llama")
    ids, mask = left_pad([random_ids(1, 40, seed=1)[0], random_ids(1, 25, seed=2)[0]])
    config = compressing_config(token_budget=8, window_size=4, prefill_batch_size=1)
    cache = RocketKVCache(config)
    greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, cache=cache)
    assert cache.hints.max_length == 43
    derived = derive_budgets(40, 3, 8, 16)
    for layer in cache.layers:
        effective = layer.config
        assert effective.token_budget == 8
        assert (effective.prompt_budget, effective.topk, effective.page_size, effective.topr) == (
            max(derived.prompt_budget, 4), derived.topk, derived.page_size, derived.topr,
        )
        assert layer.lengths.tolist() == [min(40, effective.prompt_budget) + 3, min(25, effective.prompt_budget) + 3]
    assert cache.config.prompt_budget == 24  # the user's config is untouched


def test_token_budget_resolution_happens_again_after_reset():
    layer = RocketKVLayer(layer_config(token_budget=2, window_size=16, prompt_budget=16), GenerationHints())
    prefill_chunks(layer, dense_case(0, slots=200, w=16), [200])
    layer.compress()
    first = derive_budgets(200, 0, 2, D)  # no max_length hint: nothing more to store
    assert first.prompt_budget < 16  # the formula asks for less than the window: raised to window_size
    assert (layer.config.prompt_budget, layer.config.page_size, layer.config.topr) == (16, first.page_size, first.topr)
    assert layer.lengths.tolist() == [16, 16]
    layer.reset()
    layer.hints.max_length = 20 + 40
    prefill_chunks(layer, dense_case(1, slots=20, w=16), [20])
    layer.compress()
    again = derive_budgets(20, 40, 2, D)
    assert (layer.config.prompt_budget, layer.config.topk) == (max(again.prompt_budget, 16), again.topk)
