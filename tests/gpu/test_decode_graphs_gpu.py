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


@pytest.mark.parametrize("compiled", [True, False], ids=["cuda_graphs", "eager_layer_graphs"])
def test_a_deepcopy_after_graphed_decode_continues_as_its_uncopied_twin(model, compiled):
    """A cache whose decode steps ran through CUDA graphs (the whole-step graph, or the eager steps' per-layer
    OpGraphs) is deep-copied; the next turn on the copy gives the tokens of the same turn on an uncopied twin, and
    the original then still gives them too (the copy captures its own graphs)."""
    import copy

    ids = random_prompt(1, CONTEXT, seed=7)
    graphs = BASE.replace(decode_runner="cuda_graphs")
    cache, twin = RocketKVCache(graphs), RocketKVCache(graphs)
    first = greedy(model, ids, cache, 8, compiled)
    assert torch.equal(greedy(model, ids, twin, 8, compiled), first)
    copied = copy.deepcopy(cache)
    turn = torch.cat([ids, first, random_prompt(1, 64, seed=8)], 1)
    expected = greedy(model, turn, twin, 16, compiled)
    assert torch.equal(greedy(model, turn, copied, 16, compiled), expected)
    assert torch.equal(greedy(model, turn, cache, 16, compiled), expected)
