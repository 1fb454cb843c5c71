"""torch.compile'd decode (``decode_runner="torch_compile"``, ``batch_buckets``) of models with sliding-window layers,
soft-capping and sinks (integration/compiled_decode.py), on CPU through generate()'s compiled-decode path
(``compile_config._compile_all_devices``).

A sliding layer decodes into its ring of ``window`` slots (cache/sliding_layer.py): fixed shapes whatever the prompt,
laid out on the host before the first compiled step, so one graph serves every prompt length of a batch size. The
oracle is RocketKV's own eager decode (``disable_compile=True``); the sliding rings and counters must match too.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig

from hf_rocketkv import RocketKVCache, SlidingWindowLayer
from tests.support.decode_runners import (
    StandInBackend,
    eager_compile_config,
    graphed_cache,
    skip_launches_on_fake_tensors,
    unique_graphs,
)
from tests.support.hybrid_models import FULL, SLIDING, WINDOW, make_hybrid_models
from tests.support.markers import slow_except
from tests.support.tiny_models import (
    compressing_config,
    cpu_pool,
    greedy,
    left_pad,
    random_ids,
)

# two layers, one sliding and one global: the smallest model with both kinds (inductor compiles it in seconds)
TWO_LAYERS = {
    "gpt_oss": {"num_hidden_layers": 2},  # alternating: sliding, full
    "gemma3": {"num_hidden_layers": 2, "layer_types": [SLIDING, FULL]},
    "gemma2": {"num_hidden_layers": 2},  # alternating: sliding, full (soft-capped logits)
}


def inductor_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    config._compile_all_devices = True
    return config


def _batch(lengths, seed=0):
    return left_pad([random_ids(1, n, seed=seed + n)[0] for n in lengths])


def _config(**overrides):
    return compressing_config(kt_cache_dtype="float32", decode_runner="torch_compile", **overrides)


def _assert_same_cache(compiled: RocketKVCache, eager: RocketKVCache) -> None:
    """Same counters, and the same ring layout (each slot holds eager's token, within float32 rounding: the compiled
    decode step fuses RoPE and the norms)."""

    def same(a, b):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-4)

    for compiled_layer, eager_layer in zip(compiled.layers, eager.layers):
        assert compiled_layer.get_seq_length() == eager_layer.get_seq_length()
        assert compiled_layer.host_seen == eager_layer.host_seen
        if isinstance(compiled_layer, SlidingWindowLayer):
            assert compiled_layer.ring and int(compiled_layer.position) == compiled_layer.seen_tokens
            assert int(eager_layer.position) == eager_layer.seen_tokens
            assert same(compiled_layer.keys, eager_layer.keys)  # same slots: the ring's layout is the eager one
            assert same(compiled_layer.values, eager_layer.values)


def _assert_compiled_equals_eager(rocket, lengths, seed: int, new_tokens: int, compile_config) -> None:
    """One batch of ``lengths`` decoded eagerly and through ``compile_config``: the same tokens, counters and rings."""
    ids, mask = _batch(lengths, seed=seed)
    eager_cache, cache = RocketKVCache(_config()), RocketKVCache(_config())
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=new_tokens, cache=eager_cache,
                   disable_compile=True)
    compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=new_tokens, cache=cache,
                      compile_config=compile_config)
    assert torch.equal(compiled, eager), lengths
    _assert_same_cache(cache, eager_cache)


@pytest.mark.parametrize("arch", slow_except(list(TWO_LAYERS), keep=["gemma3", "gemma2"]))  # gpt_oss: ~17 s
def test_inductor_decode_equals_eager_and_a_new_prompt_length_does_not_recompile(arch):
    """Prompts longer than the window, a left-padded batch of 2: inductor's tokens and rings are eager's; a second
    request of other prompt lengths replays the same graph."""
    torch._dynamo.reset()
    rocket, _ = make_hybrid_models(arch, **TWO_LAYERS[arch])
    dynamo_utils.counters.clear()
    for lengths in ((30, 21), (37, 12)):
        _assert_compiled_equals_eager(rocket, lengths, 0, 10, inductor_config())
        assert unique_graphs() == 1, dict(dynamo_utils.counters["stats"])
    assert not dynamo_utils.counters["recompiles"]
    assert not dynamo_utils.counters["graph_break"]


@pytest.mark.parametrize("arch", slow_except(["gpt_oss", "gemma3", "mistral", "gemma2", "cohere2"], keep=["cohere2"]))  # 8-22 s each
def test_traced_decode_is_one_graph_for_every_prompt_length(arch):
    """Every hybrid architecture traces as one fullgraph (dynamo, backend "eager": fast), with eager's tokens, for a
    prompt shorter than the window (its ring fills while decoding), longer ones and a padded batch; prompts of new
    lengths of a batch size compile nothing."""
    torch._dynamo.reset()
    rocket, _ = make_hybrid_models(arch)
    dynamo_utils.counters.clear()
    graphs = []
    for lengths in ((5,), (40,), (30, 21), (6, 26)):
        _assert_compiled_equals_eager(rocket, lengths, 1, 12, eager_compile_config())
        graphs.append(unique_graphs())
    assert graphs == [1, 1, 2, 2], graphs  # one graph per batch size
    assert not dynamo_utils.counters["graph_break"]


def test_next_turn_after_compiled_decode_equals_eager():
    """The compiled steps leave the ring in eager's layout and the counters exact, so a next (eager) turn, which
    turns the ring back into ordered columns, continues as after an eager decode."""
    torch._dynamo.reset()
    rocket, _ = make_hybrid_models("gemma3")
    ids = random_ids(1, 30, seed=2)
    follow_up = random_ids(1, 5, seed=7)
    outputs = []
    for compile_kwargs in ({"disable_compile": True}, {"compile_config": eager_compile_config()}):
        cache = RocketKVCache(_config())
        first = greedy(rocket, ids, max_new_tokens=11, cache=cache, **compile_kwargs)
        outputs.append(greedy(rocket, torch.cat([first, follow_up], dim=1), max_new_tokens=6, cache=cache,
                              disable_compile=True))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.slow  # ~14 s; test_batch_buckets_under_the_cuda_graph_runner_pad_sliding_rows runs by default
def test_batch_buckets_pad_sliding_rows():
    """batch_buckets: 3 rows run as 4 (row 0 copied into the padding row, its ring too) and 2 rows as 2; the
    caller's rows get eager's tokens, the cache keeps the caller's rows, one graph per bucket."""
    torch._dynamo.reset()
    rocket, _ = make_hybrid_models("gpt_oss")
    config = _config(batch_buckets=(2, 4))
    dynamo_utils.counters.clear()
    for lengths in ((30, 21, 6), (17, 35, 25), (12, 19)):
        ids, mask = _batch(lengths, seed=3)
        eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=8, cache=RocketKVCache(config),
                       disable_compile=True)
        cache = RocketKVCache(config)
        compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=8, cache=cache,
                          compile_config=eager_compile_config())
        assert torch.equal(compiled, eager), lengths
        assert all(layer.batch_size == len(lengths) for layer in cache.layers)
    assert unique_graphs() == 2, dict(dynamo_utils.counters["stats"])
    assert WINDOW < 12  # the prompts above run past the window


def test_compiled_decode_with_a_pool_equals_eager_without_recompiles():
    """A pool-backed cache: the sliding rings live in the pool's slab (cache/ring.py), laid out on the host
    before the first compiled step too; a second request (other slots, other prompt lengths) replays the graph."""
    torch._dynamo.reset()
    rocket, _ = make_hybrid_models("gemma3")
    config = _config()
    pool = cpu_pool(rocket, config)
    dynamo_utils.counters.clear()
    for lengths in ((30, 21), (37, 12)):
        ids, mask = _batch(lengths, seed=4)
        eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=8, cache=RocketKVCache(config),
                       disable_compile=True)
        cache = RocketKVCache(config, pool=pool)
        compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=8, cache=cache,
                          compile_config=eager_compile_config())
        assert torch.equal(compiled, eager), lengths
        cache.close()
    assert unique_graphs() == 1, dict(dynamo_utils.counters["stats"])
    assert not dynamo_utils.counters["recompiles"]


@pytest.mark.parametrize("arch", slow_except(["gpt_oss", "gemma2"], keep=["gemma2"]))  # gpt_oss: ~10 s
def test_triton_backend_decode_step_with_sinks_or_softcap_traces_as_one_graph(monkeypatch, arch):
    """backend="triton": the global layers' registered ops with the model's sinks (gpt-oss) or soft-capping
    (Gemma 2) trace with the sliding rings as one fullgraph and give eager's tokens. As in
    tests/integration/test_compiled_decode.py, the launches are skipped while dynamo propagates fake tensors (the
    interpreter cannot run on them); the graph (backend "eager") then runs them on real tensors."""
    skip_launches_on_fake_tensors(monkeypatch)
    rocket, _ = make_hybrid_models(arch, **TWO_LAYERS[arch])
    ids, mask = _batch((30, 21), seed=5)
    config = _config(backend="triton")
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, cache=RocketKVCache(config),
                   disable_compile=True)
    dynamo_utils.counters.clear()
    cache = RocketKVCache(config)
    compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, cache=cache,
                      compile_config=eager_compile_config())
    featured = [layer for layer in cache.layers if not layer.is_sliding]
    assert featured and all(layer.ops.name == "triton" and not layer.features.plain for layer in featured)
    assert torch.equal(compiled, eager)
    assert unique_graphs() == 1, dict(dynamo_utils.counters["stats"])
    assert not dynamo_utils.counters["graph_break"]


def test_batch_buckets_under_the_cuda_graph_runner_pad_sliding_rows():
    """Explicit batch_buckets with the default runner (CUDA graphs; the CPU stand-in captures here): 3 rows run as 4,
    one capture, eager's tokens, the caller's rows kept."""
    rocket, _ = make_hybrid_models("gemma3")
    config = compressing_config(kt_cache_dtype="float32", batch_buckets=(4,))
    ids, mask = _batch((30, 21, 6), seed=6)
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=8, cache=RocketKVCache(config),
                   disable_compile=True)
    backend = StandInBackend()
    cache = graphed_cache(config, backend)
    out = greedy(rocket, ids, attention_mask=mask, max_new_tokens=8, cache=cache,
                 compile_config=eager_compile_config())
    assert torch.equal(out, eager)
    assert backend.captures == 1
    assert all(layer.batch_size == 3 for layer in cache.layers)
