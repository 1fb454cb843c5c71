"""Per-layer budgets (``RocketKVConfig.budget_schedule``) and the per-layer fields' validation.

The oracle is the formula written out here in floats: layer j of n RocketKV layers gets ``B * (1.5 - j / (n - 1))``
(flat: ``B``); the shares are integers within one of it and sum to ``n * B``. The cache is checked by counting what
each layer stores after a prefill (``kept_tokens``) and the pages its config reads.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.cache.dense_layer import DenseLayer
from hf_rocketkv.cache.layer_plan import layer_budgets, shares
from tests.support.tiny_models import (
    compressing_config,
    greedy,
    make_models,
    random_ids,
)
from hf_rocketkv.integration.compat import cache_kwargs


def formula(per_layer: int, schedule: str, n: int) -> list[float]:
    if schedule == "flat" or n == 1:
        return [float(per_layer)] * n
    return [per_layer * (1.5 - j / (n - 1)) for j in range(n)]


@pytest.mark.parametrize("schedule", ["flat", "pyramid"])
@pytest.mark.parametrize("per_layer, n", [(2048, 30), (1024, 29), (256, 28), (64, 7), (17, 3), (5, 1), (9, 2)])
def test_shares_follow_the_formula_with_the_same_total(schedule, per_layer, n):
    got = shares(per_layer, schedule, n, minimum=1)
    exact = formula(per_layer, schedule, n)
    assert sum(got) == per_layer * n
    assert all(abs(g - e) < 1 for g, e in zip(got, exact)), (got, exact)
    if schedule == "pyramid" and n > 1:
        assert got == sorted(got, reverse=True)


def test_minimum_raises_small_shares():
    got = shares(16, "pyramid", 5, minimum=12)
    assert got == [max(round(x), 12) for x in formula(16, "pyramid", 5)]


def test_layer_budgets_skip_dense_layers():
    config = RocketKVConfig(prompt_budget=1024, topk=64, dense_layers=2, budget_schedule="pyramid")
    budgets = layer_budgets(config, 30)
    assert budgets[:2] == [None, None]
    assert budgets[2] == (1536, 96) and budgets[-1] == (512, 32)
    assert sum(b for b, _ in budgets[2:]) == 1024 * 28 and sum(k for _, k in budgets[2:]) == 64 * 28


@pytest.mark.parametrize("changes, message", [
    ({"dense_layers": -1}, r"dense_layers must be an integer >= 0"),
    ({"dense_layers": 1.0}, r"dense_layers must be an integer >= 0"),
    ({"dense_layers": True}, r"dense_layers must be an integer >= 0"),
    ({"budget_schedule": "linear"}, r"budget_schedule must be one of \['flat', 'pyramid'\], got 'linear'"),
    ({"budget_schedule": "pyramid", "token_budget": 256}, r"budget_schedule='pyramid' .* token_budget=256"),
])
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        RocketKVConfig(**changes)


def test_yaml_round_trip():
    config = RocketKVConfig(dense_layers=1, budget_schedule="pyramid")
    assert RocketKVConfig.from_yaml(config.to_yaml()) == config


@pytest.fixture(scope="module")
def pair():
    return make_models(num_hidden_layers=5)


@pytest.mark.parametrize("dense", [0, 1])
def test_each_layer_stores_its_scheduled_budget(pair, dense):
    rocket, _ = pair
    config = compressing_config(prompt_budget=40, topk=6, budget_schedule="pyramid", dense_layers=dense)
    cache = RocketKVCache(config)
    ids = random_ids(1, 90, seed=5)
    greedy(rocket, ids, cache=cache, max_new_tokens=1)  # prefill only: no token is fed back
    n = 5 - dense
    want_budget = [round(x) for x in formula(40, "pyramid", n)]
    want_topk = [round(x) for x in formula(6, "pyramid", n)]
    assert sum(want_budget) == 40 * n and sum(want_topk) == 6 * n  # the exact shares are integers here
    for i in range(dense):
        assert isinstance(cache.layers[i], DenseLayer) and cache.kept_tokens(i).tolist() == [[90, 90]]
    for j in range(n):
        layer = cache.layers[dense + j]
        assert cache.kept_tokens(dense + j).tolist() == [[want_budget[j]] * 2], j
        assert layer.config.topk == want_topk[j]


def test_pyramid_without_the_layer_count_says_how_to_give_it(pair):
    rocket, _ = pair
    cache = RocketKVCache(compressing_config(budget_schedule="pyramid"))
    with pytest.raises(ValueError, match=r"model_config=model.config"), torch.no_grad():
        rocket(random_ids(1, 30), **cache_kwargs(cache), use_cache=True)


def test_triton_backend_runs_the_layer_plan_like_the_reference(pair):
    """The Triton kernels (interpreted on the CPU) on a pyramid with a dense first layer: each layer stores its share,
    and the tokens are the PyTorch reference path's."""
    rocket, _ = pair
    ids = random_ids(1, 90, seed=6)
    outs = {}
    for backend in ("torch", "triton"):
        config = compressing_config(prompt_budget=40, topk=6, budget_schedule="pyramid", dense_layers=1,
                                    backend=backend)
        cache = RocketKVCache(config)
        outs[backend] = greedy(rocket, ids, cache=cache, max_new_tokens=4)
        want = [round(x) for x in formula(40, "pyramid", 4)]
        assert [cache.kept_tokens(i)[0, 0].item() - 3 for i in range(1, 5)] == want  # 3 tokens fed back
    assert torch.equal(outs["torch"], outs["triton"])
