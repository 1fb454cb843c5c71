"""A decode step's stage 2 over the layer's arrival counters (``RocketKVLayer.arrivals``, kernels/arrivals.py): the
selection's merge and the attention's combine run inside the launches before them, in generate() and in the batching
engine's rows, with the tokens and logits of the two-launch form (``kernels/arrivals.ENABLED`` off), and the
counters are left 0."""

import pytest
import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.kernels import arrivals
from hf_rocketkv.kernels import select_pages as select_module
from hf_rocketkv.kernels import sparse_decode_attention as attention_module
from tests.kernels.test_arrivals import counted
from tests.support.tiny_models import compressing_config, cpu_pool, greedy_with_logits, make_models, padded_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# where each second launch happens on these shapes (the tiny model's 2 KV heads): "merge": pages in chunks of 8 (the
# selection merges their lists); "combine": 24 pages of 8 tokens selected, the attention split over them (a GPU of
# 64 multiprocessors, so that a few rows are split)
CASES = {
    "merge": (dict(prompt_budget=48, topk=3), (60, 52)),
    "combine": (dict(prompt_budget=160, topk=24, page_size=8), (180, 171)),
}


def _split_rows(monkeypatch) -> None:
    monkeypatch.setattr(attention_module, "num_sms", lambda device: 64)


def _config(case: str):
    overrides, _ = CASES[case]
    return compressing_config(backend="triton", kt_cache_dtype="float32", **overrides)


@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_folds_the_second_launches_and_keeps_the_tokens(monkeypatch, case):
    monkeypatch.setattr(select_module, "SELECT_CHUNK", 8)
    _split_rows(monkeypatch)
    model = make_models("llama")[0].to(DEVICE)
    ids, mask = padded_batch(CASES[case][1], DEVICE)
    merges = counted(monkeypatch, select_module, "_select_merge_launch")
    reduces = counted(monkeypatch, attention_module, "_sparse_decode_reduce_launch")
    second = merges if case == "merge" else reduces
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(arrivals, "ENABLED", on)
        before = second.count
        cache = RocketKVCache(_config(case))
        runs[on] = greedy_with_logits(model, ids, mask, cache, 4)
        assert (second.count > before) != on  # the shapes take the second launch, unless the counters fold it
        # made at the first decode step, left 0 by every step (none without the switch)
        buffers = [layer.arrivals.buffer for layer in cache.layers]
        assert all((buffer is not None and not buffer.any()) if on else buffer is None for buffer in buffers)
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])


def test_the_engines_rows_fold_the_second_launches_and_keep_the_tokens(monkeypatch):
    from hf_rocketkv.serving import SamplingParams, generate_batch
    from tests.serving.helpers import prompt_of

    _split_rows(monkeypatch)
    model = make_models("llama")[0].to(DEVICE)
    config = _config("combine")
    reduces = counted(monkeypatch, attention_module, "_sparse_decode_reduce_launch")
    prompts = [prompt_of(n, seed=60 + n) for n in (180, 170, 175)]
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(arrivals, "ENABLED", on)
        before = reduces.count
        pool = cpu_pool(model, config, 8 << 20, 8, device=DEVICE)
        results = generate_batch(model, prompts, config=config, pool=pool, sampling=SamplingParams.greedy(4))
        runs[on] = [result.token_ids for result in results]
        assert (reduces.count > before) != on
    assert runs[True] == runs[False]


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_hybrid_models_keep_their_tokens_and_their_ring_reduce(monkeypatch, arch):
    """A hybrid model (Gemma 3; gpt-oss with its sinks) with the counters on: its compressed layers fold their second
    launches, its sliding-window layers' ring attention, split in two over a 32-token window, keeps its reduce launch
    (the combine in the split launch measured slower there), and the tokens and logits are those of the two-launch
    form."""
    import functools

    from hf_rocketkv.kernels import ring_attention
    from tests.support.hybrid_models import make_hybrid_models

    monkeypatch.setattr(ring_attention, "ring_decode_attention_launch",
                        functools.partial(ring_attention.ring_decode_attention_launch, num_splits=2, block_n=16))
    model = make_hybrid_models(arch, sliding_window=32)[0].to(DEVICE)
    ids, mask = padded_batch((50, 41), DEVICE)
    reduces = counted(monkeypatch, attention_module, "_sparse_decode_reduce_launch")
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(arrivals, "ENABLED", on)
        before = reduces.count
        runs[on] = greedy_with_logits(model, ids, mask, RocketKVCache(_config("merge")), 4)
        assert reduces.count > before  # the ring's reduce, on or off
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])


def test_a_batch_reserves_every_layers_counters_for_its_widest_bucket():
    """The engine's batch captures a step per bucket: every compressed layer's counters are made once, when the first
    request joins, for all ``max_rows`` rows, so no bucket's step asks for more than they hold (``ArrivalCounters.get``
    would answer None: the two-launch form). A hybrid model's sliding-window layers hold none."""
    from hf_rocketkv.cache.batch_view import BatchedDecodeCache
    from tests.cache.helpers import engine_prefill
    from tests.support.hybrid_models import make_hybrid_models
    from tests.support.tiny_models import random_ids

    model = make_hybrid_models("gemma3", sliding_window=32)[0]
    # the PyTorch backend on the CPU wherever the tests run (a GPU machine has no interpreter): reserving does not
    # depend on the backend
    config = compressing_config(backend="torch", kt_cache_dtype="float32", **CASES["merge"][0])
    pool = cpu_pool(model, config, 4 << 20, 8, sliding_slots=4)
    batch = BatchedDecodeCache(pool, max_rows=4)
    cache, _ = engine_prefill(model, pool, config, random_ids(1, 50, seed=5)[0], 4)
    batch.join(0, cache)
    kv_heads = model.config.num_key_value_heads
    kinds = {type(layer).__name__ for layer in batch.layers}
    assert kinds == {"BatchedDecodeLayer", "SlidingWindowLayer"}, kinds
    compressed = [layer for layer in batch.layers if hasattr(layer, "arrivals")]
    assert len(compressed) == sum(type(layer).__name__ == "BatchedDecodeLayer" for layer in batch.layers)
    for layer in compressed:
        assert layer.arrivals.buffer is not None and layer.arrivals.buffer.numel() == 4 * kv_heads
        assert layer.arrivals.get(4 * kv_heads, layer.arrivals.buffer.device) is layer.arrivals.buffer
    batch.leave(0)
    batch.close()
