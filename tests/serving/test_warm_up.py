"""BatchingEngine.warm_up (serving/batching/warm_up.py): every bucket's decode graph captured before serving, on the
tiny random Llama (CPU, with the stand-in capture backend of tests/support/decode_runners.py).

Oracle: each request alone through model.generate with its own RocketKVCache (the ``oracle`` fixture of
tests/serving/conftest.py, on a second copy of the model).
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import KVBlockPool
from hf_rocketkv.integration.batch_graphs import BatchedDecodeGraphs
from hf_rocketkv.memory.errors import PoolExhaustedError
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.serving.helpers import CFG, Events, make_pool, prompt_of, request
from tests.support.decode_runners import StandInBackend

BUCKETS = (1, 2, 4, 8)
WARM_TOKENS = 12
# (prompt length, max_tokens <= WARM_TOKENS): under, at and over prompt_budget (24), up to far over it
WORKLOAD = [(5, 12), (17, 3), (24, 12), (25, 1), (30, 7), (45, 12), (80, 10), (33, 12), (26, 5)]


@pytest.fixture
def make_engine(tiny_pair):
    """``make(pool=None, graphs=True, backend=None, **batching) -> (engine, backend, pool)``: graphs on the CPU
    stand-in backend (``graphs=False``: the engine's default, CUDA-only graphs); not started; stopped at teardown."""
    made = []

    def make(pool=None, graphs=True, backend=None, **batching):
        model = tiny_pair[0]
        pool = pool if pool is not None else make_pool(model)
        backend = backend if backend is not None else StandInBackend()
        decode_graphs = BatchedDecodeGraphs(model, backend=backend, devices=("cpu",)) if graphs else None
        config = BatchingConfig(**{"max_running": 8, "buckets": BUCKETS, "prefills_per_step": 3, **batching})
        engine = BatchingEngine(model, CFG, pool, config, decode_graphs=decode_graphs)
        made.append(engine)
        return engine, backend, pool

    yield make
    for engine in made:
        if engine._thread is not None:
            engine.stop(drain=False, timeout=60)


def serve(engine, workload, tag: str) -> dict[str, list[int]]:
    """Start the engine, submit every request at once, wait for all; returns each request's tokens."""
    events = Events()
    engine.start(events)
    prompts = {f"{tag}{i}": (prompt_of(n, seed=300 + i), m) for i, (n, m) in enumerate(workload)}
    for rid, (prompt, m) in prompts.items():
        engine.submit(request(rid, prompt, m))
    events.wait_finals(len(prompts))
    engine.stop(timeout=60)
    assert all(e.finish_reason.value == "length" for e in events.finals()), events.finals()
    return {rid: events.tokens(rid) for rid in prompts}


def expected(oracle, workload, tag: str) -> dict[str, list[int]]:
    return {f"{tag}{i}": oracle(prompt_of(n, seed=300 + i), m) for i, (n, m) in enumerate(workload)}


# ------------------------------------------------------------------------------------------------ captures
@pytest.mark.parametrize("page_size,prefix_reuse", [(4, True), (16, True), (8, False)])
def test_after_warm_up_the_workload_captures_nothing(make_engine, oracle, tiny_pair, page_size, prefix_reuse):
    """Every bucket is captured once at warm-up; requests of any prompt length with max_tokens <= max_new_tokens
    then neither capture nor widen the tables (the batch's version stays), and their tokens are each alone's."""
    pool = KVBlockPool(tiny_pair[0], max_gpu_bytes=1 << 20, page_size=page_size, dtype=torch.float32, device="cpu",
                       kt_page_size=CFG.page_size, kt_dtype=CFG.kt_cache_dtype, prefix_reuse=prefix_reuse)
    engine, backend, _ = make_engine(pool=pool)
    result = engine.warm_up(max_new_tokens=WARM_TOKENS)
    assert result["buckets"] == BUCKETS and result["captures"] == len(BUCKETS) == backend.captures
    assert result["max_new_tokens"] == WARM_TOKENS and result["seconds"] > 0
    assert result["table_pages"] == engine.batch.layers[0].width
    assert pool.free_pages() == pool.total_pages()
    version, replays = engine.batch.version, backend.replays

    tokens = serve(engine, WORKLOAD, "w")
    assert tokens == expected(oracle, WORKLOAD, "w")
    assert backend.captures == len(BUCKETS)  # no capture while serving
    assert engine.batch.version == version and engine.batch.layers[0].width == result["table_pages"]
    assert backend.replays > replays  # the workload really ran on the warmed graphs
    assert pool.free_pages() == pool.total_pages()


def test_warmed_and_unwarmed_engines_give_the_same_tokens(make_engine, oracle):
    runs = []
    for warm in (False, True):
        engine, backend, _ = make_engine()
        if warm:
            engine.warm_up(max_new_tokens=WARM_TOKENS)
        runs.append(serve(engine, WORKLOAD, "s"))
    assert runs[0] == runs[1] == expected(oracle, WORKLOAD, "s")


def test_a_request_past_the_warmed_max_tokens_widens_the_tables(make_engine, oracle):
    """The check above can fail: a longer max_tokens than warmed up widens the tables and captures again."""
    engine, backend, pool = make_engine()
    result = engine.warm_up(max_new_tokens=4, buckets=(1,))
    assert result["max_new_tokens"] == 4 and result["captures"] == 1
    version = engine.batch.version
    workload = [(40, 30)]
    assert serve(engine, workload, "x") == expected(oracle, workload, "x")
    assert engine.batch.version > version and engine.batch.layers[0].width > result["table_pages"]
    assert backend.captures == 2
    assert pool.free_pages() == pool.total_pages()


def test_default_buckets_go_up_to_the_bucket_of_max_running(make_engine):
    engine, backend, pool = make_engine(max_running=3)
    result = engine.warm_up(max_new_tokens=2)
    assert result["buckets"] == (1, 2, 4) and backend.captures == 3
    assert result["max_new_tokens"] == 2 * 3 + 1  # room for two steps per bucket
    assert pool.free_pages() == pool.total_pages()


def test_warm_up_without_graphs_runs_eager_steps(make_engine, oracle):
    """On the CPU the engine's default graphs are CUDA-only: warm-up steps run eagerly and capture nothing."""
    engine, _, pool = make_engine(graphs=False)
    assert not engine.graphs_in_use
    result = engine.warm_up(max_new_tokens=WARM_TOKENS)
    assert result["captures"] == 0 and result["buckets"] == BUCKETS
    assert pool.free_pages() == pool.total_pages()
    workload = WORKLOAD[:4]
    assert serve(engine, workload, "e") == expected(oracle, workload, "e")
    assert engine.stats().prefills == len(workload)  # the synthetic request is not counted
    assert pool.free_pages() == pool.total_pages()


def test_a_failing_capture_at_warm_up_falls_back_to_eager_steps(make_engine, oracle):
    class Failing(StandInBackend):
        def capture(self, run):
            raise RuntimeError("operation not permitted when stream is capturing")

    engine, _, pool = make_engine(backend=Failing())
    result = engine.warm_up(max_new_tokens=WARM_TOKENS)
    assert result["captures"] == 0 and engine.graphs is None
    assert pool.free_pages() == pool.total_pages()
    workload = WORKLOAD[:3]
    assert serve(engine, workload, "f") == expected(oracle, workload, "f")


def test_a_failing_step_at_warm_up_leaves_the_pool_all_free(make_engine, oracle):
    engine, _, pool = make_engine()
    real = engine._decoder._graphed_step
    calls = []

    def broken(ids, positions):
        calls.append(ids.shape[0])
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(ids, positions)

    engine._decoder._graphed_step = broken
    with pytest.raises(RuntimeError, match="injected"):
        engine.warm_up(max_new_tokens=WARM_TOKENS)
    engine._decoder._graphed_step = real
    assert pool.free_pages() == pool.total_pages()
    assert engine.batch.joined == 0
    workload = WORKLOAD[:3]
    assert serve(engine, workload, "b") == expected(oracle, workload, "b")  # the engine serves on


# ------------------------------------------------------------------------------------------------ refusals
def test_warm_up_after_start_raises(make_engine):
    engine, _, _ = make_engine()
    engine.start(Events())
    with pytest.raises(RuntimeError, match=r"before start\(\)"):
        engine.warm_up()


@pytest.mark.parametrize("value", [0, -3, 2.5, "8", True, None])
def test_bad_max_new_tokens_is_refused(make_engine, value):
    engine, _, pool = make_engine()
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.warm_up(max_new_tokens=value)
    assert pool.free_pages() == pool.total_pages()


@pytest.mark.parametrize("value", [(3,), (1, 16), (), 4, ("1",)])
def test_bad_buckets_are_refused(make_engine, value):
    engine, _, pool = make_engine()
    with pytest.raises(ValueError, match="buckets"):
        engine.warm_up(buckets=value)
    assert pool.free_pages() == pool.total_pages()


def test_a_pool_too_small_for_the_synthetic_request_names_pages_needed_and_free(make_engine, tiny_pair):
    pool = make_pool(tiny_pair[0], page_size=8, mib=0.02)  # a handful of pages
    engine, backend, _ = make_engine(pool=pool)
    with pytest.raises(PoolExhaustedError, match=r"warm_up.*needs \d+ pages but only \d+ of \d+ are free") as err:
        engine.warm_up(max_new_tokens=4096)
    assert err.value.pages_needed > err.value.pages_free == pool.total_pages()
    assert backend.captures == 0 and pool.free_pages() == pool.total_pages()


# ------------------------------------------------------------------------------------------------ wiring
@pytest.fixture
def graphed_on_cpu(monkeypatch):
    """Pretend the engine's default graphs are in use (they are CUDA-only), so the manager warms up on the CPU (the
    steps then run eagerly); records every warm_up call's max_new_tokens."""
    calls = []
    real = BatchingEngine.warm_up

    def spy(self, max_new_tokens=512, buckets=None):
        calls.append(max_new_tokens)
        return real(self, max_new_tokens, buckets)

    monkeypatch.setattr(BatchingEngine, "graphs_in_use", property(lambda self: True))
    monkeypatch.setattr(BatchingEngine, "warm_up", spy)
    return calls


@pytest.mark.parametrize("kwargs, warmed", [
    ({"warmup_max_tokens": 7}, [7]),
    ({}, [512]),  # the manager's default
    ({"warmup_max_tokens": 0}, []),
    ({"warmup_max_tokens": 20, "max_model_len": 36}, [36 - 33]),  # capped by the context after the 33-token prompt
    ({"warmup_max_tokens": 20, "max_model_len": 33}, []),  # no room at all: skipped
])
def test_the_manager_warms_up_a_graphed_batching_engine(tiny_pair, graphed_on_cpu, kwargs, warmed):
    from hf_rocketkv.serving import GenerationManager

    pool = make_pool(tiny_pair[0])
    manager = GenerationManager(tiny_pair[0], None, CFG, pool=pool,
                                batching=BatchingConfig(max_running=2, buckets=(1, 2)), **kwargs)
    try:
        assert graphed_on_cpu == warmed
        assert pool.free_pages() == pool.total_pages()
    finally:
        manager.stop()


def test_the_manager_skips_warm_up_without_graphs_and_refuses_bad_values(tiny_pair):
    from hf_rocketkv.serving import GenerationManager

    pool = make_pool(tiny_pair[0])
    manager = GenerationManager(tiny_pair[0], None, CFG, pool=pool, warmup_max_tokens=64)
    try:
        assert not manager.engine.graphs_in_use and manager.engine.batch.layers == []  # nothing ran on the CPU
    finally:
        manager.stop()
    for value in (-1, 2.0, "8"):
        with pytest.raises(ValueError, match="warmup_max_tokens"):
            GenerationManager(tiny_pair[0], None, CFG, pool=pool, warmup_max_tokens=value)


def test_a_pool_too_small_for_the_warm_up_is_logged_and_the_manager_serves(tiny_pair, graphed_on_cpu, caplog,
                                                                           oracle):
    from hf_rocketkv.serving import GenerationManager, SamplingParams

    pool = make_pool(tiny_pair[0], page_size=8, mib=0.06)  # room for the request below, not for 991 new tokens
    with caplog.at_level("WARNING", logger="hf_rocketkv.serving.builder"):
        manager = GenerationManager(tiny_pair[0], None, CFG, pool=pool, warmup_max_tokens=4096)
    try:
        assert graphed_on_cpu == [1024 - 33]  # capped by the tiny model's context
        assert "no startup capture" in caplog.text and "needs" in caplog.text
        prompt = prompt_of(30, seed=5)
        rid = manager.add_request(prompt, SamplingParams.greedy(4, ignore_eos=True))
        assert list(manager.result(rid).token_ids) == oracle(prompt, 4)
    finally:
        manager.stop()
    assert pool.free_pages() == pool.total_pages()


def test_generate_batch_does_not_warm_up(tiny_pair, graphed_on_cpu, oracle):
    """One workload: its buckets are captured as it reaches them; capturing them all first would only add."""
    from hf_rocketkv.serving import SamplingParams, generate_batch

    pool = make_pool(tiny_pair[0])
    prompt = prompt_of(30, seed=61)
    results = generate_batch(tiny_pair[0], [prompt], config=CFG, pool=pool,
                             sampling=SamplingParams.greedy(3, ignore_eos=True))
    assert graphed_on_cpu == [] and list(results[0].token_ids) == oracle(prompt, 3)
