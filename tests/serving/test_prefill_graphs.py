"""The prefill attention graphs that ``BatchingEngine.warm_up`` plans and ``start()`` builds
(serving/batching/prefill_graphs.py).

cuDNN keeps its graphs per thread, so they must be built on the thread that prefills: the engine thread, or the
prefill thread with ``concurrent_prefill_tokens``, and ``start()`` must return only once they are. On the CPU cuDNN
never runs, so the builder (``warm_cudnn_graphs``) is replaced by a recorder of its thread and shapes; which shapes
it gets is ``cudnn_shapes``' (tests/integration/test_causal_prefill.py). Requests then give each one's tokens alone.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hf_rocketkv.integration.causal_prefill import cudnn_shapes
from hf_rocketkv.serving.batching import prefill_graphs
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.serving.helpers import CFG, Events, make_pool, prompt_of, request

CHUNK = 16


class Recorder:
    """Stands in for ``warm_cudnn_graphs``: records the thread and the shapes, takes a while, says it built them."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[str, list]] = []
        self.fail = fail

    def __call__(self, shapes, query_heads, kv_heads, head_dim, dtype, device, sinks=False):
        time.sleep(0.2)  # start() must wait for this
        self.calls.append((threading.current_thread().name, list(shapes), (query_heads, kv_heads, head_dim, dtype)))
        if self.fail:
            raise RuntimeError("no cuDNN here")
        return len(shapes)


@pytest.fixture
def engines(tiny_pair):
    made = []

    def make(**batching):
        config = BatchingConfig(**{"max_running": 4, "buckets": (1, 2, 4), "prefill_chunk_tokens": CHUNK,
                                   "prefill_token_budget": CHUNK, **batching})
        engine = BatchingEngine(tiny_pair[0], CFG, make_pool(tiny_pair[0]), config, decode_graphs=False)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if engine._thread is not None:
            engine.stop(drain=False, timeout=60)


def serve(engine, recorder, lengths):
    """Start (which must build the graphs first), serve prompts of ``lengths``; (the builds seen as soon as start()
    returned, each request's tokens)."""
    events = Events()
    engine.start(events)
    built_at_start = list(recorder.calls)
    for i, n in enumerate(lengths):
        engine.submit(request(f"r{i}", prompt_of(n, seed=40 + i), 5))
    events.wait_finals(len(lengths))
    engine.stop(timeout=60)
    return built_at_start, {f"r{i}": events.tokens(f"r{i}") for i in range(len(lengths))}


@pytest.mark.parametrize("concurrent, thread", [(None, "hf-rocketkv-batching"), (4, "hf-rocketkv-prefill")])
def test_start_builds_the_planned_graphs_on_the_prefilling_thread_then_serves(engines, oracle, monkeypatch,
                                                                              tiny_pair, concurrent, thread):
    recorder = Recorder()
    monkeypatch.setattr(prefill_graphs, "warm_cudnn_graphs", recorder)
    engine = engines(concurrent_prefill_tokens=concurrent)
    report = engine.warm_up(max_new_tokens=6, prefill_tokens=3 * CHUNK)
    assert report["prefill_shapes"] == len(cudnn_shapes(CHUNK, 3 * CHUNK)) and not recorder.calls
    lengths = [5, CHUNK + 3, 3 * CHUNK]
    built_at_start, tokens = serve(engine, recorder, lengths)
    text = tiny_pair[0].config.get_text_config()
    assert built_at_start == [(thread, cudnn_shapes(CHUNK, 3 * CHUNK),
                               (text.num_attention_heads, text.num_key_value_heads, text.head_dim,
                                tiny_pair[0].dtype))]
    assert engine.prefill_graphs.report["thread"] == thread
    assert engine.prefill_graphs.report["shapes"] == len(cudnn_shapes(CHUNK, 3 * CHUNK))
    assert tokens == {f"r{i}": oracle(prompt_of(n, seed=40 + i), 5) for i, n in enumerate(lengths)}


def test_the_default_covers_two_chunks_and_zero_plans_nothing(engines, monkeypatch):
    monkeypatch.setattr(prefill_graphs, "warm_cudnn_graphs", Recorder())
    engine = engines()
    assert engine.warm_up(max_new_tokens=6)["prefill_shapes"] == len(cudnn_shapes(CHUNK, 2 * CHUNK))
    assert engine.prefill_graphs.prompt_tokens == 2 * CHUNK
    other = engines()
    assert other.warm_up(max_new_tokens=6, prefill_tokens=0)["prefill_shapes"] == 0
    assert other.prefill_graphs is None


def test_a_failing_build_is_logged_and_the_engine_serves(engines, oracle, monkeypatch, caplog):
    recorder = Recorder(fail=True)
    monkeypatch.setattr(prefill_graphs, "warm_cudnn_graphs", recorder)
    engine = engines()
    engine.warm_up(max_new_tokens=6, prefill_tokens=2 * CHUNK)
    built_at_start, tokens = serve(engine, recorder, [7, 2 * CHUNK])
    assert len(built_at_start) == 1 and engine.prefill_graphs.report is None
    assert "building the prefill attention graphs failed" in caplog.text
    assert tokens == {"r0": oracle(prompt_of(7, seed=40), 5), "r1": oracle(prompt_of(2 * CHUNK, seed=41), 5)}


@pytest.mark.parametrize("value", [-1, 2.5, "16", True])
def test_bad_prefill_tokens_are_refused_before_anything_runs(engines, value):
    engine = engines()
    with pytest.raises(ValueError, match="prefill_tokens"):
        engine.warm_up(max_new_tokens=6, prefill_tokens=value)
    assert engine.prefill_graphs is None and engine.batch.version == 0


def test_wait_returns_once_built_released_or_the_thread_ended(tiny_pair):
    graphs = prefill_graphs.PrefillGraphs(tiny_pair[0], make_pool(tiny_pair[0]), torch.device("cpu"), CHUNK, 2 * CHUNK)
    started = time.perf_counter()
    graphs.wait(alive=lambda: False)  # the engine thread ended before building: no hang
    assert time.perf_counter() - started < 5 and graphs.report is None
    threading.Timer(0.2, graphs.release).start()
    graphs.wait()  # returns once released
    built = prefill_graphs.PrefillGraphs(tiny_pair[0], make_pool(tiny_pair[0]), torch.device("cpu"), CHUNK, 2 * CHUNK)
    built.build()
    built.wait()
    assert built.report["shapes"] == 0 and built.report["thread"] == threading.current_thread().name  # CPU: none


@pytest.mark.parametrize("arch, planned, sinks", [("gemma3", True, False), ("gemma2", False, False),
                                                  ("gpt_oss", True, True), ("mistral", False, False)])
def test_models_whose_prefill_never_reaches_cudnn_plan_no_shape(arch, planned, sinks, monkeypatch):
    """Gemma 3's full layers are plain attention and gpt-oss' take cuDNN with their sinks (the graphs built as a
    model with sinks meets them); Gemma 2 soft-caps its logits (another attention path) and Mistral with a window has
    no full-attention layer: nothing to build for those."""
    from tests.support.hybrid_models import make_hybrid_models
    from tests.support.tiny_models import cpu_pool

    asked = []
    real = prefill_graphs.warm_cudnn_graphs
    monkeypatch.setattr(prefill_graphs, "warm_cudnn_graphs",
                        lambda *a, sinks=False: asked.append(sinks) or real(*a, sinks=sinks))
    model, _ = make_hybrid_models(arch)
    pool = cpu_pool(model, CFG, 2 << 20, 8, sliding_slots=3)
    engine = BatchingEngine(model, CFG, pool, BatchingConfig(max_running=2, buckets=(1, 2),
                                                             prefill_chunk_tokens=CHUNK), decode_graphs=False)
    graphs = prefill_graphs.PrefillGraphs(model, pool, torch.device("cpu"), CHUNK, 2 * CHUNK)
    assert graphs.shapes == (cudnn_shapes(CHUNK, 2 * CHUNK) if planned else [])
    report = engine.warm_up(max_new_tokens=4, prefill_tokens=2 * CHUNK)
    assert report["prefill_shapes"] == (len(cudnn_shapes(CHUNK, 2 * CHUNK)) if planned else 0)
    graphs.build()  # (the CPU builds nothing: the builder is asked, with or without sinks)
    assert asked == [sinks]


def test_heads_wider_than_the_cudnn_path_plan_no_shape():
    """Heads over CUDNN_MAX_HEAD_DIM (Gemma 3's 256) keep flash: nothing to build."""
    from hf_rocketkv.integration.causal_prefill import CUDNN_MAX_HEAD_DIM
    from tests.support.tiny_models import make_models

    wide, _ = make_models("llama", head_dim=2 * CUDNN_MAX_HEAD_DIM)
    narrow, _ = make_models("llama", head_dim=CUDNN_MAX_HEAD_DIM)
    assert prefill_graphs.PrefillGraphs(wide, make_pool(wide), torch.device("cpu"), CHUNK, 2 * CHUNK).shapes == []
    assert prefill_graphs.PrefillGraphs(narrow, make_pool(narrow), torch.device("cpu"), CHUNK, 2 * CHUNK).shapes == \
        cudnn_shapes(CHUNK, 2 * CHUNK)
