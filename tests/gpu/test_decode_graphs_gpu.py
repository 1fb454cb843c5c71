"""decode_runner="cuda_graphs" on a GPU (integration/decode_graphs.py): the captured decode step replays the same
kernels as eager decode, so its greedy tokens must be bit-identical to eager decode's, on the first request (which
captures) and on a second one of the same shapes; decode_runner="torch_compile" (inductor) must run, its tokens only
close to eager's in bf16, so only their shape is checked. After ``hf_rocketkv.compile_regions`` the graphed decode
must still capture and replay, and two requests of the same shapes must give the same tokens.

Llama-3.1-8B layer shapes (4 layers), random bf16 weights, a 4,096-token prompt, batch 1 and 4, 48 new tokens.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.integration.call_state import call_state

from .gpu_models import greedy, llama_8b_layers, random_prompt

LAYERS, CONTEXT, NEW_TOKENS = 4, 4096, 48
# the first decode step runs eagerly (warm-up), the second captures and replays, every later one replays
REPLAYS = NEW_TOKENS - 2
BASE = RocketKVConfig(backend="triton")


@pytest.fixture(scope="module")
def model():
    return llama_8b_layers(LAYERS)


def _run(model, ids, config: RocketKVConfig, compiled: bool):
    cache = RocketKVCache(config)
    tokens = greedy(model, ids, cache, NEW_TOKENS, compiled)
    step = call_state(cache).graphed_step
    return tokens, (step.replays if step is not None else None)


@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_graph_decode_is_bit_identical_to_eager(model, batch):
    ids = random_prompt(batch, CONTEXT, seed=batch)
    eager, eager_replays = _run(model, ids, BASE, compiled=False)
    assert eager_replays is None, "disable_compile=True must not capture a graph"
    graphs = BASE.replace(decode_runner="cuda_graphs")
    for attempt in ("first request (captures)", "second request (same shapes)"):
        tokens, replays = _run(model, ids, graphs, compiled=True)
        assert replays == REPLAYS, f"{attempt}: the decode steps did not replay one CUDA graph ({replays} replays)"
        assert torch.equal(tokens, eager), (
            f"{attempt}: batch {batch}, {(tokens == eager).float().mean().item():.3f} of the tokens equal eager's")


def test_torch_compile_decode_runs(model):
    """Inductor fuses differently from the eager kernels: its bf16 tokens are not compared, only produced."""
    ids = random_prompt(4, CONTEXT, seed=4)
    tokens, replays = _run(model, ids, BASE.replace(decode_runner="torch_compile"), compiled=True)
    assert tokens.shape == (4, NEW_TOKENS) and replays is None


def test_cuda_graph_decode_after_compile_regions():
    from hf_rocketkv import compile_regions

    model = compile_regions(llama_8b_layers(LAYERS))
    ids = random_prompt(1, CONTEXT, seed=1)
    graphs = BASE.replace(decode_runner="cuda_graphs")
    first, first_replays = _run(model, ids, graphs, compiled=True)
    again, again_replays = _run(model, ids, graphs, compiled=True)
    assert first_replays == again_replays == REPLAYS
    assert torch.equal(first, again), "two requests of the same shapes gave different tokens after compile_regions"
