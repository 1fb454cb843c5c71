"""Static-shape decode under torch.compile (inductor on CPU; generate compiles decode steps by itself).

transformers compiles decode steps for caches whose ``is_compileable`` is True: on CUDA by default, elsewhere only
with ``compile_config._compile_all_devices``. These tests force that path on CPU so CI guards it: same tokens as
eager, one graph, no recompile across decode steps, none for a second request of the same shapes.
"""

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig

from hf_rocketkv import RocketKVCache

from .helpers import compressing_config, greedy, left_pad, make_models, random_ids


def _compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    config._compile_all_devices = True
    return config


@pytest.mark.slow
def test_compiled_decode_matches_eager_without_recompiles():
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    rows = [random_ids(1, 40, seed=3)[0], random_ids(1, 33, seed=4)[0]]
    ids, mask = left_pad(rows)
    # float32 KT: inductor fuses the reference's "round q to the KT dtype" cast away (it does not emulate
    # precision casts by default), so bf16/fp8 KT scores differ from eager by that rounding and can flip a page tie.
    config = compressing_config(kt_cache_dtype="float32")
    eager_cache = RocketKVCache(config)
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, past_key_values=eager_cache,
                   disable_compile=True)
    assert eager_cache.kept_tokens(0).max() > 0 and eager_cache.is_compressed

    dynamo_utils.counters.clear()
    compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                      past_key_values=RocketKVCache(config), compile_config=_compile_config())
    assert torch.equal(compiled, eager)
    graphs_after_first = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs_after_first == 1, dict(dynamo_utils.counters["stats"])  # fullgraph, no recompile per step

    again = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                   past_key_values=RocketKVCache(config), compile_config=_compile_config())
    assert torch.equal(again, eager)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs_after_first  # second request: no recompile
    assert not dynamo_utils.counters["recompiles"]


def test_cache_is_compileable_except_while_prefilling():
    cache = RocketKVCache(compressing_config())
    assert cache.is_compileable
    cache.hints.prefilling = True
    assert not cache.is_compileable


@pytest.mark.slow
def test_chunked_prefill_then_compiled_decode_equals_eager():
    """Chunks run eagerly (no graph per chunk shape), decode is compiled: one graph, the same tokens as eager."""
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32")
    ids, mask = left_pad([random_ids(1, 50, seed=5)[0], random_ids(1, 37, seed=6)[0]])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, prefill_chunk_size=16)
    eager = greedy(rocket, ids, past_key_values=RocketKVCache(config), disable_compile=True, **kwargs)
    dynamo_utils.counters.clear()
    compiled = greedy(rocket, ids, past_key_values=RocketKVCache(config), compile_config=_compile_config(), **kwargs)
    assert torch.equal(compiled, eager)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])


@pytest.mark.slow
def test_later_decode_steps_skip_guards_and_new_shapes_still_recompile(monkeypatch):
    """decode_guard_checks="first_step" (opt-in): after each request's first compiled step only differentiating
    guards run; a request of another batch size must still get its own graph (a skipped guard would replay the
    batch-1 graph on batch-2 inputs). The default, "every_step", never touches torch's (process-global) stance."""
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", decode_guard_checks="first_step")
    stances = []
    original = torch.compiler.set_stance

    def spy(*args, **kwargs):
        stances.append(kwargs.get("skip_guard_eval_unsafe"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    for batch in (1, 2, 1):
        ids = random_ids(batch, 40, seed=batch)
        eager = greedy(rocket, ids, max_new_tokens=6, past_key_values=RocketKVCache(config), disable_compile=True)
        stances.clear()
        cache = RocketKVCache(config)
        compiled = greedy(rocket, ids, max_new_tokens=6, past_key_values=cache, compile_config=_compile_config())
        assert torch.equal(compiled, eager), f"batch {batch}"
        assert stances == [True] * 4  # 5 decode steps: the first runs every guard
        assert cache.hints.guards_checked
    assert dynamo_utils.counters["stats"]["unique_graphs"] >= 2  # batch 2 compiled its own graph

    stances.clear()
    every = RocketKVCache(config.replace(decode_guard_checks="every_step"))
    greedy(rocket, ids, max_new_tokens=6, past_key_values=every, compile_config=_compile_config())
    assert stances == []
    assert compressing_config().decode_guard_checks == "every_step"  # the default


def test_compiled_step_counter_raises_when_the_store_is_full():
    from hf_rocketkv.integration.compiled_decode import count_decode_step

    rocket, _ = make_models("llama", num_hidden_layers=2)
    cache = RocketKVCache(compressing_config())
    greedy(rocket, random_ids(1, 40), max_new_tokens=3, past_key_values=cache, disable_compile=True)
    step = {"input_ids": torch.ones(1, 1, dtype=torch.long)}
    before = [layer.host_max_length for layer in cache.layers]
    count_decode_step(cache, (), step)
    assert [layer.host_max_length for layer in cache.layers] == [n + 1 for n in before]
    count_decode_step(cache, (step["input_ids"],), {})  # input_ids passed positionally
    assert [layer.host_max_length for layer in cache.layers] == [n + 2 for n in before]
    cache.layers[1].host_max_length = cache.layers[1].capacity
    cache.layers[0].host_max_length = cache.layers[0].capacity - 1
    with pytest.raises(RuntimeError, match="layer 1 is full.*max_new_tokens"):
        count_decode_step(cache, (), step)


@pytest.mark.slow
def test_next_turn_after_compiled_decode_equals_eager():
    """The compiled steps keep the host length mirror exact, so the next (eager) turn grows the store correctly."""
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32")
    ids = random_ids(1, 40)
    follow_up = random_ids(1, 1, seed=7)  # short: only the exact length shows the store is full
    outputs = []
    for compile_kwargs in (dict(disable_compile=True), dict(compile_config=_compile_config())):
        cache = RocketKVCache(config)
        first = greedy(rocket, ids, max_new_tokens=8, past_key_values=cache, **compile_kwargs)
        second = greedy(rocket, torch.cat([first, follow_up], dim=1), max_new_tokens=8, past_key_values=cache,
                        disable_compile=True)
        outputs.append(second)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.slow
def test_compiled_decode_with_a_pool_equals_eager_without_recompiles():
    """Pool pages: the decode step reads the pool's tensors through each request's table; a second request (new
    tables, a prefix hit) replays the same graph."""
    from hf_rocketkv import KVBlockPool

    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32")
    pool = KVBlockPool(rocket.config, max_gpu_bytes=1 << 20, page_size=8, dtype=torch.float32, device="cpu",
                       kt_page_size=4, kt_dtype="float32")
    ids, mask = left_pad([random_ids(1, 40, seed=3)[0], random_ids(1, 33, seed=4)[0]])
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, past_key_values=RocketKVCache(config),
                   disable_compile=True)
    dynamo_utils.counters.clear()
    for _ in range(2):
        cache = RocketKVCache(config, pool=pool)
        compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, past_key_values=cache,
                          compile_config=_compile_config())
        assert torch.equal(compiled, eager)
        cache.close()
    assert cache.stats.reused_tokens > 0  # the second request hit the first one's prefix
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])
    assert not dynamo_utils.counters["recompiles"]
