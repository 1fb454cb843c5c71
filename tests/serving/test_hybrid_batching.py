"""The batching engine on models with sliding-window layers (gpt-oss, Gemma 3, Mistral with a window) and on Llama 4
(chunked-attention layers of 8 tokens, a NoPE layer whose queries are scaled by position every 4 tokens): tiny random
configs, CPU float32. Requests batched, each request's tokens those of the request alone (model.generate with its
own RocketKVCache, no pool; tests/integration/test_chunked_models.py checks that one against transformers' own
cache), ragged prompts, decodes across chunk boundaries, requests joining mid-run, decode graphs (a CPU stand-in),
cancel; every page and sliding-window slot back in the pool at the end.
"""

from __future__ import annotations

import pytest

from hf_rocketkv.serving import FinishReason, GenerationManager, SamplingParams
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.serving.helpers import CFG, Events, ForwardGate, PackedLog, oracle_tokens, prompt_of, request, wait_until
from tests.integration.test_chunked_models import GENERATE_BROKEN
from tests.support.hybrid_models import make_hybrid_models, make_llama4_models
from tests.support.tiny_models import cpu_pool

ARCHS = ["gpt_oss", "gemma3", "mistral", "llama4"]
PROMPTS = [(30, 9), (17, 3), (45, 12), (5, 6), (26, 1), (33, 8)]  # ragged; some under the budget, some in one window


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request):
    """``(arch, served, oracle_model)``: two copies of one tiny hybrid model (same weights)."""
    if request.param == "llama4":
        if GENERATE_BROKEN:
            pytest.skip("this transformers' generate() cannot run Llama 4 (the oracle): test_chunked_models.py")
        return request.param, make_llama4_models()[0], make_llama4_models()[0]
    served, _ = make_hybrid_models(request.param)
    alone, _ = make_hybrid_models(request.param)
    return request.param, served, alone


def all_back(pool) -> bool:
    return pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()


def run_engine(served, pool, submissions, graphs=None, **batching):
    batching = {"max_running": 8, "buckets": (1, 2, 4, 8), **batching}
    engine = BatchingEngine(served, CFG, pool, BatchingConfig(**batching), decode_graphs=graphs)
    events = Events()
    engine.start(events)
    try:
        submissions(engine, events)
    finally:
        engine.stop(timeout=60)
    return engine, events


def test_requests_batched_equal_each_alone(hybrid):
    arch, served, alone = hybrid
    pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=10)
    prompts = [prompt_of(n, seed=n) for n, _ in PROMPTS]

    def submit(engine, events):
        for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
            engine.submit(request(f"r{i}", prompt, n))
        events.wait_finals(len(PROMPTS))

    engine, events = run_engine(served, pool, submit)
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"r{i}") == oracle_tokens(alone, prompt, CFG, n), f"{arch} request {i}"
    assert engine.steps < sum(n for _, n in PROMPTS)  # rows really decoded together
    assert all_back(pool)


def test_requests_joining_mid_run_with_graphs_equal_each_alone(hybrid):
    from hf_rocketkv.integration.batch_graphs import BatchedDecodeGraphs
    from tests.support.decode_runners import StandInBackend

    arch, served, alone = hybrid
    pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=4)  # fewer slots than requests: they wait for one
    backend = StandInBackend()
    graphs = BatchedDecodeGraphs(served, backend=backend, devices=("cpu",))
    prompts = [prompt_of(n, seed=300 + n) for n, _ in PROMPTS]

    def submit(engine, events):
        gate = ForwardGate(engine.model, delay=0.002)
        try:
            for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
                engine.submit(request(f"g{i}", prompt, n + 4))
                wait_until(lambda: engine.steps >= 2 * (i + 1), timeout=10)
            events.wait_finals(len(PROMPTS))
        finally:
            gate.remove()

    engine, events = run_engine(served, pool, submit, graphs=graphs, prefills_per_step=2)
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"g{i}") == oracle_tokens(alone, prompt, CFG, n + 4), f"{arch} request {i}"
    assert backend.captures >= 1 and backend.replays > backend.captures
    assert all_back(pool)


def test_a_replayed_batched_step_reads_nothing_back_from_the_device(hybrid):
    """The Triton backend (interpreted here), as on a GPU: no op of a replayed batched step (the rows' slot writes,
    the ring reads and masks, the paged layers' kernels) makes the host wait for the device."""
    from hf_rocketkv.integration.batch_graphs import BatchedDecodeGraphs
    from tests.integration.test_hybrid_decode_graphs import SyncCountingBackend

    arch, served, alone = hybrid
    config = CFG.replace(backend="triton")
    pool = cpu_pool(served, config, 2 << 20, 8, sliding_slots=4)
    backend = SyncCountingBackend()
    graphs = BatchedDecodeGraphs(served, backend=backend, devices=("cpu",))
    engine = BatchingEngine(served, config, pool, BatchingConfig(max_running=4, buckets=(1, 2, 4)),
                            decode_graphs=graphs)
    events = Events()
    engine.start(events)
    try:
        for i, n in enumerate((30, 17, 45)):
            engine.submit(request(f"t{i}", prompt_of(n, seed=n), 8))
        events.wait_finals(3)
    finally:
        engine.stop(timeout=60)
    assert backend.replays > 0
    assert backend.reads.total == 0, dict(backend.reads.counts)
    assert all_back(pool)


def test_cancel_returns_every_page_and_slot(hybrid):
    arch, served, alone = hybrid
    pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=4)

    def submit(engine, events):
        gate = ForwardGate(engine.model, delay=0.01)
        try:
            engine.submit(request("long", prompt_of(30, seed=4), 200))
            engine.submit(request("other", prompt_of(22, seed=5), 20))
            assert wait_until(lambda: len(events.tokens("long")) >= 3)
            assert pool.free_slots() < pool.total_slots()
            engine.cancel("long")
            events.wait_finals(2)
        finally:
            gate.remove()

    _, events = run_engine(served, pool, submit)
    assert events.finals("long")[0].finish_reason is FinishReason.CANCELLED
    assert events.tokens("other") == oracle_tokens(alone, prompt_of(22, seed=5), CFG, 20)
    assert all_back(pool)


def test_the_manager_picks_the_batching_engine_for_a_hybrid_model(hybrid):
    arch, served, alone = hybrid
    pool = cpu_pool(served, CFG, 2 << 20, 8)
    with GenerationManager(served, None, CFG, pool=pool) as manager:
        assert type(manager.engine).__name__ == "BatchingEngine"
        prompt = prompt_of(28, seed=9)
        request_id = manager.add_request(prompt, SamplingParams.greedy(5))
        assert list(manager.result(request_id, timeout=60).token_ids) == oracle_tokens(alone, prompt, CFG, 5)
        metrics = manager.metrics()
        assert (metrics.free_slots, metrics.total_slots) == (pool.free_slots(), pool.total_slots())
    assert all_back(pool)


def test_chunked_prefills_equal_each_alone(hybrid):
    """Prompts prefilled in chunks of 8 tokens between decode steps (the sliding layers' ordered store grows a
    chunk at a time, then moves into the request's slot when it joins)."""
    arch, served, alone = hybrid
    pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=8)
    prompts = [prompt_of(n, seed=700 + n) for n, _ in PROMPTS]

    def submit(engine, events):
        for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
            engine.submit(request(f"c{i}", prompt, n))
        events.wait_finals(len(PROMPTS))

    _, events = run_engine(served, pool, submit, prefill_chunk_tokens=8, prefill_token_budget=8)
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"c{i}") == oracle_tokens(alone, prompt, CFG, n), f"{arch} request {i}"
    assert all_back(pool)


def test_warm_up_captures_every_bucket_then_requests_equal_each_alone(hybrid):
    from hf_rocketkv.integration.batch_graphs import BatchedDecodeGraphs
    from tests.support.decode_runners import StandInBackend

    arch, served, alone = hybrid
    pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=9)
    backend = StandInBackend()
    graphs = BatchedDecodeGraphs(served, backend=backend, devices=("cpu",))
    engine = BatchingEngine(served, CFG, pool, BatchingConfig(max_running=8, buckets=(1, 2, 4, 8)),
                            decode_graphs=graphs)
    report = engine.warm_up(max_new_tokens=8)
    assert report["captures"] == 4 and all_back(pool)
    captures = backend.captures
    events = Events()
    engine.start(events)
    try:
        prompts = [prompt_of(n, seed=500 + n) for n, _ in PROMPTS]
        for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
            engine.submit(request(f"w{i}", prompt, n))
        events.wait_finals(len(PROMPTS))
    finally:
        engine.stop(timeout=60)
    assert backend.captures == captures  # nothing captured while serving
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"w{i}") == oracle_tokens(alone, prompt, CFG, n), f"{arch} request {i}"
    assert all_back(pool)


def test_generate_batch_equals_each_alone(hybrid):
    from hf_rocketkv.serving import generate_batch

    arch, served, alone = hybrid
    pool = cpu_pool(served, CFG, 2 << 20, 8)
    prompts = [prompt_of(n, seed=900 + n) for n in (33, 12, 27)]
    results = generate_batch(served, prompts, config=CFG, pool=pool, sampling=SamplingParams.greedy(6))
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == oracle_tokens(alone, prompt, CFG, 6), arch
    assert all_back(pool)


PACKED = {"packed_steps": True, "prefill_chunk_tokens": 16, "prefill_token_budget": 16}


@pytest.mark.parametrize("packed", [False, True], ids=["alternating", "packed_steps"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_and_cancels_return_every_slot(hybrid, seed, packed):
    """Arrivals, cancels, max_tokens and prompt lengths at random, fewer slots than requests: one final event each,
    each row's tokens those of the request alone (a cancelled one: a prefix of them), every page and slot back; with
    prompts packed into the decode steps' forwards in chunks of 16 too (Llama 4 keeps alternating), so arrivals and
    cancels land between a prompt's chunks."""
    import random

    arch, served, alone = hybrid
    rng = random.Random(seed)
    pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=rng.choice([2, 3, 5]))
    sent = []

    def submit(engine, events):
        for i in range(8):
            prompt, n = prompt_of(rng.randint(3, 40), seed=rng.randint(0, 10**6)), rng.randint(1, 10)
            engine.submit(request(f"q{i}", prompt, n))
            sent.append((f"q{i}", prompt, n))
            if rng.random() < 0.3:
                victim = rng.choice(sent)[0]
                wait_until(lambda: len(events.tokens(victim)) >= rng.randint(0, 3), timeout=2)
                engine.cancel(victim)
            wait_until(lambda: engine.steps >= rng.randint(0, 2 * i), timeout=2)
        events.wait_finals(len(sent))

    forwards = PackedLog(served)
    try:
        _, events = run_engine(served, pool, submit, prefills_per_step=rng.choice([1, 2]), max_running=6,
                               **(PACKED if packed else {}))
    finally:
        forwards.remove()
    assert any(kind == "packed" for kind, _, _ in forwards.kinds()) == (packed and arch != "llama4"), arch
    for rid, prompt, n in sent:
        finals = events.finals(rid)
        assert len(finals) == 1, rid
        tokens, expected = events.tokens(rid), oracle_tokens(alone, prompt, CFG, n)
        if finals[0].finish_reason is FinishReason.CANCELLED:
            assert tokens == expected[: len(tokens)], (arch, rid)
        else:
            assert finals[0].finish_reason is FinishReason.LENGTH, (arch, rid, finals[0])
            assert tokens == expected, (arch, rid)
    assert all_back(pool)
