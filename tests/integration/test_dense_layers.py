"""Dense first layers (``RocketKVConfig.dense_layers``) against the oracle: transformers' own sdpa attention and
``DynamicCache`` on the same weights.

- the hidden states after the dense layers equal the oracle's at prefill and at every decode step (nothing evicted,
  nothing scored: those layers see exactly what the model's own cache holds), and their stored K/V equal the
  DynamicCache's;
- with every RocketKV layer keeping everything, the greedy tokens equal the oracle's (one row, a padded batch);
- with compression on, the RocketKV layers are compressed and the dense ones hold every column;
- the paths that cannot run them yet refuse with one line naming the field.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from hf_rocketkv import RocketKVCache
from hf_rocketkv.cache import check_pool_policy
from hf_rocketkv.cache.dense_layer import DenseLayer
from hf_rocketkv.integration.call_state import call_state
from hf_rocketkv.integration.generate import check_layer_plan
from tests.support.tiny_models import (
    compressing_config,
    cpu_pool,
    greedy,
    keep_all_config,
    left_pad,
    make_models,
    random_ids,
)
from hf_rocketkv.integration.compat import cache_kwargs

LAYERS = 4


@pytest.fixture(scope="module")
def pair():
    return make_models(num_hidden_layers=LAYERS)


@torch.no_grad()
def hidden_states_by_step(model, ids, cache, steps: int) -> list[tuple[torch.Tensor, ...]]:
    """Hidden states of every layer at the prefill's last token and at ``steps`` teacher-forced decode steps."""
    out = model(ids, **cache_kwargs(cache), use_cache=True, output_hidden_states=True)
    states = [tuple(h[:, -1:] for h in out.hidden_states)]
    for j in range(steps):
        token = torch.tensor([[(7 * j + 5) % 120 + 3]])
        position = torch.tensor([[ids.shape[1] + j]])
        out = model(token, position_ids=position, **cache_kwargs(cache), use_cache=True, output_hidden_states=True)
        states.append(out.hidden_states)
    return states


@pytest.mark.parametrize("dense", [1, 2])
def test_dense_layers_equal_transformers_cache(pair, dense):
    rocket, oracle = pair
    ids = random_ids(1, 60, seed=4)
    cache = RocketKVCache(compressing_config(dense_layers=dense), model_config=rocket.config)
    reference = DynamicCache()
    got = hidden_states_by_step(rocket, ids, cache, steps=6)
    want = hidden_states_by_step(oracle, ids, reference, steps=6)
    for step, (g, w) in enumerate(zip(got, want)):
        for layer in range(dense + 1):  # the embeddings, then the output of each dense layer
            torch.testing.assert_close(g[layer], w[layer], rtol=0, atol=0, msg=f"step {step}, hidden state {layer}")
    for layer in range(dense):
        assert isinstance(cache.layers[layer], DenseLayer)
        assert torch.equal(cache.layers[layer].keys, reference.layers[layer].keys)
        assert torch.equal(cache.layers[layer].values, reference.layers[layer].values)
        assert cache.kept_tokens(layer).tolist() == [[66, 66]]  # every column: 60 prompt + 6 fed back
    for layer in range(dense, LAYERS):  # the RocketKV layers were compressed to the budget (24) + 6 fed back
        assert cache.layers[layer].compressed
        assert cache.kept_tokens(layer).tolist() == [[30, 30]]
    # the layers after the dense ones were compressed: their outputs differ from the oracle's
    assert not torch.equal(got[-1][-1], want[-1][-1])


def test_keep_all_with_dense_layers_equals_the_oracle(pair):
    rocket, oracle = pair
    ids = random_ids(1, 40, seed=3)
    out = greedy(rocket, ids, cache=RocketKVCache(keep_all_config(dense_layers=2)), max_new_tokens=12)
    assert torch.equal(out, greedy(oracle, ids, max_new_tokens=12))
    padded, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (33, 19)])
    batch = greedy(rocket, padded, attention_mask=mask, max_new_tokens=8,
                   cache=RocketKVCache(keep_all_config(dense_layers=1)))
    assert torch.equal(batch, greedy(oracle, padded, attention_mask=mask, max_new_tokens=8))


def test_dense_layers_must_leave_a_rocketkv_layer(pair):
    rocket, _ = pair
    with pytest.raises(ValueError, match=rf"dense_layers={LAYERS} must be below the model's {LAYERS} layers"):
        RocketKVCache(compressing_config(dense_layers=LAYERS), model_config=rocket.config)


def test_pool_refuses_dense_layers(pair):
    rocket, _ = pair
    for field in ({"dense_layers": 1}, {"budget_schedule": "pyramid"}):
        name = next(iter(field))
        with pytest.raises(ValueError, match=rf"RocketKVConfig.{name}=.*: a KVBlockPool"):
            RocketKVCache(compressing_config(**field), pool=cpu_pool(rocket, compressing_config()))
        with pytest.raises(ValueError, match=rf"RocketKVConfig.{name}="):  # the serve CLI's check, before a model
            check_pool_policy(compressing_config(**field))


@pytest.mark.parametrize("changes, runner", [
    ({}, "decode_runner='cuda_graphs'"),
    ({"decode_runner": "torch_compile"}, "decode_runner='torch_compile'"),
    ({"batch_buckets": (1, 2)}, "batch_buckets"),
])
@pytest.mark.parametrize("field", [{"dense_layers": 1}, {"budget_schedule": "pyramid"}])
def test_compiled_decode_refuses_the_layer_plan(pair, changes, runner, field):
    rocket, _ = pair
    cache = RocketKVCache(compressing_config(**field, **changes), model_config=rocket.config)
    call_state(cache).use_graphs_on(("cpu",))  # the model's device counts as a CUDA-graph device
    name = next(iter(field))
    with pytest.raises(NotImplementedError, match=rf"RocketKVConfig.{name}=.* \({runner} on cpu\).*disable_compile"):
        check_layer_plan(cache, rocket, GenerationConfig())
    check_layer_plan(cache, rocket, GenerationConfig(disable_compile=True))  # eager decode: allowed


def test_dense_layers_generate_eagerly_on_cpu(pair):
    rocket, _oracle = pair
    cache = RocketKVCache(compressing_config(dense_layers=1))
    assert not cache.is_compileable
    ids = random_ids(1, 50, seed=9)
    out = greedy(rocket, ids, cache=cache, max_new_tokens=5)
    assert out.shape == (1, 55)
    assert isinstance(cache.layers[0], DenseLayer) and cache.kept_tokens(0).tolist() == [[54, 54]]
    with pytest.raises(ValueError, match="layer 0 is a dense layer"):
        cache.kept_positions(0)


def test_chunked_prefill_and_a_later_turn_equal_the_oracle(pair):
    """Every RocketKV layer keeping everything: a chunked prefill, then a second turn on the same cache, give the
    oracle's tokens (the dense layers see transformers' causal mask over every stored column)."""
    rocket, oracle = pair
    ids = random_ids(1, 37, seed=11)
    cache = RocketKVCache(keep_all_config(dense_layers=2))
    first = greedy(rocket, ids, cache=cache, max_new_tokens=6, prefill_chunk_size=8)
    assert torch.equal(first, greedy(oracle, ids, max_new_tokens=6))
    turn = torch.cat([first, random_ids(1, 9, seed=12)], dim=1)
    second = greedy(rocket, turn, cache=cache, max_new_tokens=6)
    assert torch.equal(second, greedy(oracle, turn, max_new_tokens=6))
