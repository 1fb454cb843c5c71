"""The batching engine's decode step (serving/batching/decode_step.py): overlapped steps
(``BatchingConfig.overlap_decode``: step N+1 is launched before step N's tokens are read), padding rows, and steps
through one graph per bucket.
Oracle: the same engine with overlap off (every step read before the next one), exactly sized batches, and each
request alone through model.generate."""

from __future__ import annotations

import random

import pytest
import torch

from hf_rocketkv.serving import FinishReason, SamplingParams
from hf_rocketkv.serving.batching import decode_step as decode_step_module
from hf_rocketkv.serving.batching.decode_step import BatchDecoder
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from hf_rocketkv.serving.engines.interface import EngineRequest
from tests.serving.helpers import CFG, PROMPTS, Events, ForwardGate, make_pool, prompt_of, request, wait_until


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
    launch, read = BatchDecoder._launch, decode_step_module._TokensToHost.read

    def logged_launch(self, rows, in_flight):
        log.append("L")
        return launch(self, rows, in_flight)

    def logged_read(self):
        log.append("R")
        return read(self)

    monkeypatch.setattr(BatchDecoder, "_launch", logged_launch)
    monkeypatch.setattr(decode_step_module._TokensToHost, "read", logged_read)
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


# ------------------------------------------------------------------------------------------------ the step's inputs
def test_the_step_ids_copy_equals_the_plain_constructor():
    """``host_copy.device_tensor``, which the step's ids go through (pinned and non-blocking on CUDA, so the step never
    waits for the device): the same tensor as ``torch.tensor``."""
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        ids = decode_step_module.device_tensor([5, 0, 7], torch.long, torch.device(device))
        assert ids.dtype == torch.long and ids.device.type == device and ids.tolist() == [5, 0, 7]


# ------------------------------------------------------------------------------------------------ padding
def test_padded_bucket_rows_change_nothing(engines, oracle, tiny_pair):
    """3, 5, 6 and 7 rows decode padded to 4 / 8 rows vs exactly sized batches: the same tokens (and the oracle's)."""
    prompts = [prompt_of(20 + 3 * i, seed=50 + i) for i in range(7)]
    lengths = [6, 9, 4, 11, 7, 5, 8]
    runs = []
    for buckets in [(1, 2, 4, 8), tuple(range(1, 9))]:
        engine, events, _ = engines(buckets=buckets, prefills_per_step=3)
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            engine.submit(request(f"p{i}", prompt, n))
        events.wait_finals(len(prompts))
        runs.append([events.tokens(f"p{i}") for i in range(len(prompts))])
    assert runs[0] == runs[1]
    assert runs[0] == [oracle(p, n) for p, n in zip(prompts, lengths)]


# ------------------------------------------------------------------------------------------------ decode graphs
def test_graphed_decode_steps_equal_eager_ones(engines, oracle, tiny_pair):
    """One graph per bucket (a CPU stand-in for capture/replay): the first step of a bucket runs eagerly, the second
    captures, later ones replay on the static buffers; the tokens are those of each request alone."""
    from hf_rocketkv.integration.batch_graphs import BatchedDecodeGraphs
    from tests.support.decode_runners import StandInBackend

    backend = StandInBackend()
    graphs = BatchedDecodeGraphs(tiny_pair[0], backend=backend, devices=("cpu",))
    pool = make_pool(tiny_pair[0])
    engine = BatchingEngine(tiny_pair[0], CFG, pool, BatchingConfig(max_running=8, buckets=(1, 2, 4, 8),
                                                                     prefills_per_step=2), decode_graphs=graphs)
    events = Events()
    engine.start(events)
    try:
        prompts = [prompt_of(n, seed=200 + n) for n, _ in PROMPTS]
        for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
            engine.submit(request(f"g{i}", prompt, n + 6))
        events.wait_finals(len(PROMPTS))
    finally:
        engine.stop(timeout=60)
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"g{i}") == oracle(prompt, n + 6), f"request {i}"
    assert 1 <= backend.captures <= 4 and backend.replays > backend.captures
    assert sum(step.replays for step in graphs.graphs.values()) == backend.replays
    assert pool.free_pages() == pool.total_pages()


def test_a_failing_capture_falls_back_to_eager_steps(engines, oracle, tiny_pair):
    from hf_rocketkv.integration.batch_graphs import BatchedDecodeGraphs
    from tests.support.decode_runners import StandInBackend

    class Failing(StandInBackend):
        def capture(self, run):
            raise RuntimeError("operation not permitted when stream is capturing")

    graphs = BatchedDecodeGraphs(tiny_pair[0], backend=Failing(), devices=("cpu",))
    engine = BatchingEngine(tiny_pair[0], CFG, make_pool(tiny_pair[0]),
                            BatchingConfig(max_running=4, buckets=(1, 2, 4)), decode_graphs=graphs)
    events = Events()
    engine.start(events)
    try:
        prompt = prompt_of(30, seed=5)
        engine.submit(request("f", prompt, 8))
        events.wait_finals(1)
    finally:
        engine.stop(timeout=60)
    assert events.tokens("f") == oracle(prompt, 8)
    assert engine.graphs is None  # eager from the failed capture on
