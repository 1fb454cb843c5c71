"""Prefills beside the decode steps (``BatchingConfig.concurrent_prefill_tokens``, serving/batching/prefill_worker.py):
a second host thread prefills admitted requests chunk by chunk while the engine thread decodes, on a tiny random Llama
(CPU, float32, GQA; on CUDA each thread also has its own stream, tests/gpu/test_batching_engine_gpu.py).

Oracle: each request alone through model.generate (greedy, one forward over the whole prompt, its own RocketKVCache
without a pool), on a second copy of the model; never the engine or its chunks.
"""

from __future__ import annotations

import threading

import pytest

from hf_rocketkv.serving import FinishReason
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.serving.helpers import CFG, assert_each_alone, make_pool, prompt_of, request, submit_arriving, wait_until
from tests.serving.test_chunked_prefill import ForwardLog
from tests.serving.test_lockstep import one_rank_group  # noqa: F401 - a fixture

CHUNK = 16  # prompt tokens per prefill forward while rows decode (CFG's prompt_budget is 24, its window 8)


@pytest.fixture
def beside(engines):
    """``make(**batching) -> (engine, events, pool)``: a started engine prefilling beside its decode steps."""

    def make(**batching):
        return engines(**{"concurrent_prefill_tokens": CHUNK, "prefill_chunk_tokens": 4 * CHUNK, **batching})

    return make


def test_prompts_prefilled_beside_the_decode_steps_equal_each_alone(beside, oracle):
    """Prompts many chunks long, shorter than a chunk and just over one, at once and arriving while others decode:
    each request's tokens are its tokens alone, every page comes back."""
    engine, events, pool = beside()
    free = pool.free_pages()
    lengths = [(100, 9), (5, 6), (17, 12), (33, 4), (61, 7), (12, 10), (16, 5), (47, 8), (130, 3)]
    sent = submit_arriving(engine, lengths, seed=700, prefix="b")
    assert_each_alone(events, sent, oracle)
    assert engine.stats().prefills == len(sent)
    assert pool.free_pages() == free


def test_a_running_request_decodes_while_a_chunk_is_being_prefilled(beside, oracle, tiny_pair):
    """The prefill forwards are held inside one chunk until the running request has decoded three more steps: the
    decode steps do not wait for the chunk (on the engine thread they would: it is the one running the chunk)."""
    served = tiny_pair[0]
    release, engine_steps = threading.Event(), []

    def on_forward(kind, n):
        if kind == "prefill" and threading.current_thread().name == "hf-rocketkv-prefill" and not release.is_set():
            start = engine.steps
            ok = wait_until(lambda: engine.steps >= start + 3, timeout=30)
            engine_steps.append((start, engine.steps, ok))
            release.set()

    engine, events, pool = beside()
    runner, long_prompt = prompt_of(20, seed=1), prompt_of(120, seed=2)
    engine.submit(request("runner", runner, 80))
    assert wait_until(lambda: len(events.tokens("runner")) >= 2, timeout=30)
    log = ForwardLog(served, on_forward=on_forward)
    try:
        engine.submit(request("long", long_prompt, 5))
        events.wait_finals(2)
    finally:
        log.remove()
    assert engine_steps and engine_steps[0][2], f"the decode steps stopped while a chunk ran: {engine_steps}"
    prefill_sizes = [n for kind, n in log.kinds() if kind == "prefill"]
    assert prefill_sizes[:7] == [CHUNK] * 7 and sum(prefill_sizes) == 120  # chunks of CHUNK while the runner decodes
    assert events.tokens("runner") == oracle(runner, 80)
    assert events.tokens("long") == oracle(long_prompt, 5)
    assert pool.free_pages() == pool.total_pages()


def test_without_decoding_rows_the_worker_takes_the_larger_chunk(beside, oracle, tiny_pair):
    engine, events, _ = beside()
    log = ForwardLog(tiny_pair[0])
    try:
        prompt = prompt_of(100, seed=9)
        engine.submit(request("alone", prompt, 4))
        events.wait_finals(1)
    finally:
        log.remove()
    assert [n for kind, n in log.kinds() if kind == "prefill"] == [4 * CHUNK, 100 - 4 * CHUNK]
    assert events.tokens("alone") == oracle(prompt, 4)


def test_a_cancel_between_two_chunks_gives_every_page_back(beside, tiny_pair):
    cancelled = threading.Event()
    engine, events, pool = beside()

    def on_forward(kind, n):
        if kind == "prefill" and not cancelled.is_set():
            cancelled.set()
            engine.cancel("long")  # its flag is set while its first chunk runs; the worker stops before the next

    log = ForwardLog(tiny_pair[0], on_forward=on_forward)
    try:
        engine.submit(request("long", prompt_of(200, seed=4), 5))
        events.wait_finals(1)
    finally:
        log.remove()
    assert [e.finish_reason for e in events.finals("long")] == [FinishReason.CANCELLED]
    assert sum(1 for kind, _ in log.kinds() if kind == "prefill") < 4
    assert wait_until(lambda: pool.free_pages() == pool.total_pages(), timeout=30)


def test_a_failing_prefill_ends_that_request_only(beside, oracle, tiny_pair):
    def on_forward(kind, n):
        if kind == "prefill" and n == 33:
            raise RuntimeError("injected prefill failure")

    engine, events, pool = beside(prefill_chunk_tokens=64)
    log = ForwardLog(tiny_pair[0], on_forward=on_forward)
    try:
        good = prompt_of(20, seed=5)
        engine.submit(request("bad", prompt_of(33, seed=6), 4))
        engine.submit(request("good", good, 4))
        events.wait_finals(2)
    finally:
        log.remove()
    bad = events.finals("bad")
    assert [e.finish_reason for e in bad] == [FinishReason.ERROR] and "injected prefill failure" in bad[0].error
    assert events.tokens("good") == oracle(good, 4)
    assert wait_until(lambda: pool.free_pages() == pool.total_pages(), timeout=30)


def test_a_stop_without_drain_ends_the_prefill_and_the_thread(beside, tiny_pair):
    engine, events, pool = beside()
    engine.submit(request("runner", prompt_of(20, seed=1), 500))
    assert wait_until(lambda: len(events.tokens("runner")) >= 2, timeout=30)
    engine.submit(request("long", prompt_of(300, seed=3), 5))
    assert wait_until(lambda: engine.stats().prefill_chunks >= 0 and engine._worker.busy(), timeout=30)
    engine.stop(drain=False, timeout=60)
    assert {e.finish_reason for rid in ("runner", "long") for e in events.finals(rid)} <= {
        FinishReason.CANCELLED, FinishReason.LENGTH}
    assert not any(t.name == "hf-rocketkv-prefill" for t in threading.enumerate())
    assert pool.free_pages() == pool.total_pages()


@pytest.mark.parametrize("value", [0, -4, 1.5, True, "512"])
def test_bad_values_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="concurrent_prefill_tokens"):
        BatchingConfig(concurrent_prefill_tokens=value)


def test_lockstep_refuses_it(tiny_pair, one_rank_group):
    from hf_rocketkv.serving import Lockstep

    with pytest.raises(NotImplementedError, match="concurrent_prefill_tokens"):
        BatchingEngine(tiny_pair[0], CFG, make_pool(tiny_pair[0]), BatchingConfig(concurrent_prefill_tokens=16),
                       lockstep=Lockstep())
