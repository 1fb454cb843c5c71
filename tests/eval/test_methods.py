"""Eval methods (eval/methods.py): the budgets and configs each method name gives (``full``, ``rocketkv``, ``stage1``,
``KIND:POLICY``, ``NAME@FIELD=VALUE``), the checks of the names, per-head budgets refused where a method's pool cannot
hold them, and H2O's method keeping what the same policy keeps in model.generate.

Oracles: the budgets recomputed from the base config, and model.generate with the method's own config.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.eval import decode
from hf_rocketkv.eval.methods import ALL_PAGES, KEEP_ALL, build_method, build_methods
from hf_rocketkv.policies import KeepFirst, KnormPolicy
from tests.support.tiny_models import compressing_config, greedy, make_models, random_ids


def test_method_budgets():
    base = compressing_config(prompt_budget=64, topk=4, page_size=4, window_size=8)
    methods = {
        m.name: m
        for m in build_methods(
            list(("full", "rocketkv", "stage1", "stage2", "streaming", "stage1_read", "streaming_read")), base
        )
    }
    assert methods["full"].config is None and methods["full"].attn_implementation == "sdpa"
    assert methods["rocketkv"].config == base
    assert (methods["rocketkv"].kept_budget, methods["rocketkv"].read_budget) == (64, 16)
    assert methods["stage1"].config.topk == ALL_PAGES and methods["stage1"].config.prompt_budget == 64
    assert methods["stage2"].config.prompt_budget == KEEP_ALL and methods["stage2"].config.topk == 4
    assert methods["stage1_read"].config.prompt_budget == 16 and methods["streaming_read"].streaming
    assert build_method("stage1_read", base.replace(topk=1)).config.prompt_budget == 8  # raised to window_size
    assert methods["streaming"].new_cache().config.stage1 == "streaming" and not methods["stage1"].streaming
    with pytest.raises(ValueError, match="unknown method 'h2o'"):
        build_method("h2o", base)
    with pytest.raises(ValueError, match="listed twice"):
        build_methods(["full", "full"], base)


def test_policy_methods_budgets_and_options():
    """KIND:POLICY methods: evict (B kept, all read), evict_read (K*P kept), rocketkv with and without the stage-2
    options; forced sinks reach stage 1 through the cache layer (labelled +keep_first=s), not the baselines that read
    every kept page; names are checked."""
    base = compressing_config(prompt_budget=64, topk=8, page_size=4, window_size=8, stage2_sink_tokens=4,
                              stage2_recent_tokens=12)
    methods = {m.name: m for m in build_methods(
        ["evict:knorm", "evict_read:h2o", "rocketkv:random", "rocketkv_plain:snapkv", "rocketkv", "rocketkv_plain",
         "stage2", "stage2_plain", "stage1", "streaming_read"], base)}
    evict = methods["evict:knorm"]
    assert evict.config.stage2 == "none" and evict.config.stage1 == "knorm" and evict.config.stage2_sink_tokens == 0
    assert (evict.kept_budget, evict.read_budget, evict.read_tokens(100)) == (64, None, 100)
    assert methods["evict_read:h2o"].config.prompt_budget == 32 and methods["evict_read:h2o"].needs_full_prefill
    rocket = methods["rocketkv:random"]
    assert rocket.config.stage1 == "random" and rocket.config.stage1_keep_first == 4  # the layer wraps it
    assert rocket.config.stage2_forced_pages == (1, 4) and (rocket.kept_budget, rocket.read_budget) == (64, 32)
    assert rocket.describe()["config"]["stage1"] == "random+keep_first=4" and rocket.read_tokens(20) == 20
    json.dumps([m.describe() for m in methods.values()])  # results.json stays JSON
    plain = methods["rocketkv_plain:snapkv"]
    assert plain.config.stage1 == "snapkv" and plain.config.stage2_forced_pages == (0, 1)
    assert methods["rocketkv"].config.stage1 == "snapkv" and methods["rocketkv_plain"].name == "rocketkv_plain"
    assert methods["rocketkv"].describe()["config"]["stage1"] == "snapkv+keep_first=4"
    for name in ("stage1", "streaming_read"):  # every kept page read: no forced pages, so no stage-1 sinks either
        assert methods[name].config.stage1_keep_first == 0 and methods[name].config.stage2_recent_tokens == 0
    assert methods["stage1"].describe()["config"]["stage1"] == "snapkv"
    # a KeepFirst object keeps its label; the layer forces the larger of its count and the config's sinks
    wrapped = build_method("rocketkv", base.replace(stage1=KeepFirst(KnormPolicy(), 6)))
    assert wrapped.describe()["config"]["stage1"] == "knorm+keep_first=6"
    assert methods["stage2_plain"].config.stage2_recent_tokens == 0 and methods["stage2"].kept_budget is None
    with pytest.raises(ValueError, match="unknown stage-1 policy 'tova' in method 'evict:tova'"):
        build_method("evict:tova", base)
    with pytest.raises(ValueError, match=r"KIND:POLICY takes KIND in \['evict', 'evict_read'"):
        build_method("stage1:knorm", base)


def test_method_overrides_after_at():
    base = compressing_config(prompt_budget=64, topk=8, page_size=4, window_size=8)
    method = build_method("rocketkv@prompt_budget=32,topk=4,stage2_recent_tokens=4", base)
    assert method.name == "rocketkv@prompt_budget=32,topk=4,stage2_recent_tokens=4"
    assert (method.kept_budget, method.read_budget, method.config.stage2_forced_pages) == (32, 16, (0, 2))
    assert build_method("evict:knorm@stage2=none", base).config.stage1 == "knorm"
    with pytest.raises(ValueError, match="method 'rocketkv@topk': expected FIELD=VALUE"):
        build_method("rocketkv@topk", base)
    with pytest.raises(ValueError, match="method 'rocketkv@tpk=3': unknown key.*did you mean 'topk'"):
        build_method("rocketkv@tpk=3", base)
    with pytest.raises(ValueError, match="forced stage-2 pages must fit in topk=8"):
        build_method("rocketkv@stage2_recent_tokens=64", base)


def test_h2o_method_prefills_the_whole_prompt():
    """H2O scores with every prompt query, so its method runs the whole prompt itself (no shared dense prefix) and
    keeps what the same policy keeps in model.generate."""
    rocket, _ = make_models("llama")
    ids = random_ids(1, 48, seed=5)
    method = build_method("evict:h2o", compressing_config(prompt_budget=24, topk=3))
    prefix = decode.shared_prefix(rocket, ids, 8)
    prefilled = decode.prefill(rocket, method, prefix)
    reference = RocketKVCache(method.config)
    greedy(rocket, ids, 1, cache=reference)
    for layer in range(len(reference.layers)):
        # the kept positions, without the empty slots (-1) each cache reserved for its own decode steps
        assert torch.equal(_filled(prefilled.cache.kept_positions(layer)), _filled(reference.kept_positions(layer)))


def _filled(positions: torch.Tensor) -> torch.Tensor:
    """``positions`` [B, Hkv, C] without its trailing all-empty (-1) slots."""
    used = int((positions >= 0).any(dim=(0, 1)).nonzero().max()) + 1
    return positions[..., :used]


@pytest.mark.parametrize("method, base", [("rocketkv_fp8kv", dict(stage1="adakv")),
                                          ("rocketkv_fp8kv_head", dict(stage1="adakv")),
                                          ("rocketkv_fp8kv@stage1=adakv", dict())])
def test_eval_pool_methods_refuse_per_head_budgets_when_built(method, base):
    """``build_methods`` is eval's up-front check (before the model loads); the fp8 pool of these methods refuses
    per-head budgets only when the method's first cache is made, after the model loaded and other methods ran."""
    from hf_rocketkv.eval.methods import build_methods

    with pytest.raises(ValueError, match="stage1"):
        build_methods(["full", method], compressing_config(**base))


def test_adakv_methods_build_now_that_the_cache_runs_them():
    """``KIND:adakv`` methods build for every kind: the cache stores per-head counts, so AdaKV's per-head budgets
    run in it."""
    from hf_rocketkv.eval.methods import build_method, build_methods

    base = compressing_config(prompt_budget=64, topk=4, page_size=4, window_size=8)
    for kind in ("rocketkv", "evict", "evict_read", "rocketkv_plain"):
        method = build_method(f"{kind}:adakv", base)
        assert method.config.stage1 == "adakv" and method.config.per_head_budgets
    assert [m.name for m in build_methods(["full", "rocketkv:adakv"], base)] == ["full", "rocketkv:adakv"]
