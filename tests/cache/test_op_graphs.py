"""Eager decode steps through per-layer CUDA graphs (``cache/op_graphs.py``, ``RocketKVConfig.eager_layer_graphs``).

CPU: the OpGraph state machine with a stand-in capture (records the launches without running them; replay re-runs
them on the static inputs): a new key runs eagerly, the next step captures and replays, later steps copy the inputs
and replay, a changed key or input shape goes back to eager; when layers take the graphed path at all; and whole
greedy generations through the graphed path (PyTorch ops, the device conditions lifted, a stand-in graph that
replays the recorded launches on the static inputs) against plain eager: tokens, logits and every layer's logical
length, lengths and positions equal, on private and pool pages, a padded batch and a growing store. GPU:
whole greedy generations with ``disable_compile=True``, graphs on against graphs off (the oracle: the plain eager
launches), tokens and every step's logits equal bit for bit, on private pages, bf16 pool pages and fp8 pool pages,
with padding, and with a store that grows mid-generation (new buffers: eager again, then a new capture).
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.cache import op_graphs
from hf_rocketkv.cache.batch_view import BatchedDecodeLayer
from hf_rocketkv.cache.layer import RocketKVLayer
from hf_rocketkv.cache.op_graphs import OpGraph, buffers_key
from tests.support.tiny_models import greedy, make_models, random_ids
from hf_rocketkv.integration.compat import cache_kwargs


class StandInGraph:
    def __init__(self, run, output):
        self.run, self.output, self.replays = run, output, 0

    def replay(self):
        self.replays += 1
        result = self.run()
        if result is not None:
            self.output.copy_(result)


@pytest.fixture
def stand_in_capture(monkeypatch):
    captured = []

    def capture(run, pool=None, stream=None):
        graph = StandInGraph(run, torch.empty(3))  # the launches below return 3 values
        captured.append(graph)
        return graph, graph.output

    monkeypatch.setattr(op_graphs, "capture", capture)
    return captured


def test_new_key_runs_eagerly_then_captures_then_copies_inputs_and_replays(stand_in_capture):
    calls = []
    state = torch.zeros(3)

    def launches(x):
        calls.append(x.data_ptr())
        state.add_(x)  # a side effect, like the append
        return state * 2

    graph = OpGraph()
    first = torch.ones(3)
    assert torch.equal(graph(("buffers", 1), launches, first), torch.full((3,), 2.0))  # eager
    assert stand_in_capture == [] and calls == [first.data_ptr()]
    second = torch.full((3,), 2.0)
    assert torch.equal(graph(("buffers", 1), launches, second), torch.full((3,), 6.0))  # captured, replayed
    assert len(stand_in_capture) == 1 and calls[-1] != second.data_ptr()  # ran on the static copy
    static = graph.inputs[0]
    third = torch.full((3,), 3.0)
    out = graph(("buffers", 1), launches, third)
    assert torch.equal(out, torch.full((3,), 12.0)) and out is graph.output
    assert graph.inputs[0] is static and torch.equal(static, third) and calls[-1] == static.data_ptr()
    assert len(stand_in_capture) == 1 and graph.replays == 2 and torch.equal(state, torch.full((3,), 6.0))


@pytest.mark.parametrize("change", ["key", "input shape", "input dtype"])
def test_a_changed_key_or_input_goes_back_to_eager_and_recaptures(stand_in_capture, change):
    graph = OpGraph()

    def launches(x):
        return x[:3].float() + 1

    x = torch.zeros(3)
    graph("a", launches, x)
    graph("a", launches, x)
    assert len(stand_in_capture) == 1
    key, y = "a", torch.zeros(3)
    if change == "key":
        key = "b"
    elif change == "input shape":
        y = torch.zeros(4)
    else:
        y = torch.zeros(3, dtype=torch.float64)
    out = graph(key, launches, y)
    assert graph.graph is None and len(stand_in_capture) == 1 and out is not stand_in_capture[0].output
    graph(key, launches, y)
    assert len(stand_in_capture) == 2


def test_buffers_key_tells_buffers_apart():
    a = torch.zeros(4, 2)
    assert buffers_key(a, None) == buffers_key(a, None)
    assert buffers_key(a) != buffers_key(a.clone())  # another address
    assert buffers_key(a) != buffers_key(a.view(2, 4))  # same address, another shape
    assert buffers_key(a) != buffers_key(a.t())  # same address, other strides
    assert buffers_key(a) != buffers_key(a.view(torch.int32))  # another dtype


def test_layers_take_the_graphed_path_only_where_it_is_exact():
    config = RocketKVConfig(prompt_budget=16, window_size=4, kernel_size=3, topk=2, page_size=4, backend="torch")
    model, _ = make_models()
    cache = RocketKVCache(config)
    greedy(model, random_ids(1, 40, seed=0), 2, cache=cache)
    layer = cache.layers[0]
    assert isinstance(layer, RocketKVLayer) and layer.compressed
    assert not layer.eager_graphs()  # CPU, PyTorch ops
    assert RocketKVLayer.EAGER_GRAPHS and not BatchedDecodeLayer.EAGER_GRAPHS
    assert all(graph.key is None for graph in layer.op_graphs.values())  # never entered on this path


# ----------------------------------------------------------------------------- CPU: whole generations, stand-in graphs
class ReplayingGraph:
    """Capture records the launches without running them; replay runs them on the static inputs (Python runs at a
    real replay no more than here matters: the launches read only the static inputs and the layer's buffers) and
    points the static output at the result (``set_``), so the caller reads it as it would a real graph's output."""

    def __init__(self, run):
        self.run, self.output = run, torch.empty(0)

    def replay(self):
        result = self.run()
        if result is not None:
            self.output.set_(result)


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The graphed eager path on CPU with the PyTorch ops: the device and backend conditions lifted, the capture
    replaced by ReplayingGraph."""
    captures = []

    def capture(run, pool=None, stream=None):
        graph = ReplayingGraph(run)
        captures.append(graph)
        return graph, graph.output

    def eager_graphs(layer):
        return (layer.EAGER_GRAPHS and layer.config.eager_layer_graphs and layer.history is None
                and layer.generated.settings is None and not layer.hints.in_graph)

    monkeypatch.setattr(op_graphs, "capture", capture)
    monkeypatch.setattr(op_graphs, "request_pool", lambda hints: None)
    monkeypatch.setattr(RocketKVLayer, "eager_graphs", eager_graphs)
    return captures


def _cpu_run(model, ids, config, new_tokens, mask=None, pool=None, by_hand=False):
    cache = RocketKVCache(config, pool=pool) if pool is not None else RocketKVCache(config)
    if by_hand:
        out = _decode_by_hand(model, ids, cache, new_tokens)
    else:
        gen = greedy(model, ids, new_tokens, cache=cache, attention_mask=mask, output_logits=True,
                     return_dict_in_generate=True)
        out = gen.sequences, torch.stack(gen.logits)
    replays = sum(g.replays for layer in cache.layers for g in layer.op_graphs.values())
    state = [(layer.seen.clone(), layer.lengths.clone(), layer.positions.clone()) for layer in cache.layers]
    if pool is not None:
        cache.close()
    return out, replays, state


@pytest.mark.parametrize("case", ["private", "pool", "padded", "grows"])
def test_cpu_graphed_path_equals_plain_eager(graphs_on_cpu, case):
    """The graphed eager path's own logic (``seen`` counted inside the append graph, inputs copied into static
    tensors, a new key after the store grows) gives exactly the plain eager tokens and logits."""
    from hf_rocketkv import KVBlockPool

    model, _ = make_models()
    base = dict(prompt_budget=16, window_size=4, kernel_size=3, topk=2, page_size=4, backend="torch",
                capacity_headroom=8)
    batch = 2 if case == "padded" else 1
    ids = random_ids(batch, 40, seed=3)
    mask = torch.ones_like(ids)
    if case == "padded":
        mask[1, :9] = 0
    results = []
    for graphs in (False, True):
        config = RocketKVConfig(**base, eager_layer_graphs=graphs)
        pool = None
        if case == "pool":
            pool = KVBlockPool(model.config, max_gpu_bytes=1 << 20, page_size=8, dtype=torch.float32, device="cpu",
                               kt_page_size=4, kt_dtype=config.kt_cache_dtype)
        results.append(_cpu_run(model, ids, config, 30, mask=mask, pool=pool, by_hand=case == "grows"))
    ((plain_ids, plain_logits), plain_replays, plain_state), ((graph_ids, graph_logits), graph_replays, graph_state) = \
        results
    assert plain_replays == 0 and graph_replays > 0 and len(graphs_on_cpu) > 0
    if case == "grows":  # headroom 8: the store grew several times, each time dropping and recapturing
        assert len(graphs_on_cpu) > 2 * 2 * 2
    assert torch.equal(plain_ids, graph_ids)
    assert torch.equal(plain_logits, graph_logits)
    for plain, graphed in zip(plain_state, graph_state, strict=True):  # logical length, stored tokens, positions
        assert all(torch.equal(a, b) for a, b in zip(plain, graphed))


def test_config_field():
    assert RocketKVConfig().eager_layer_graphs is True
    assert RocketKVConfig(eager_layer_graphs=False).eager_layer_graphs is False
    with pytest.raises(ValueError, match="eager_layer_graphs must be True or False, got 'yes'"):
        RocketKVConfig(eager_layer_graphs="yes")
    assert RocketKVConfig.from_dict(RocketKVConfig(eager_layer_graphs=False).to_dict()).eager_layer_graphs is False


# ------------------------------------------------------------------------------------------------------------- GPU
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def gpu(test):
    """A GPU-only test: marked ``gpu`` (pytest -m gpu) and skipped without CUDA."""
    return pytest.mark.gpu(requires_cuda(test))


def _generate(model, ids, cache, new_tokens, mask=None):
    out = model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids), cache=cache,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, disable_compile=True, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _gpu_model(dtype=torch.bfloat16, layers=2):
    from hf_rocketkv.bench.decode import build_model
    from hf_rocketkv.integration.registration import enable

    shapes = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, vocab_size=1000, max_position_embeddings=8192, rope_theta=500000.0)
    return enable(build_model(shapes, layers, dtype, torch.device("cuda"), seed=0))


def _decode_by_hand(model, ids, cache, steps):
    """Greedy decoding with plain forwards (no generate(): nothing plans the store's room, so it grows)."""
    logits, tokens = [], []
    with torch.no_grad():
        out = model(ids, **cache_kwargs(cache), use_cache=True)
        for _ in range(steps):
            logits.append(out.logits[:, -1].float())
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
            out = model(tokens[-1], **cache_kwargs(cache), use_cache=True)
    return torch.cat(tokens, dim=1), torch.stack(logits)


@gpu
@pytest.mark.parametrize("pages", ["private", "pool", "pool-fp8", "grows", "padded"])
def test_gpu_graphed_eager_decode_equals_plain_eager(pages):
    model = _gpu_model()
    base = dict(prompt_budget=256, topk=16, page_size=4, window_size=16, backend="triton")
    batch = 2 if pages == "padded" else 1
    ids = torch.randint(3, 1000, (batch, 1200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    if pages == "padded":
        mask[1, :300] = 0
    results, replays, stores = [], [], []
    for graphs in (False, True):
        config = RocketKVConfig(**base, eager_layer_graphs=graphs)
        pool = None
        if pages.startswith("pool"):
            pool = KVBlockPool(model, max_gpu_bytes=256 << 20, page_size=16,
                               dtype=torch.float8_e4m3fn if pages == "pool-fp8" else None)
        cache = RocketKVCache(config, pool=pool) if pool is not None else RocketKVCache(config)
        if pages == "grows":  # capacity_headroom 256 past the prompt budget: grows after ~256 steps
            results.append(_decode_by_hand(model, ids, cache, 300))
            stores.append(cache.layers[0].capacity)
        else:
            results.append(_generate(model, ids, cache, 40, mask))
        replays.append(sum(g.replays for layer in cache.layers for g in layer.op_graphs.values()))
        if pool is not None:
            cache.close()
    (plain_ids, plain_logits), (graph_ids, graph_logits) = results
    assert replays[0] == 0 and replays[1] > 0
    if pages == "grows":
        assert stores[1] > 256 + 256  # the store did grow: every graph dropped, then captured into a fresh pool
    assert torch.equal(plain_ids, graph_ids)
    assert torch.equal(plain_logits, graph_logits)


@gpu
def test_gpu_one_memory_pool_per_request():
    """Every layer's graphs capture into the request's one pool: the graphs' memory does not grow with the layers
    (32 graphs with a pool each would reserve at least 2 MiB apiece)."""
    model = _gpu_model(layers=16)
    ids = torch.randint(3, 1000, (1, 1200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    growth = {}
    for graphs in (False, True):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        cache = RocketKVCache(RocketKVConfig(prompt_budget=256, topk=16, page_size=4, window_size=16, backend="triton",
                                             eager_layer_graphs=graphs))
        _generate(model, ids, cache, 8)
        torch.cuda.synchronize()
        growth[graphs] = torch.cuda.memory_reserved() - before
        if graphs:
            pool = cache.hints.op_graph_pool[torch.cuda.current_device()]
            assert list(cache.hints.op_graph_pool) == [torch.cuda.current_device()] and len(pool.graphs) == 2 * 16
            assert all(layer.op_graphs["attention"].replays > 0 for layer in cache.layers)
        del cache
    assert growth[True] - growth[False] < 16 * 2**20, growth
