"""generate()'s deferred stop check on RocketKV caches: ``crop(-n)`` undoes the last decode steps exactly, the check is
on for RocketKV caches on CUDA only, and the check's crop path (run on the CPU with an event stand-in) equals the plain
check, per-head lengths (AdaKV) included.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration.call_state import call_state
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, left_pad, make_models, random_ids


def _assert_same_state(cache, reference):
    for layer_idx, (got, want) in enumerate(zip(cache.layers, reference.layers)):
        where = f"layer {layer_idx}"
        assert torch.equal(got.lengths, want.lengths) and int(got.seen) == int(want.seen), where
        assert torch.equal(got.positions, want.positions), where
        assert (got.host_max_length, got.host_decoded) == (want.host_max_length, want.host_decoded), where
        for b, n in enumerate(want.lengths.tolist()):
            assert torch.equal(got.keys[b, :, :n], want.keys[b, :, :n]), where
            assert torch.equal(got.values[b, :, :n], want.values[b, :, :n]), where
            pages = -(-n // want.config.page_size)
            assert torch.equal(got.kt[b, :, :pages], want.kt[b, :, :pages]), where


@pytest.mark.parametrize("steps", [1, 3])
def test_crop_undoes_the_last_decode_steps(llama_pair, steps):
    """What generate()'s deferred stop check relies on: crop(-n) restores the cache of n decode steps earlier."""
    rocket, _ = llama_pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (50, 37)])
    longer, shorter = RocketKVCache(compressing_config()), RocketKVCache(compressing_config())
    out_longer = greedy(rocket, ids, attention_mask=mask, cache=longer, max_new_tokens=6 + steps)
    out_shorter = greedy(rocket, ids, attention_mask=mask, cache=shorter, max_new_tokens=6)
    longer.crop(0)  # no-op
    longer.crop(-steps)
    _assert_same_state(longer, shorter)
    # and the next turn continues exactly as from the cache that never took those steps
    follow = torch.cat([out_shorter, random_ids(2, 3, seed=9)], dim=1)
    follow_mask = torch.cat([mask, torch.ones(2, follow.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    assert torch.equal(out_longer[:, : out_shorter.shape[1]], out_shorter)
    again = [greedy(rocket, follow, attention_mask=follow_mask, cache=c, max_new_tokens=5)
             for c in (longer, shorter)]
    assert torch.equal(again[0], again[1])


@pytest.mark.parametrize("steps", [1, 2])
def test_crop_with_a_keep_all_history_undoes_the_steps_in_the_history_too(llama_pair, steps):
    """multi_turn="keep_all": the decoded tokens leave the history as well as the view (lengths, positions, host
    counts), and the next turn, which re-runs stage 1 over the history, continues as from a cache that never took
    them. The oracle is a second cache that stopped ``steps`` decode steps earlier."""
    rocket, _ = llama_pair
    config = compressing_config(multi_turn="keep_all")
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (44, 31)])
    longer, shorter = RocketKVCache(config), RocketKVCache(config)
    greedy(rocket, ids, attention_mask=mask, cache=longer, max_new_tokens=5 + steps)
    out_shorter = greedy(rocket, ids, attention_mask=mask, cache=shorter, max_new_tokens=5)
    longer.crop(-steps)
    for layer_idx, (got, want) in enumerate(zip(longer.layers, shorter.layers)):
        # the longer run sized its stores for more tokens: compare what the rows hold, and that the rest is empty
        assert torch.equal(got.lengths, want.lengths) and int(got.seen) == int(want.seen), layer_idx
        assert (got.host_max_length, got.host_decoded) == (want.host_max_length, want.host_decoded), layer_idx
        for held, expected in ((got, want), (got.history, want.history)):
            assert torch.equal(held.lengths, expected.lengths), layer_idx
            for b, n in enumerate(expected.lengths.tolist()):
                assert torch.equal(held.positions[b, :, :n], expected.positions[b, :, :n]), layer_idx
                assert bool((held.positions[b, :, n:] == -1).all()), layer_idx
        for b, n in enumerate(want.lengths.tolist()):
            assert torch.equal(got.keys[b, :, :n], want.keys[b, :, :n]), layer_idx
        assert got.history.host_max_length == want.history.host_max_length, layer_idx
        assert got.generated.host_generated == want.generated.host_generated, layer_idx
        assert got.host_seen == want.host_seen, layer_idx
    follow = torch.cat([out_shorter, random_ids(2, 4, seed=3)], dim=1)
    follow_mask = torch.cat([mask, torch.ones(2, follow.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    again = [greedy(rocket, follow, attention_mask=follow_mask, cache=c, max_new_tokens=4) for c in (longer, shorter)]
    assert torch.equal(again[0], again[1])


def test_crop_refuses_what_it_cannot_undo(llama_pair):
    rocket, _ = llama_pair
    cache = RocketKVCache(compressing_config())
    greedy(rocket, random_ids(1, 40), cache=cache, max_new_tokens=4)  # 3 decode steps
    for bad in (5, -4):  # an absolute length (assisted decoding's legacy call), more than was decoded
        with pytest.raises(NotImplementedError, match="assisted"):
            cache.crop(bad)
    cache.crop(-3)
    assert cache.kept_tokens(0).tolist() == [[24, 24]]


def test_deferred_stop_check_enabled_for_rocketkv_on_cuda_only():
    from transformers.generation.utils import DeferredStopCheck

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cache = RocketKVCache(compressing_config())
    assert DeferredStopCheck.is_supported(cuda, cache, True, False)
    assert not DeferredStopCheck.is_supported(cuda, cache, True, True)  # assistant models keep the plain check
    assert not DeferredStopCheck.is_supported(cpu, cache, True, False)  # CPU events do not exist
    off = RocketKVCache(compressing_config(deferred_stop_check=False))
    assert not DeferredStopCheck.is_supported(cuda, off, True, False)
    from transformers import DynamicCache

    assert not DeferredStopCheck.is_supported(cuda, DynamicCache(), True, False)  # others: transformers' rule


class _CpuEvent:
    """torch.Event stand-in on CPU (no device queue: every operation has already happened)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def test_deferred_stop_check_crop_path_equals_the_plain_check(llama_pair, monkeypatch):
    """generate()'s deferred stop check (CUDA only in real use) runs here on CPU with an event stand-in: it takes one
    extra decode step past the EOS stop and undoes it with cache.crop(-1). Tokens and the returned cache must equal a
    run with the plain check."""
    import transformers.generation.utils as generation_utils

    rocket, _ = llama_pair
    ids = random_ids(1, 40)
    probe = greedy(rocket, ids, cache=RocketKVCache(compressing_config()), max_new_tokens=12)
    eos = int(probe[0, 40 + 5])  # the 6th generated token: generation stops there
    monkeypatch.setattr(generation_utils.torch, "Event", _CpuEvent)
    caches, outputs = [], []
    for deferred in (True, False):
        cache = RocketKVCache(compressing_config(deferred_stop_check=deferred))
        call_state(cache).defer_stop_check_on(("cuda", "cpu"))
        crops = []
        original_crop = cache.crop
        monkeypatch.setattr(cache, "crop", lambda n, _c=original_crop, _l=crops: (_l.append(n), _c(n))[1])
        outputs.append(greedy(rocket, ids, cache=cache, max_new_tokens=12, eos_token_id=eos))
        caches.append((cache, crops))
    assert torch.equal(outputs[0], outputs[1]) and outputs[0].shape[1] == 40 + 6
    (deferred_cache, deferred_crops), (plain_cache, plain_crops) = caches
    assert -1 in deferred_crops and not plain_crops  # the extra step really was taken and undone
    _assert_same_state(deferred_cache, plain_cache)


@pytest.mark.parametrize("extra", [{}, dict(multi_turn="keep_all")])
def test_deferred_stop_check_crop_with_per_head_lengths(monkeypatch, extra):
    import transformers.generation.utils as generation_utils

    rocket, _ = make_models("llama")
    ids, mask = left_pad([random_ids(1, 40, seed=21)[0], random_ids(1, 33, seed=22)[0]])
    probe = greedy(rocket, ids, attention_mask=mask, max_new_tokens=12,
                   cache=RocketKVCache(compressing_config(stage1="adakv", **extra)))
    eos = int(probe[0, 40 + 5])
    monkeypatch.setattr(generation_utils.torch, "Event", _CpuEvent)
    runs = []
    for deferred in (True, False):
        cache = RocketKVCache(compressing_config(stage1="adakv", deferred_stop_check=deferred, **extra))
        call_state(cache).defer_stop_check_on(("cuda", "cpu"))
        crops, crop = [], cache.crop
        monkeypatch.setattr(cache, "crop", lambda n, _c=crop, _l=crops: (_l.append(n), _c(n))[1])
        out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=12, eos_token_id=eos)
        runs.append((out, cache, crops))
    (out, cache, crops), (plain_out, plain, plain_crops) = runs
    assert torch.equal(out, plain_out) and -1 in crops and not plain_crops
    for got, want in zip(cache.layers, plain.layers):
        assert got.lengths.dim() == 2 and torch.equal(got.lengths, want.lengths)
        assert torch.equal(got.positions, want.positions) and got.host_max_length == want.host_max_length
        assert int(got.seen) == int(want.seen)


def _llama4_case():
    from tests.integration.test_chunked_models import GENERATE_BROKEN

    return pytest.param("llama4", marks=pytest.mark.skipif(GENERATE_BROKEN, reason="this transformers' generate() "
                                                              "cannot run Llama 4"))


@pytest.mark.parametrize("pooled", [False, True], ids=["own-ring", "pool-slab"])
@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", _llama4_case()])
def test_deferred_stop_check_takes_a_sliding_layers_step_back(monkeypatch, arch, pooled):
    """Hybrid models (Llama 4: chunked layers, whose ring holds the current chunk): the deferred check's extra step
    past the EOS stop overwrote the oldest slot of every sliding layer's full ring; ``crop(-1)`` puts it back
    (``activate_past_recording``: the ring kept it). Oracle: the plain check's run: the same tokens, the same rings
    (slot by slot) and counts, and a next turn that continues the same. A prompt past the window; the stop comes
    after more decode steps than the window holds. ``pool-slab``: both caches over a KVBlockPool, the rings in their
    slots of the pool's slab (``Ring.rows``)."""
    _assert_step_back(monkeypatch, arch, pooled, runner="eager")


@pytest.mark.parametrize("pooled", [False, True], ids=["own-ring", "pool-slab"])
@pytest.mark.parametrize("runner", ["cuda_graphs", "torch_compile"])
def test_the_step_back_holds_through_the_decode_runners(monkeypatch, runner, pooled):
    """The same through the decode runners, where the ring keeps the overwritten slot inside the step itself: the
    CUDA-graph runner (captured and replayed on the CPU by a stand-in backend) and the compiled step (traced by
    dynamo)."""
    _assert_step_back(monkeypatch, "gemma3", pooled, runner)


def _assert_step_back(monkeypatch, arch: str, pooled: bool, runner: str) -> None:
    import transformers.generation.utils as generation_utils

    from tests.support.decode_runners import StandInBackend, eager_compile_config
    from tests.support.hybrid_models import WINDOW, make_hybrid_models, make_llama4_models

    rocket, _ = make_llama4_models() if arch == "llama4" else make_hybrid_models(arch)
    ids = random_ids(1, 3 * WINDOW + 5, seed=31)
    mask = torch.ones_like(ids)
    length = ids.shape[1]
    probe = greedy(rocket, ids, attention_mask=mask, max_new_tokens=WINDOW + 4,
                   cache=RocketKVCache(compressing_config()))
    eos = int(probe[0, length + WINDOW + 1])  # stops after more decode steps than the window holds
    monkeypatch.setattr(generation_utils.torch, "Event", _CpuEvent)
    # generate()'s compiled-decode path on the CPU: the graph runner's steps, or dynamo's trace of the step
    runner_kwargs = dict(compile_config=eager_compile_config()) if runner != "eager" else {}
    if runner == "torch_compile":
        torch._dynamo.reset()
    runs, backends = [], []
    for deferred in (True, False):
        config = compressing_config(deferred_stop_check=deferred, decode_runner=runner if runner != "eager" else
                                    "cuda_graphs")
        cache = RocketKVCache(config, pool=cpu_pool(rocket, config)) if pooled else RocketKVCache(config)
        call_state(cache).defer_stop_check_on(("cuda", "cpu"))
        if runner == "cuda_graphs":
            backends.append(StandInBackend())
            call_state(cache).use_graphs_on(("cpu",), backends[-1])
        crops, crop = [], cache.crop
        monkeypatch.setattr(cache, "crop", lambda n, _c=crop, _l=crops: (_l.append(n), _c(n))[1])
        out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=WINDOW + 4, eos_token_id=eos,
                     **runner_kwargs)
        runs.append((out, cache, crops))
    (out, cache, crops), (plain_out, plain, plain_crops) = runs
    assert torch.equal(out, plain_out) and -1 in crops and not plain_crops
    if runner == "cuda_graphs":  # the extra step was a replay: one more than the plain run's
        assert backends[0].captures == 1 and backends[0].replays == backends[1].replays + 1 > 1
    sliding = [i for i, layer in enumerate(plain.layers) if layer.is_sliding]
    assert sliding
    for i in sliding:
        got, want = cache.layers[i], plain.layers[i]
        assert got.ring is not None and want.ring is not None and (got.ring.rows is not None) == pooled, i
        for mine, theirs in zip(got.ring.row_tensors(), want.ring.row_tensors()):
            assert torch.equal(mine, theirs), i
        assert int(got.ring.seen) == int(want.ring.seen) and got.seen_tokens == want.seen_tokens, i
        assert got.host_seen == want.host_seen, i
    follow = torch.cat([out, random_ids(1, 3, seed=33)], dim=1)
    follow_mask = torch.ones_like(follow)
    again = [greedy(rocket, follow, attention_mask=follow_mask, cache=c, max_new_tokens=4, **runner_kwargs)
             for c in (cache, plain)]
    assert torch.equal(again[0], again[1])
    # one step back only: what the ring kept is the last append's; a second step back with a full window raises
    cache.crop(-1)
    with pytest.raises(NotImplementedError, match="cannot be removed"):
        cache.crop(-1)
