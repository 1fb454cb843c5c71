"""The policies wired into RocketKVConfig and RocketKVLayer: config fields and their validation, each policy's
selection through the layer (checked against the oracles), H2O's accumulation hook over prefill chunks, AdaKV's
clear refusal, and the token-budget mode resolving budgets per request.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_rocketkv import RocketKVCache, RocketKVConfig, RocketKVLayer
from hf_rocketkv.cache.layer import GenerationHints
from hf_rocketkv.policies import KeptSlots, KnormPolicy, ScorerPolicy, derive_budgets
from tests.helpers import compressing_config, greedy, left_pad, make_models, random_ids

from . import oracle

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
    assert layer.policy_state.queries_seen == 30
    layer.compress()
    assert layer.policy_state is None
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
    assert layer.policy_state.queries_seen == 5
    layer.compress()
    assert layer.lengths.tolist() == [10, 10]
    for heads in kept_positions(layer):
        for slots in heads:
            assert slots[-3:] == [32, 33, 34] and slots == sorted(slots)


def test_adakv_is_refused_by_the_cache_naming_what_is_missing():
    layer = RocketKVLayer(layer_config(stage1="adakv"), GenerationHints())
    with pytest.raises(NotImplementedError, match=r"'adakv' gives each KV head its own number .* \(\[B, Hkv\]\)"):
        prefill_chunks(layer, dense_case(0), [30])
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config(stage1="adakv"))
    with pytest.raises(NotImplementedError, match="per-KV-head lengths"):
        greedy(rocket, random_ids(1, 40), max_new_tokens=2, past_key_values=cache)
    # the refusal left no attention hand-off pending: the next call works
    greedy(rocket, random_ids(1, 40), max_new_tokens=2, past_key_values=RocketKVCache(compressing_config()))


def test_a_custom_policy_with_per_head_counts_is_refused_at_stage_1():
    class Ragged:
        name = "ragged"

        def select(self, inputs):
            heads = inputs.num_kv_heads
            slots = torch.arange(inputs.budget).expand(heads, inputs.budget).clone()
            slots[0, -1] = -1
            counts = torch.full((heads,), inputs.budget)
            counts[0] -= 1
            return [KeptSlots(slots, counts) for _ in range(inputs.keys.shape[0])]

    layer = RocketKVLayer(layer_config(stage1=Ragged()), GenerationHints(max_length=34))
    prefill_chunks(layer, dense_case(0), [30])
    with pytest.raises(NotImplementedError, match="stage-1 policy 'ragged' gives each KV head its own number"):
        layer.compress()


# ------------------------------------------------------------------------------------------------ generate
def prompt_keys(sdpa, ids) -> list[torch.Tensor]:
    """Post-RoPE prompt keys of every layer, from a plain sdpa forward with a DynamicCache."""
    cache = DynamicCache()
    with torch.no_grad():
        sdpa(ids, past_key_values=cache, use_cache=True)
    return [layer.keys for layer in cache.layers]


@pytest.mark.parametrize(
    "stage1", ["streaming", "knorm", "h2o", "random", ScorerPolicy(lambda i: -i.keys.float().norm(dim=-1), "neg_norm")]
)
def test_generate_with_each_uniform_policy(stage1):
    rocket, sdpa = make_models("llama")
    cache = RocketKVCache(compressing_config(stage1=stage1, sink_tokens=2))
    ids = random_ids(1, 40)
    out = greedy(rocket, ids, max_new_tokens=3, past_key_values=cache)
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
    greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, past_key_values=cache)
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
