"""Decode-time compression (``RocketKVConfig.decode_budget``) on a GPU, Triton backend, with both decode runners.

A long answer (512 new tokens after a 4,096-token prompt kept at 2,048) crosses the decode budget many times. Compared:
greedy tokens of decode_runner="cuda_graphs" against eager decode (bit-identical: the compaction runs between graph
replays, in place), decode_runner="torch_compile" (inductor, bf16: close, not identical, so only run), and the
cache's capacity against prompt_budget + decode_budget + decode_interval (plus one 16-token page of the private store),
whatever the answer's length: compression must keep the cache from growing.

Llama-3.1-8B layer shapes (4 layers), random bf16 weights, batch 1 and 4.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.integration.call_state import call_state

from .gpu_models import greedy, llama_8b_layers, random_prompt

LAYERS, CONTEXT, NEW_TOKENS = 4, 4096, 512
BASE = RocketKVConfig(prompt_budget=2048, topk=64, backend="triton", decode_budget=256, decode_interval=64)
CAPACITY_BOUND = BASE.prompt_budget + BASE.decode_budget + BASE.decode_interval
STORE_PAGE = 16  # the private store rounds capacity up to its pages


@pytest.fixture(scope="module")
def model():
    return llama_8b_layers(LAYERS)


def _run(model, ids, config: RocketKVConfig, compiled: bool):
    cache = RocketKVCache(config)
    tokens = greedy(model, ids, cache, NEW_TOKENS, compiled)
    return tokens, cache


@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_decode_with_compression_equals_eager_and_capacity_stays_bounded(model, batch):
    ids = random_prompt(batch, CONTEXT, seed=batch, low=100)
    eager, eager_cache = _run(model, ids, BASE, compiled=False)
    graphs, graphs_cache = _run(model, ids, BASE.replace(decode_runner="cuda_graphs"), compiled=True)
    step = call_state(graphs_cache).graphed_step
    assert step is not None and step.replays == NEW_TOKENS - 2, "the decode steps did not replay one CUDA graph"
    assert torch.equal(graphs, eager), (
        f"batch {batch}: {(graphs == eager).float().mean().item():.4f} of the graphed tokens equal eager's")
    for name, cache in (("eager", eager_cache), ("cuda_graphs", graphs_cache)):
        layer = cache.layers[0]
        assert layer.capacity <= CAPACITY_BOUND + STORE_PAGE, f"{name}: capacity {layer.capacity} > {CAPACITY_BOUND}"
        assert int(layer.lengths.max()) <= layer.capacity
    assert graphs_cache.memory_bytes() == eager_cache.memory_bytes()


def test_compiled_decode_with_compression_runs(model):
    """torch.compile's bf16 tokens differ from eager's after a few steps: the run and its capacity are checked."""
    ids = random_prompt(4, CONTEXT, seed=4, low=100)
    tokens, cache = _run(model, ids, BASE.replace(decode_runner="torch_compile"), compiled=True)
    assert tokens.shape == (4, NEW_TOKENS)
    assert cache.layers[0].capacity <= CAPACITY_BOUND + STORE_PAGE
