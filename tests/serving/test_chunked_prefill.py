"""Chunked prefill in the batching engine (serving/batching/chunked_prefill.py, the token budget of
serving/batching/scheduler.py): long prompts are prefilled a chunk at a time between decode steps, on a tiny random
Llama (CPU, float32, GQA).

Oracle: each request alone through model.generate (greedy, one forward over the whole prompt, its own
RocketKVCache without a pool), on a second copy of the model; never the engine or its chunks.
"""

from __future__ import annotations

import math
import threading

import pytest

from hf_rocketkv.cache import PackedStepCache
from hf_rocketkv.serving import FinishReason
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.serving.helpers import (
    assert_each_alone,
    make_pool,
    prompt_of,
    request,
    submit_arriving,
    wait_until,
)

CHUNK = 16  # prompt tokens per prefill forward in these tests (CFG's prompt_budget is 24, its window 8)


class ForwardLog:
    """A forward pre-hook on the served model: the kind of every forward in order, ``("prefill", tokens)`` for a
    batch-1 prompt chunk, ``("decode", rows)`` for a decode step (one token per row); ``on_forward(kind, n)`` runs
    inside the hook, on the engine thread, before the forward."""

    def __init__(self, model, on_forward=None):
        self.entries: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.on_forward = on_forward
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs["input_ids"]  # the engine's prefill forwards ask for the last logits only
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if isinstance(cache, PackedStepCache):  # packed_steps: a chunk in a decode step's forward counts as its chunk
            entry = ("prefill", ids.shape[1] - cache.rows)
        else:
            entry = ("prefill", ids.shape[1]) if "logits_to_keep" in kwargs else ("decode", ids.shape[0])
        with self.lock:
            self.entries.append(entry)
        if self.on_forward is not None:
            self.on_forward(*entry)

    def kinds(self) -> list[tuple[str, int]]:
        with self.lock:
            return list(self.entries)

    def remove(self) -> None:
        self._handle.remove()


@pytest.fixture
def chunked(engines):
    """``make(**batching) -> (engine, events, pool)``: a started engine prefilling in chunks of ``CHUNK`` tokens."""

    def make(**batching):
        return engines(**{"prefill_chunk_tokens": CHUNK, "prefill_token_budget": CHUNK, **batching})

    return make


# ------------------------------------------------------------------------------------------------ tokens
@pytest.mark.parametrize("budget, per_step", [(CHUNK, 1), (CHUNK // 4, 1), (3 * CHUNK, 2)])
def test_chunked_prompts_equal_each_alone(chunked, oracle, budget, per_step):
    """Prompts many chunks long, shorter than a chunk and just over one (a last chunk shorter than the stage-1
    window), at once and arriving while others decode, under one chunk per step, a chunk every fourth step and
    several chunks of two requests per step: each request's tokens are its tokens alone."""
    engine, events, pool = chunked(prefill_token_budget=budget, prefills_per_step=per_step)
    free = pool.free_pages()
    lengths = [(100, 9), (5, 6), (17, 12), (33, 4), (61, 7), (12, 10), (16, 5), (47, 8)]
    sent = submit_arriving(engine, lengths, seed=300, prefix="c")
    assert_each_alone(events, sent, oracle)
    stats = engine.stats()
    assert stats.prefills == len(sent)
    assert stats.prefill_chunks == sum(math.ceil(length / CHUNK) for length, _ in lengths)
    assert pool.free_pages() == free


def test_a_running_request_keeps_decoding_while_a_long_prompt_is_prefilled(chunked, oracle, tiny_pair):
    engine, events, pool = chunked()
    log = ForwardLog(tiny_pair[0])
    try:
        runner, long_prompt = prompt_of(20, seed=1), prompt_of(200, seed=2)
        engine.submit(request("runner", runner, 60))
        assert wait_until(lambda: len(events.tokens("runner")) >= 2, timeout=30)
        before = len(log.kinds())
        engine.submit(request("long", long_prompt, 5))
        events.wait_finals(2)
    finally:
        log.remove()
    entries = log.kinds()[before:]
    chunks = [i for i, (kind, _) in enumerate(entries) if kind == "prefill"]
    assert [entries[i][1] for i in chunks] == [CHUNK] * 12 + [200 - 12 * CHUNK]  # 13 forwards of at most a chunk
    decodes_between = [kind for kind, _ in entries[chunks[0]:chunks[-1]] if kind == "decode"]
    assert len(decodes_between) >= len(chunks) - 1  # one decode step of the runner between two chunks
    assert events.tokens("runner") == oracle(runner, 60)
    assert events.tokens("long") == oracle(long_prompt, 5)
    assert pool.free_pages() == pool.total_pages()


def test_a_smaller_budget_spreads_the_chunks_over_more_decode_steps(chunked, tiny_pair):
    """prefill_token_budget = a quarter of the chunk: a chunk every fourth decode step while a request decodes."""
    engine, events, _ = chunked(prefill_token_budget=CHUNK // 4)
    log = ForwardLog(tiny_pair[0])
    try:
        engine.submit(request("runner", prompt_of(20, seed=3), 80))
        assert wait_until(lambda: len(events.tokens("runner")) >= 2, timeout=30)
        before = len(log.kinds())
        engine.submit(request("long", prompt_of(5 * CHUNK, seed=4), 2))
        events.wait_finals(2)
    finally:
        log.remove()
    entries = log.kinds()[before:]
    chunks = [i for i, (kind, _) in enumerate(entries) if kind == "prefill"]
    assert len(chunks) == 5
    gaps = [sum(kind == "decode" for kind, _ in entries[a:b]) for a, b in zip(chunks, chunks[1:])]
    assert gaps == [4] * 4, gaps


# ------------------------------------------------------------------------------------------------ lifecycle
@pytest.mark.parametrize("packed", [False, True], ids=["alternating", "packed_steps"])
def test_cancel_mid_prefill_returns_every_page(chunked, oracle, tiny_pair, packed):
    """A long prompt cancelled at its third chunk (in its own forward, or riding on a decode step's): its prefill is
    left, its pages back; the running request and a later one get their tokens alone."""
    engine, events, pool = chunked(packed_steps=packed)
    held = []

    def cancel_at_third_chunk(kind, tokens):
        if kind == "prefill" and tokens == CHUNK:
            held.append(pool.free_pages())
            if len(held) == 3:
                engine.cancel("long")

    runner = prompt_of(22, seed=5)
    engine.submit(request("runner", runner, 40))
    assert wait_until(lambda: len(events.tokens("runner")) >= 1, timeout=30)
    log = ForwardLog(tiny_pair[0], cancel_at_third_chunk)
    try:
        engine.submit(request("long", prompt_of(160, seed=6), 5))
        assert wait_until(lambda: events.finals("long"), timeout=30)
    finally:
        log.remove()
    assert events.finals("long")[0].finish_reason is FinishReason.CANCELLED and not events.tokens("long")
    assert len([k for k, _ in log.kinds() if k == "prefill"]) < 160 // CHUNK  # it ended mid-prefill
    assert held[1] < pool.total_pages()  # its pages were taken at its first chunk
    events.wait_finals(2)
    assert events.tokens("runner") == oracle(runner, 40)
    assert pool.free_pages() == pool.total_pages()
    after = prompt_of(70, seed=7)  # the engine serves on
    engine.submit(request("after", after, 4))
    events.wait_finals(3)
    assert events.tokens("after") == oracle(after, 4)
    assert pool.free_pages() == pool.total_pages()


def test_a_chunk_that_fails_ends_its_request_only(chunked, oracle, tiny_pair):
    """A forward failing at the second chunk of a long prompt ends that request with an error (its prefill left, its
    pages back); the running request and a later one get their tokens alone."""
    engine, events, pool = chunked()
    chunks = []

    def fail_at_second_chunk(kind, tokens):
        if kind == "prefill" and tokens == CHUNK:
            chunks.append(tokens)
            if len(chunks) == 2:
                raise RuntimeError("injected chunk failure")

    runner, after = prompt_of(21, seed=15), prompt_of(40, seed=16)
    engine.submit(request("runner", runner, 30))
    assert wait_until(lambda: len(events.tokens("runner")) >= 1, timeout=30)
    log = ForwardLog(tiny_pair[0], fail_at_second_chunk)
    try:
        engine.submit(request("long", prompt_of(100, seed=17), 5))
        assert wait_until(lambda: events.finals("long"), timeout=30)
    finally:
        log.remove()
    final = events.finals("long")[0]
    assert final.finish_reason is FinishReason.ERROR and "injected chunk failure" in final.error
    assert not events.tokens("long")
    engine.submit(request("after", after, 4))
    events.wait_finals(3)
    assert events.tokens("runner") == oracle(runner, 30)
    assert events.tokens("after") == oracle(after, 4)
    assert pool.free_pages() == pool.total_pages()


def test_stop_without_drain_cancels_requests_mid_prefill(chunked, tiny_pair):
    engine, events, pool = chunked()
    started = threading.Event()
    log = ForwardLog(tiny_pair[0], lambda kind, n: started.set() if kind == "prefill" else None)
    try:
        engine.submit(request("long", prompt_of(300, seed=8), 5))
        engine.submit(request("next", prompt_of(30, seed=9), 5))
        assert started.wait(30)
        engine.stop(drain=False, timeout=60)
    finally:
        log.remove()
    assert {e.request_id: e.finish_reason for e in events.finals()} == {"long": FinishReason.CANCELLED,
                                                                          "next": FinishReason.CANCELLED}
    assert pool.free_pages() == pool.total_pages()


def test_a_request_ending_at_its_first_token_after_chunks_frees_its_pages(chunked, oracle):
    engine, events, pool = chunked()
    prompt = prompt_of(50, seed=10)
    engine.submit(request("one", prompt, 1))
    events.wait_finals(1)
    assert events.tokens("one") == oracle(prompt, 1)
    assert events.finals("one")[0].finish_reason is FinishReason.LENGTH
    assert pool.free_pages() == pool.total_pages()


# ------------------------------------------------------------------------------------------------ prefix reuse
@pytest.mark.parametrize("concurrent", [None, CHUNK], ids=["serial_prefill", "prefill_beside_decode"])
def test_prefix_hit_with_chunked_prefill(chunked, oracle, tiny_pair, concurrent):
    """A later request that shares a first request's prefix reuses its pages; the rest of its prompt is
    prefilled in chunks (several after the hit, or one), with the tokens of the request alone; on the engine thread
    or on the prefill thread (``concurrent_prefill_tokens``)."""
    engine, events, pool = chunked(concurrent_prefill_tokens=concurrent)
    shared = prompt_of(48, seed=11)  # six pool pages of 8 tokens
    prompts = {"first": shared + prompt_of(40, seed=12), "many": shared + prompt_of(45, seed=13),
               "one": shared + prompt_of(9, seed=14)}
    engine.submit(request("first", prompts["first"], 6))
    events.wait_finals(1)
    hits = pool.stats().hit_pages
    for i, rid in enumerate(("many", "one")):
        engine.submit(request(rid, prompts[rid], 6))
        events.wait_finals(2 + i)
        assert pool.stats().hit_pages >= hits + 6, rid
        hits = pool.stats().hit_pages
    for rid, prompt in prompts.items():
        assert events.tokens(rid) == oracle(prompt, 6), rid
    assert pool.free_pages() == pool.total_pages()


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("name", ["prefill_chunk_tokens", "prefill_token_budget"])
@pytest.mark.parametrize("value", [0, -16, 1.5, True, "2048", None])
def test_budget_fields_are_validated_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"BatchingConfig.{name} must be an integer >= 1"):
        BatchingConfig(**{name: value})


def test_pool_accounting_is_exact_over_chunked_requests(chunked, tiny_pair, oracle):
    """A pool that holds one long prompt's prefill peak but not two: the next request is admitted only once the
    first one's prompt pages are back (after its stage 1), every request finishes with its tokens alone, and every
    page comes back."""
    from hf_rocketkv.cache import request_pages
    from tests.serving.helpers import CFG

    probe = make_pool(tiny_pair[0])
    plan = request_pages(CFG, probe, 120, 4)
    pages = plan.peak_pages + plan.steady_pages + 1  # one peak beside one compressed request (+ the scratch page)
    assert pages < 2 * plan.peak_pages
    pool = make_pool(tiny_pair[0], mib=pages * probe.bytes_per_page / 2**20)
    engine, events, _ = chunked(pool=pool)
    prompts = [prompt_of(120, seed=20 + i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.submit(request(f"p{i}", prompt, 4))
    events.wait_finals(3)
    for i, prompt in enumerate(prompts):
        assert events.tokens(f"p{i}") == oracle(prompt, 4)
    assert [e.finish_reason for e in events.finals()] == [FinishReason.LENGTH] * 3
    assert pool.free_pages() == pool.total_pages()


def test_prefill_chunks_run_with_the_fused_rope_and_norm_switched_on(chunked, tiny_pair):
    """Every prefill forward of the engine, as its decode steps, runs inside the config's fused RoPE / RMSNorm switch
    (on a GPU in bf16 they take one launch each; the fp32 model here keeps transformers' formulas)."""
    from hf_rocketkv.integration import norm, rope

    engine, events, pool = chunked()
    seen = []

    def record(kind, tokens):
        seen.append((kind, norm.fused_norm_active(), rope.fused_rope_active()))

    log = ForwardLog(tiny_pair[0], record)
    try:
        engine.submit(request("long", prompt_of(3 * CHUNK + 5, seed=21), 3))
        events.wait_finals(1)
    finally:
        log.remove()
    prefills = [entry for entry in seen if entry[0] == "prefill"]
    assert prefills == [("prefill", True, True)] * 4  # three full chunks and the rest
    assert all(entry == ("decode", True, True) for entry in seen if entry[0] == "decode")
    assert not norm.fused_norm_active() and not rope.fused_rope_active()  # the test's own thread: off
