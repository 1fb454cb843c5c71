"""BatchingEngine (serving/batching/engine.py): continuous batching over the KV block pool, on a tiny random Llama (CPU,
float32, GQA); what it cannot serve is refused when it is built.

Oracle: each request alone, through model.generate with its own RocketKVCache of the same config (a second copy of
the model, so the oracle never shares a module with the engine thread), or through SequentialEngine for sampling.
"""

from __future__ import annotations

import random

import pytest

from hf_rocketkv.serving import EngineStopped, FinishReason, SamplingParams, SequentialEngine
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.engines.interface import EngineRequest
from tests.serving.helpers import (CFG, PROMPTS, Events, ForwardGate, PackedLog, make_pool, prompt_of, request,
                                   wait_until)
from tests.support.tiny_models import compressing_config


# ------------------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("page_size", [4, 16])  # 16: prompts and views end inside pages (partial pages)
def test_greedy_requests_submitted_at_once_equal_each_alone(engines, oracle, tiny_pair, page_size):
    engine, events, pool = engines(pool=make_pool(tiny_pair[0], page_size=page_size))
    free = pool.free_pages()
    prompts = [prompt_of(n, seed=n) for n, _ in PROMPTS]
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        engine.submit(request(f"r{i}", prompt, n))
    events.wait_finals(len(PROMPTS))
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"r{i}") == oracle(prompt, n), f"request {i}"
        assert [e.finish_reason for e in events.finals(f"r{i}")] == [FinishReason.LENGTH]
    assert engine.steps < sum(n for _, n in PROMPTS)  # rows really decoded together
    assert pool.free_pages() == free


def test_greedy_requests_joining_mid_run_equal_each_alone(engines, oracle):
    engine, events, pool = engines(prefills_per_step=2)
    free = pool.free_pages()
    gate = ForwardGate(engine.model, delay=0.002)  # slow steps so that later submissions land mid-run
    try:
        prompts = [prompt_of(n, seed=100 + n) for n, _ in PROMPTS]
        for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
            engine.submit(request(f"s{i}", prompt, n + 4))
            wait_until(lambda: engine.steps >= 2 * (i + 1), timeout=10)  # join at a later step boundary
        events.wait_finals(len(PROMPTS))
    finally:
        gate.remove()
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"s{i}") == oracle(prompt, n + 4), f"request {i}"
    assert pool.free_pages() == free


def test_stop_token_ends_a_row_and_the_others_go_on(engines, oracle):
    engine, events, _ = engines()
    prompts = [prompt_of(30, seed=1), prompt_of(28, seed=2)]
    alone = oracle(prompts[0], 10)
    stop = alone[3]
    first = EngineRequest("a", tuple(prompts[0]), SamplingParams.greedy(10, stop_token_ids=[stop]),
                          frozenset([stop]))
    engine.submit(first)
    engine.submit(request("b", prompts[1], 10))
    events.wait_finals(2)
    assert events.tokens("a") == alone[: alone.index(stop) + 1]
    assert events.finals("a")[0].finish_reason is FinishReason.STOP
    assert events.tokens("b") == oracle(prompts[1], 10)


# ------------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("concurrent", [None, 16], ids=["serial_prefill", "prefill_beside_decode"])
def test_seeded_sampling_equals_the_request_alone(engines, tiny_pair, concurrent):
    """Each row samples with its own generator: the same tokens as SequentialEngine, whatever runs beside it (and
    whichever thread prefilled it: ``concurrent_prefill_tokens``)."""
    prompts = [prompt_of(30, seed=7), prompt_of(19, seed=8), prompt_of(41, seed=9)]
    params = [dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=1.3, top_k=20, seed=12),
              dict(temperature=0.7, seed=13)]
    engine, events, _ = engines(concurrent_prefill_tokens=concurrent)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.submit(request(f"x{i}", prompt, 8, **p))
    engine.submit(request("greedy", prompt_of(25, seed=10), 8))
    events.wait_finals(4)
    sequential = SequentialEngine(tiny_pair[1], CFG)
    alone = Events()
    sequential.start(alone)
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            sequential.submit(request(f"x{i}", prompt, 8, **p))
        alone.wait_finals(3)
    finally:
        sequential.stop()
    for i in range(3):
        assert events.tokens(f"x{i}") == alone.tokens(f"x{i}"), f"request {i}"


# ------------------------------------------------------------------------------------------------ random sequences
PREFILL_MODES = {
    "serial_prefill": {},
    "prefill_beside_decode": {"concurrent_prefill_tokens": 8},
    # prompt chunks of 16 tokens packed into the decoding rows' forwards: cancels land mid-prompt, between chunks
    "packed_steps": {"packed_steps": True, "prefill_chunk_tokens": 16, "prefill_token_budget": 16},
}


@pytest.mark.parametrize("mode", sorted(PREFILL_MODES))
@pytest.mark.parametrize("seed", [0, 1])
def test_random_request_sequences(engines, oracle, seed, mode):
    """Arrivals, cancels, max_tokens, prompt lengths, shared prefixes: one final event each, the pool's free pages
    back to the start, and every row's tokens those of the request alone (a cancelled one: a prefix of them); with
    the prefill on the engine thread, beside the decode steps (``concurrent_prefill_tokens``: cancels then land
    while the prefill thread holds a request, prefix hits are looked up there), or packed with the decode steps in one
    forward (``packed_steps``: a prompt spans several steps, so arrivals and cancels land between its chunks)."""
    rng = random.Random(seed)
    engine, events, pool = engines(prefills_per_step=rng.choice([1, 2]), max_running=6, buckets=(1, 2, 4, 8),
                                   **PREFILL_MODES[mode])
    forwards = PackedLog(engine.model)
    free = pool.free_pages()
    shared = prompt_of(24, seed=1000 + seed)  # three pool pages: later requests may hit them
    sent = []
    for i in range(10):
        length = rng.randint(3, 40)
        prompt = shared + prompt_of(length, seed=rng.randint(0, 10**6)) if rng.random() < 0.4 else \
            prompt_of(length, seed=rng.randint(0, 10**6))
        n = rng.randint(1, 12)
        rid = f"q{i}"
        engine.submit(request(rid, prompt, n))
        sent.append((rid, prompt, n))
        if rng.random() < 0.3:
            victim = rng.choice(sent)[0]
            wait_until(lambda: len(events.tokens(victim)) >= rng.randint(0, 3), timeout=2)
            engine.cancel(victim)
        wait_until(lambda: engine.steps >= rng.randint(0, 2 * i), timeout=2)
    events.wait_finals(len(sent))
    for rid, prompt, n in sent:
        finals = events.finals(rid)
        assert len(finals) == 1, rid
        tokens = events.tokens(rid)
        alone = oracle(prompt, n)
        if finals[0].finish_reason is FinishReason.CANCELLED:
            assert tokens == alone[: len(tokens)], rid
        else:
            assert finals[0].finish_reason is FinishReason.LENGTH, (rid, finals[0])
            assert tokens == alone, rid
        assert events.events.index(finals[0]) > max(
            [k for k, e in enumerate(events.events) if e.request_id == rid and e.token_ids], default=-1)
    forwards.remove()
    assert pool.free_pages() == free
    assert pool.stats().hit_pages > 0 or seed != 0  # seed 0 sends shared prefixes
    packed = sum(kind == "packed" for kind, _, _ in forwards.kinds())
    assert (packed > 0) == (mode == "packed_steps"), forwards.kinds()


# ------------------------------------------------------------------------------------------------ lifecycle
def test_cancel_while_decoding_frees_pages_within_one_step(engines):
    engine, events, pool = engines()
    free = pool.free_pages()
    gate = ForwardGate(engine.model, delay=0.01)
    try:
        engine.submit(request("long", prompt_of(30, seed=4), 200))
        engine.submit(request("other", prompt_of(22, seed=5), 30))
        assert wait_until(lambda: len(events.tokens("long")) >= 3)
        assert pool.free_pages() < free
        steps = engine.steps
        engine.cancel("long")
        events.wait_finals(1)
        assert events.finals("long")[0].finish_reason is FinishReason.CANCELLED
        # the step in flight when the flag is set, and (overlapped decode, the default) the one launched on its
        # tokens before they were read: a row leaves only once no running step holds it
        assert engine.steps <= steps + 2
        events.wait_finals(2)
    finally:
        gate.remove()
    assert events.finals("other")[0].finish_reason is FinishReason.LENGTH
    assert len(events.tokens("long")) < 200
    assert pool.free_pages() == free


def test_stop_drain_finishes_and_no_drain_cancels(engines):
    engine, events, pool = engines()
    for i in range(3):
        engine.submit(request(f"d{i}", prompt_of(20 + i, seed=i), 5))
    engine.stop(drain=True, timeout=60)
    assert [e.finish_reason for e in events.finals()] == [FinishReason.LENGTH] * 3
    assert pool.free_pages() == pool.total_pages()  # the scratch page too, once stopped
    with pytest.raises(EngineStopped):
        engine.submit(request("late", prompt_of(5, seed=1), 2))

    engine, events, pool = engines()
    gate = ForwardGate(engine.model, delay=0.01)
    try:
        for i in range(12):
            engine.submit(request(f"c{i}", prompt_of(20 + i, seed=i), 50))
        wait_until(lambda: engine.steps >= 2)
        engine.stop(drain=False, timeout=60)
    finally:
        gate.remove()
    finals = events.finals()
    assert sorted(e.request_id for e in finals) == sorted(f"c{i}" for i in range(12))
    assert {e.finish_reason for e in finals} == {FinishReason.CANCELLED}
    assert pool.free_pages() == pool.total_pages()


def test_engine_refuses_what_it_cannot_serve(tiny_pair):
    with pytest.raises(TypeError, match="KVBlockPool"):
        BatchingEngine(tiny_pair[0], CFG, None)
    pool = make_pool(tiny_pair[0])
    with pytest.raises(NotImplementedError, match="multi_turn"):
        BatchingEngine(tiny_pair[0], CFG.replace(multi_turn="keep_all"), pool)


# ------------------------------------------------------------------------------------------------ wiring
def test_manager_and_generate_batch_choose_the_engine(tiny_pair, oracle):
    from hf_rocketkv.serving import GenerationManager, generate_batch

    pool = make_pool(tiny_pair[0])
    prompts = [prompt_of(30, seed=61), prompt_of(12, seed=62), prompt_of(27, seed=63)]
    results = generate_batch(tiny_pair[0], prompts, config=CFG, pool=pool,
                             sampling=SamplingParams.greedy(5, ignore_eos=True))
    assert [list(r.token_ids) for r in results] == [oracle(p, 5) for p in prompts]
    assert pool.free_pages() == pool.total_pages()
    choices = {"auto": BatchingEngine, "batching": BatchingEngine, "sequential": SequentialEngine}
    for name, kind in choices.items():
        manager = GenerationManager(tiny_pair[0], None, CFG, engine=name, pool=pool)
        try:
            assert isinstance(manager.engine, kind)
        finally:
            manager.stop()
    manager = GenerationManager(tiny_pair[0], None, CFG)  # auto without a pool: sequential
    manager.stop()
    assert isinstance(manager.engine, SequentialEngine)
    with pytest.raises(ValueError, match="engine='batching' needs pool="):
        GenerationManager(tiny_pair[0], None, CFG, engine="batching")
    with pytest.raises(ValueError, match="engine must be an Engine or one of"):
        GenerationManager(tiny_pair[0], None, CFG, engine="fast", pool=pool)


def test_a_waiting_request_whose_flag_is_set_ends_without_running(engines):
    """The manager sets the flag (stop strings, its own stop) without calling cancel(): a waiting request ends at
    the next step boundary, not when it reaches the head of the queue."""
    engine, events, pool = engines(max_running=1, buckets=(1,))
    gate = ForwardGate(engine.model, delay=0.01)
    try:
        engine.submit(request("first", prompt_of(25, seed=1), 30))
        waiting = request("waiting", prompt_of(25, seed=2), 30)
        engine.submit(waiting)
        assert wait_until(lambda: len(events.tokens("first")) >= 2)
        waiting.cancelled.set()
        assert wait_until(lambda: events.finals("waiting"), timeout=10)
        assert not events.finals("first")  # it was still running: the waiting one did not wait for the head
    finally:
        gate.remove()
    events.wait_finals(2)
    assert events.finals("waiting")[0].finish_reason is FinishReason.CANCELLED and not events.tokens("waiting")
    assert pool.free_pages() == pool.total_pages()


def test_an_unexpected_failure_still_ends_every_request_once(engines, oracle):
    """A bug outside the per-request guards (here: the scheduler raising when a prefilled request joins) ends the
    requests of that step with an error, releases their pages, and the engine serves the next ones."""
    engine, events, pool = engines(prefills_per_step=2)
    real = engine._scheduler.prefilled
    calls = []

    def broken(running):
        calls.append(running.request_id)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(running)

    engine._scheduler.prefilled = broken
    second = prompt_of(31, seed=2)
    engine.submit(request("a", prompt_of(30, seed=1), 5))
    engine.submit(request("b", second, 5))
    events.wait_finals(2)
    assert len(events.finals("a")) == len(events.finals("b")) == 1
    assert events.finals("a")[0].finish_reason is FinishReason.ERROR
    if events.finals("b")[0].finish_reason is not FinishReason.ERROR:  # b was admitted in a later step
        assert events.tokens("b") == oracle(second, 5)
    assert pool.free_pages() == pool.total_pages()
    prompt = prompt_of(22, seed=3)
    engine.submit(request("c", prompt, 5))
    events.wait_finals(3)
    assert events.tokens("c") == oracle(prompt, 5)


@pytest.mark.parametrize("fields, name", [(dict(decode_budget=16, decode_interval=8, decode_window=4), "decode_budget"),
                                          (dict(token_budget=64), "token_budget")])
def test_batching_engine_refuses_unsupported_budget_fields_at_construction(tiny_pair, fields, name):
    config = compressing_config(**fields)
    with pytest.raises(NotImplementedError) as err:
        BatchingEngine(tiny_pair[0], config, make_pool(tiny_pair[0], config=config))
    assert name in str(err.value)


@pytest.mark.parametrize("fields, name", [({}, None), (dict(multi_turn="keep_all"), "multi_turn"),
                                          (dict(decode_budget=16, decode_interval=8, decode_window=4), "decode_budget"),
                                          (dict(token_budget=64), "token_budget"), (dict(stage1="adakv"), "stage1"),
                                          (dict(budget_schedule="pyramid"), "budget_schedule"),
                                          (dict(dense_layers=1), "dense_layers")])
def test_batching_refusal_names_what_the_engine_refuses(tiny_pair, fields, name):
    """``batching_refusal`` (what ``hf-rocketkv serve`` decides on before the model loads) answers exactly for the
    configs the engine refuses when built, naming the same field."""
    from hf_rocketkv.serving.builder import batching_refusal

    config = compressing_config(**fields)
    reason = batching_refusal(config)
    pool = make_pool(tiny_pair[0], config=config)
    if name is None:
        assert reason is None
        BatchingEngine(tiny_pair[0], config, pool)  # built (never started: no thread to stop)
        return
    assert reason.startswith(f"{name}=") and "(" in reason and len(reason) < 140
    with pytest.raises((NotImplementedError, ValueError), match=name):
        BatchingEngine(tiny_pair[0], config, pool)
