"""BatchingEngine with overlapped decode steps (``BatchingConfig.overlap_decode``): step N+1 is launched before step
N's tokens are read. Oracle: the same engine with overlap off (every step read before the next one), and each
request alone through model.generate."""

from __future__ import annotations

import random

import pytest

from hf_rocketkv.serving import FinishReason, SamplingParams
from hf_rocketkv.serving import batching as batching_module
from hf_rocketkv.serving.batching import BatchingEngine
from hf_rocketkv.serving.engine import EngineRequest
from hf_rocketkv.serving.scheduler import BatchingConfig
from tests.serving.helpers import ForwardGate, wait_until
from tests.serving.test_batching import CFG, Events, make_pool, oracle, prompt_of, request  # noqa: F401 (fixture)


@pytest.fixture
def run_engine(tiny_pair):
    """``run(requests, overlap, cancel=None) -> (events, engine, pool free before, pool)``: a fresh engine and pool
    serve ``requests`` (submitted at once) to the end; ``cancel(engine, events)`` runs while they decode."""
    made = []

    def run(requests, overlap, cancel=None, **batching):
        pool = make_pool(tiny_pair[0])
        config = BatchingConfig(**{"max_running": 8, "buckets": (1, 2, 4, 8), "overlap_decode": overlap, **batching})
        engine = BatchingEngine(tiny_pair[0], CFG, pool, config)
        events = Events()
        free = pool.free_pages()
        engine.start(events)
        made.append(engine)
        for req in requests:
            engine.submit(req)
        if cancel is not None:
            cancel(engine, events)
        events.wait_finals(len(requests))
        engine.stop(timeout=60)
        return events, engine, free, pool

    yield run
    for engine in made:
        engine.stop(drain=False, timeout=60)


def _mixed_requests(oracle, seed: int) -> list[EngineRequest]:
    """Greedy rows of several lengths, two with a stop id their own greedy run meets mid-way, two seeded draws."""
    rng = random.Random(seed)
    requests = []
    for i in range(7):
        prompt = prompt_of(rng.randint(5, 45), seed=rng.randint(0, 10**6))
        n = rng.randint(2, 12)
        if i < 2:
            stop = oracle(prompt, n)[min(2 + i, n - 1)]
            params = SamplingParams.greedy(n, stop_token_ids=[stop])
            requests.append(EngineRequest(f"s{i}", tuple(prompt), params, frozenset([stop])))
        elif i < 4:
            requests.append(request(f"d{i}", prompt, n, temperature=0.8, top_k=30, seed=rng.randint(0, 1000)))
        else:
            requests.append(request(f"g{i}", prompt, n))
    return requests


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_steps_give_the_tokens_of_synchronous_steps(run_engine, oracle, seed):
    requests = _mixed_requests(oracle, seed)
    runs = [run_engine(requests, overlap) for overlap in (False, True)]
    for req in requests:
        rid = req.request_id
        sync_events, overlap_events = runs[0][0], runs[1][0]
        assert overlap_events.tokens(rid) == sync_events.tokens(rid), rid
        assert [e.finish_reason for e in overlap_events.finals(rid)] == [e.finish_reason for e in
                                                                         sync_events.finals(rid)], rid
        if rid[0] == "g":
            assert overlap_events.tokens(rid) == oracle(list(req.prompt_ids), req.params.max_tokens), rid
    for events, engine, free, pool in runs:
        assert pool.free_pages() == free  # every page back, also for the rows that ended with a step in flight
    assert runs[1][1].steps >= runs[0][1].steps  # a row ending on a stop id costs at most one step more


def test_overlap_launches_the_next_step_before_reading_the_previous_one(run_engine, oracle, monkeypatch):
    """The order of launches (L) and reads (R): alternating without overlap; with it, a launch comes before the read
    of the step before it, and no step is read twice or left unread."""
    log = []
    launch, read = BatchingEngine._launch, batching_module._TokensToHost.read

    def logged_launch(self, rows, in_flight):
        log.append("L")
        return launch(self, rows, in_flight)

    def logged_read(self):
        log.append("R")
        return read(self)

    monkeypatch.setattr(BatchingEngine, "_launch", logged_launch)
    monkeypatch.setattr(batching_module._TokensToHost, "read", logged_read)
    requests = [request(f"r{i}", prompt_of(20 + i, seed=i), 10) for i in range(3)]
    orders = {}
    for overlap in (False, True):
        log.clear()
        events, engine, _, _ = run_engine(requests, overlap, prefills_per_step=3)
        orders[overlap] = "".join(log)
        for req in requests:
            assert events.tokens(req.request_id) == oracle(list(req.prompt_ids), 10)
        assert engine.steps == orders[overlap].count("L") == orders[overlap].count("R")
    assert "LL" not in orders[False]
    assert "LLR" in orders[True]
    assert orders[True].count("L") == orders[False].count("L")  # no stop id: the same steps, only overlapped


def test_a_cancel_with_a_step_in_flight_ends_the_row_and_frees_its_pages(run_engine, oracle, tiny_pair):
    gate = ForwardGate(tiny_pair[0], delay=0.005)
    try:
        def cancel(engine, events):
            assert wait_until(lambda: len(events.tokens("long")) >= 3)
            engine.cancel("long")

        requests = [request("long", prompt_of(30, seed=4), 100), request("other", prompt_of(22, seed=5), 20)]
        events, engine, free, pool = run_engine(requests, True, cancel=cancel)
    finally:
        gate.remove()
    assert events.finals("long")[0].finish_reason is FinishReason.CANCELLED
    long_tokens = events.tokens("long")
    assert 3 <= len(long_tokens) < 100 and long_tokens == oracle(prompt_of(30, seed=4), 100)[: len(long_tokens)]
    assert events.tokens("other") == oracle(prompt_of(22, seed=5), 20)
    assert pool.free_pages() == free


def test_overlap_decode_must_be_a_bool():
    with pytest.raises(ValueError, match="overlap_decode"):
        BatchingConfig(overlap_decode="yes")
