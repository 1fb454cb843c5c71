"""The seam between transformers and RocketKV (cache/seam.py): each attention call reaches the cache layer of its own
forward.

The layer is found from the key tensor ``update()`` returned (docs/seam.md), so there is no process-global state to
race on or to leave behind. These tests try to break that: two generate() calls on one model in two threads, forced
to interleave inside every forward; exceptions in the middle of a forward; calls without a RocketKVCache; and a
hand-written decode loop compiled with ``fullgraph=True``.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils

from hf_rocketkv import RocketKVCache
from hf_rocketkv.cache.layer import RocketKVLayer
from hf_rocketkv.integration.call_state import call_state
from tests.support.tiny_models import compressing_config, greedy, make_models, random_ids
from hf_rocketkv.integration.compat import cache_kwargs

DECODE_STEPS = 52  # >= 50 interleaved decode steps


def _interleave_updates(monkeypatch, barrier: threading.Barrier) -> None:
    """Every RocketKVLayer.update waits for the other thread's update of the same step before returning, so thread
    B always stores its keys between thread A's update and A's attention call (what a process-global pointer to the
    current layer would get wrong)."""
    original = RocketKVLayer.update

    def update(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        barrier.wait()
        return out

    monkeypatch.setattr(RocketKVLayer, "update", update)


@pytest.mark.parametrize("repetition", range(3))
def test_two_threads_one_model_two_caches_give_the_tokens_each_gives_alone(monkeypatch, repetition):
    rocket, _ = make_models("llama")
    config = compressing_config()
    prompts = [random_ids(1, 60, seed=10 + repetition), random_ids(1, 60, seed=20 + repetition)]
    alone = [greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=DECODE_STEPS) for ids in prompts]
    assert not torch.equal(alone[0], alone[1])

    barrier = threading.Barrier(2, timeout=60)
    _interleave_updates(monkeypatch, barrier)
    results, errors = [None, None], []

    def run(i):
        try:
            results[i] = greedy(rocket, prompts[i], cache=RocketKVCache(config), max_new_tokens=DECODE_STEPS)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for i in range(2):
        assert torch.equal(results[i], alone[i]), f"thread {i} got another request's tokens"


def test_two_threads_without_caches_each_get_their_own(monkeypatch):
    """No cache passed: generate() makes one per call, per thread."""
    rocket, _ = make_models("llama")
    from hf_rocketkv import set_config

    set_config(rocket, compressing_config())
    prompts = [random_ids(1, 50, seed=3), random_ids(1, 50, seed=4)]
    alone = [greedy(rocket, ids, max_new_tokens=20) for ids in prompts]
    barrier = threading.Barrier(2, timeout=60)
    _interleave_updates(monkeypatch, barrier)
    results = [None, None]

    def run(i):
        results[i] = greedy(rocket, prompts[i], max_new_tokens=20)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(torch.equal(results[i], alone[i]) for i in range(2))


class Boom(RuntimeError):
    pass


def _raise_in_layer(model, layer_idx: int, on_call: int):
    """A forward hook on one decoder layer's MLP that raises on its ``on_call``-th call (mid-forward: earlier
    layers have updated the cache, later ones have not)."""
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] == on_call:
            raise Boom("injected failure in the middle of a forward")

    return model.model.layers[layer_idx].mlp.register_forward_hook(hook)


@pytest.mark.parametrize("on_call", [1, 5])  # during prefill, during decode
def test_exception_mid_forward_leaves_nothing_behind(on_call):
    rocket, sdpa = make_models("llama", num_hidden_layers=3)
    config = compressing_config()
    ids = random_ids(1, 50)
    clean = greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=10)

    failed = RocketKVCache(config)
    handle = _raise_in_layer(rocket, 1, on_call)
    with pytest.raises(Boom):
        greedy(rocket, ids, cache=failed, max_new_tokens=10)
    handle.remove()

    # the next generate() equals a clean run, with a passed cache and with none
    assert torch.equal(greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=10), clean)
    from hf_rocketkv import set_config

    set_config(rocket, config)
    assert torch.equal(greedy(rocket, ids, max_new_tokens=10), clean)
    # a plain forward without a RocketKVCache is still exactly sdpa
    with torch.no_grad():
        assert torch.equal(rocket(ids).logits, sdpa(ids).logits)
    # the interrupted cache is inconsistent: reusing it says so instead of continuing silently
    with pytest.raises(RuntimeError, match="interrupted"):
        follow = torch.cat([call_state(failed).token_ids, random_ids(1, 3, seed=7)], 1)
        greedy(rocket, follow, cache=failed, max_new_tokens=2)
    # and nothing else holds on to it
    ref = weakref.ref(failed)
    del failed
    gc.collect()
    assert ref() is None


def test_rocketkv_model_without_rocketkv_cache():
    """generate(): a fresh RocketKVCache per call. A plain forward (the model's own DynamicCache, or
    use_cache=False): exactly sdpa, never another call's cache, even right after a RocketKV forward."""
    rocket, sdpa = make_models("llama")
    ids = random_ids(2, 30)
    other = RocketKVCache(compressing_config())
    with torch.no_grad():
        rocket(random_ids(2, 30, seed=9), **cache_kwargs(other))  # a RocketKV forward just before
        assert torch.equal(rocket(ids).logits, sdpa(ids).logits)
        assert torch.equal(rocket(ids, use_cache=False).logits, sdpa(ids, use_cache=False).logits)
    assert other.get_seq_length() == 30  # untouched by the later forwards


def test_cache_is_freed_without_waiting_for_the_garbage_collector():
    """The key tensors point back to their layer through a weak reference: no cycle keeps buffers alive."""
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config())
    greedy(rocket, random_ids(1, 40), cache=cache, max_new_tokens=4)
    ref = weakref.ref(cache.layers[0])
    gc.disable()
    try:
        del cache
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.slow
def test_hand_written_compiled_decode_loop_fullgraph_without_recompiles():
    """A user loop: prefill eagerly, then a ``torch.compile(fullgraph=True)`` forward per token, with neither
    position_ids nor a max_length hint. get_seq_length() is the device counter under compile and get_mask_sizes() is
    constant per capacity, so one graph serves every step; tokens equal the eager loop."""
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", capacity_headroom=32)
    ids = random_ids(1, 40)

    def loop(forward, steps=12):
        cache = RocketKVCache(config)
        with torch.no_grad():
            logits = rocket(ids, **cache_kwargs(cache)).logits[:, -1]
            tokens = [logits.argmax(-1, keepdim=True)]
            for _ in range(steps):
                logits = forward(input_ids=tokens[-1], **cache_kwargs(cache)).logits[:, -1]
                tokens.append(logits.argmax(-1, keepdim=True))
        return torch.cat(tokens, dim=1)

    eager = loop(rocket)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled_forward = torch.compile(rocket, fullgraph=True, dynamic=False, backend="eager")
    compiled = loop(compiled_forward)
    assert torch.equal(compiled, eager)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])
    assert not dynamo_utils.counters["recompiles"]
    assert not dynamo_utils.counters["graph_break"]


def test_decode_mask_size_is_constant_per_capacity():
    """The decode mask is ignored by compressed layers: its size follows the capacity, not the tokens seen, so a
    compiled loop sees one shape until the store grows (eager only)."""
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config(capacity_headroom=64))
    greedy(rocket, random_ids(1, 40), cache=cache, max_new_tokens=2)
    with torch.no_grad():
        first_capacity = cache.layers[0].capacity  # sized from generate()'s max_length
        while cache.layers[0].capacity == first_capacity:  # run past it: the store grows by the headroom (64)
            rocket(random_ids(1, 1, seed=5), **cache_kwargs(cache))
        capacity = cache.layers[0].capacity
        sizes = set()
        for _ in range(6):
            sizes.add(cache.get_mask_sizes(1, 0))
            rocket(random_ids(1, 1, seed=5), **cache_kwargs(cache))
    assert cache.layers[0].capacity == capacity
    assert sizes == {(capacity + 1, 0)}


def test_seq_length_tensor_is_the_device_counter():
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config())
    out = greedy(rocket, random_ids(1, 40), cache=cache, max_new_tokens=5)
    counter = cache.seq_length_tensor()
    assert isinstance(counter, torch.Tensor) and counter.dim() == 0
    assert int(counter) == cache.get_seq_length() == out.shape[1] - 1
    assert int(RocketKVCache(compressing_config()).seq_length_tensor()) == 0
