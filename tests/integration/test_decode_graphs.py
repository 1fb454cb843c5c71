"""Decode steps captured as graphs (integration/decode_graphs.py), on CPU with a stand-in for torch.cuda graphs.

The stand-in (tests/support/decode_runners.py) keeps what matters of a CUDA graph: capture records the call without
running it, replay re-runs it on the SAME static input buffers with the cache's host bookkeeping switched off (at a
real replay no Python runs). So if the runner forgot to copy an input, to count a step on the host or to reset a
graph between turns, tokens or cache state would differ from the eager run, which is the oracle here.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration.call_state import call_state
from tests.support.decode_runners import StandInBackend, eager_compile_config, graphed_cache
from tests.support.tiny_models import compressing_config, greedy, left_pad, make_models, random_ids


def _same_state(a, b):
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.lengths, lb.lengths) and int(la.seen) == int(lb.seen)
        assert (la.host_max_length, la.host_decoded, la.host_seen) == (lb.host_max_length, lb.host_decoded, lb.host_seen)
        assert torch.equal(la.positions, lb.positions) and torch.equal(la.kt, lb.kt)


@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_decode_equals_eager_with_one_capture_and_no_dynamo(batch):
    rocket, _ = make_models("llama")
    config = compressing_config()
    ids, mask = left_pad([random_ids(1, 40 + 7 * b, seed=b)[0] for b in range(batch)])
    eager_cache = RocketKVCache(config)
    eager = greedy(rocket, ids, attention_mask=mask, cache=eager_cache, max_new_tokens=12,
                   disable_compile=True)
    backend = StandInBackend()
    dynamo_utils.counters.clear()
    cache = graphed_cache(config, backend)
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=12,
                 compile_config=eager_compile_config())
    assert torch.equal(out, eager)
    assert backend.captures == 1 and backend.replays == 10  # 11 decode steps: 1 warm-up, 1 capture + replay, 9
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 0  # nothing compiled
    _same_state(cache, eager_cache)


def test_new_prompt_lengths_and_lengths_of_answer_just_capture_again():
    rocket, _ = make_models("llama")
    config = compressing_config()
    backend = StandInBackend()
    for length, new in ((30, 6), (57, 9), (44, 4)):
        ids = random_ids(1, length, seed=length)
        eager = greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=new, disable_compile=True)
        out = greedy(rocket, ids, cache=graphed_cache(config, backend), max_new_tokens=new,
                     compile_config=eager_compile_config())
        assert torch.equal(out, eager), (length, new)
    assert backend.captures == 3  # one per request, whatever its shapes


def test_next_turn_recaptures_on_the_new_buffers():
    rocket, _ = make_models("llama")
    config = compressing_config()
    backend = StandInBackend()
    caches = [RocketKVCache(config), graphed_cache(config, backend)]
    outs = []
    for cache in caches:
        kwargs = dict(disable_compile=True) if cache is caches[0] else dict(compile_config=eager_compile_config())
        first = greedy(rocket, random_ids(1, 50), cache=cache, max_new_tokens=8, **kwargs)
        second = greedy(rocket, torch.cat([first, random_ids(1, 9, seed=3)], 1), cache=cache,
                        max_new_tokens=8, **kwargs)
        outs.append(second)
    assert torch.equal(outs[0], outs[1])
    assert backend.captures == 2
    _same_state(caches[1], caches[0])


def test_torch_compile_runner_is_still_available():
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(decode_runner="torch_compile", kt_cache_dtype="float32")
    backend = StandInBackend()
    ids = random_ids(1, 40)
    eager = greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=5, disable_compile=True)
    out = greedy(rocket, ids, cache=graphed_cache(config, backend), max_new_tokens=5,
                 compile_config=eager_compile_config())
    assert torch.equal(out, eager) and backend.captures == 0
    with pytest.raises(ValueError, match="decode_runner"):
        compressing_config(decode_runner="graphs")


def test_compile_regions_keeps_tokens_and_compiles_one_graph_per_module_kind():
    import torch._dynamo

    import hf_rocketkv
    from hf_rocketkv.integration.regions import region_modules

    rocket, _ = make_models("llama", num_hidden_layers=3)
    ids = random_ids(1, 40)
    config = compressing_config()
    eager = greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=6, disable_compile=True)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    assert hf_rocketkv.compile_regions(rocket, backend="eager") is rocket
    assert len(region_modules(rocket)) == 3 * 3 + 1  # 2 norms + 1 MLP per layer, and the final norm
    backend = StandInBackend()
    out = greedy(rocket, ids, cache=graphed_cache(config, backend), max_new_tokens=6,
                 compile_config=eager_compile_config())
    assert torch.equal(out, eager) and backend.captures == 1
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 6, graphs  # per module kind and input shape (prefill, decode), not per layer
    with pytest.raises(ValueError, match="no RMSNorm or MLP"):
        hf_rocketkv.compile_regions(torch.nn.Linear(2, 2))


def test_every_graphed_step_runs_with_the_inputs_device_current(monkeypatch):
    """The current CUDA device is per thread (a thread starts on GPU 0): each graphed step enters the inputs'
    device, so a model on another GPU captures and replays there."""
    import contextlib

    from hf_rocketkv.integration import decode_graphs

    entered = []

    def recording(device):
        entered.append(torch.device(device))
        return contextlib.nullcontext()

    monkeypatch.setattr(decode_graphs, "on_device", recording)
    rocket, _ = make_models("llama")
    ids = random_ids(1, 40, seed=3)
    greedy(rocket, ids, cache=graphed_cache(compressing_config(), StandInBackend()), max_new_tokens=5,
           compile_config=eager_compile_config())
    assert entered == [torch.device("cpu")] * 4  # every decode step after the prefill


def test_on_device_is_a_no_op_off_cuda_and_selects_the_gpu_on_cuda():
    import contextlib

    from hf_rocketkv.integration.decode_graphs import on_device

    assert isinstance(on_device("cpu"), contextlib.nullcontext)
    scope = on_device(torch.device("cuda", 1))  # built, not entered: no GPU needed
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1


def _reaches(start, target, skip) -> bool:
    """Whether ``target`` is reachable from ``start`` through gc referents, not entering objects in ``skip``."""
    import gc

    seen, todo = {id(start)}, [start]
    while todo:
        obj = todo.pop()
        for ref in gc.get_referents(obj):
            if ref is target:
                return True
            if id(ref) not in seen and not any(ref is s for s in skip) and not isinstance(ref, (type, torch.Tensor)):
                seen.add(id(ref))
                todo.append(ref)
    return False


def test_the_captured_step_holds_no_reference_to_its_cache():
    """The cache holds its captured step (call_state(cache).graphed_step); the step must not hold the cache, in its static
    inputs or its static output, or a pool-backed request's pages stay out of the pool after the request until the
    cyclic garbage collector runs. (The stand-in graph itself keeps the step's closure; a CUDA graph keeps none.)"""
    rocket, _ = make_models("llama")
    cache = graphed_cache(compressing_config(), StandInBackend())
    out = greedy(rocket, random_ids(1, 50), cache=cache, max_new_tokens=6,
                 compile_config=eager_compile_config())
    step = call_state(cache).graphed_step
    assert step is not None and step.replays > 0 and len(step.cache_fields) == 1  # past_key_values or cache
    assert not _reaches(step, cache, skip=[step.graph])
    assert out.shape[1] == 56


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs on a GPU")
@pytest.mark.parametrize("dtype", [None, torch.float8_e4m3fn])
def test_pool_pages_come_back_after_a_graphed_request_without_the_garbage_collector(dtype):
    """generate() with the default CUDA-graph runner on pool pages (model dtype and fp8), the output dropped, the
    cyclic garbage collector off: every page is free again (prefix pages cached for reuse count as free), so a pool
    sized for one request admits the same request again at once."""
    import gc

    from hf_rocketkv import KVBlockPool

    rocket, _ = make_models("llama")
    rocket = rocket.to("cuda", torch.bfloat16)
    config = compressing_config(backend="triton", decode_runner="cuda_graphs")
    pool = KVBlockPool(rocket, max_gpu_bytes=8 << 20, page_size=16, kt_page_size=4, dtype=dtype,
                       kt_dtype=config.kt_cache_dtype, device="cuda")
    ids = random_ids(1, 120).to("cuda")
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            out = greedy(rocket, ids, cache=RocketKVCache(config, pool=pool), max_new_tokens=8)
            assert out.shape[1] == 128
            del out
            assert pool.free_pages() == pool.num_pages
    finally:
        gc.enable()
