"""Packed engine steps (``BatchingConfig(packed_steps=True)``): the decoding rows' next tokens and a prompt chunk in
one forward (cache/packed_step.py, integration/packed_attention.py, ``BatchDecoder.beside``), on tiny random models
(CPU, float32): Llama with GQA, and every hybrid kind (Gemma 2 soft-capping, Gemma 3, Cohere 2, gpt-oss sinks,
Mistral: sliding windows beside global layers or everywhere); Llama 4 keeps alternating.

Oracle: each request alone through model.generate (greedy, one forward over the whole prompt, its own RocketKVCache
without a pool) on a second copy of the model; never the engine, its chunks or a packed forward.
"""

from __future__ import annotations


import pytest
import torch

from hf_rocketkv.cache import PackedStepCache
from hf_rocketkv.serving import FinishReason
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.integration.test_chunked_models import GENERATE_BROKEN
from tests.serving.helpers import (
    CFG,
    Events,
    PackedLog,
    assert_each_alone,
    make_pool,
    oracle_tokens,
    prompt_of,
    request,
    submit_arriving,
    wait_until,
)
from tests.support.hybrid_models import FULL, HYBRID_ARCHS, SLIDING, make_hybrid_models, make_llama4_models
from tests.support.tiny_models import cpu_pool

CHUNK = 16


@pytest.fixture
def packed(engines):
    def make(**batching):
        return engines(**{"prefill_chunk_tokens": CHUNK, "prefill_token_budget": CHUNK, "packed_steps": True,
                          **batching})

    return make


# ------------------------------------------------------------------------------------------------ tokens
@pytest.mark.parametrize("budget, per_step", [(CHUNK, 1), (CHUNK // 4, 1), (3 * CHUNK, 2)])
def test_packed_steps_give_each_request_its_tokens_alone(packed, oracle, budget, per_step):
    """Prompts many chunks long, shorter than a chunk and just over one, at once and arriving while others decode;
    one chunk per step, a chunk every fourth step, and two requests' chunks per step (the first rides on the decode
    step, the second runs alone): each request's tokens are its tokens alone, and chunks did ride on decode steps."""
    engine, events, pool = packed(prefill_token_budget=budget, prefills_per_step=per_step)
    lengths = [(100, 9), (5, 6), (17, 12), (33, 4), (61, 7), (12, 10), (16, 5), (47, 8)]
    sent = submit_arriving(engine, lengths, seed=300, prefix="p")
    assert_each_alone(events, sent, oracle)
    stats = engine.stats()
    assert stats.prefills == len(sent)
    assert stats.packed_steps > 0
    assert pool.free_pages() == pool.total_pages()


def test_a_long_prompt_rides_on_the_running_rows_decode_steps(packed, oracle, tiny_pair):
    """While a request decodes, every chunk of a long prompt shares a forward with its decode step: no forward of a
    chunk alone, no decode forward between two chunks, one token of the running request per chunk."""
    engine, events, _ = packed()
    log = PackedLog(tiny_pair[0])
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
    chunks = [entry for entry in entries if entry[0] != "decode"]
    assert chunks == [("packed", 1, CHUNK)] * 12 + [("packed", 1, 200 - 12 * CHUNK)]
    first, last = entries.index(chunks[0]), len(entries) - 1 - entries[::-1].index(chunks[-1])
    assert all(kind == "packed" for kind, _, _ in entries[first : last + 1])
    assert events.tokens("runner") == oracle(runner, 60)
    assert events.tokens("long") == oracle(long_prompt, 5)


def test_a_packed_step_counts_as_a_decode_step_of_every_row(packed, tiny_pair):
    """The batch's host bookkeeping (steps decoded and room left per row, which guard a row past its pages) counts a
    packed forward like any decode step: at each forward with decoding rows, the runner (row 0 throughout) has
    decoded one step per earlier such forward."""
    engine, events, _ = packed()
    seen = []
    log = PackedLog(tiny_pair[0], lambda entry: seen.append((entry[0], engine.batch.steps[0], engine.batch.room[0]))
                    if entry[0] != "prefill" else None)
    try:
        engine.submit(request("runner", prompt_of(20, seed=1), 40))
        assert wait_until(lambda: len(events.tokens("runner")) >= 2, timeout=30)
        engine.submit(request("long", prompt_of(5 * CHUNK, seed=2), 3))
        events.wait_finals(2)
    finally:
        log.remove()
    assert sum(kind == "packed" for kind, _, _ in seen) == 5
    assert [steps for _, steps, _ in seen] == list(range(len(seen)))
    assert [room for _, _, room in seen] == [seen[0][2] - i for i in range(len(seen))]


def test_packed_steps_off_alternate_decode_and_chunk_forwards(engines, tiny_pair):
    """The default (packed_steps=False) keeps a decode forward and a chunk forward apart."""
    engine, events, _ = engines(prefill_chunk_tokens=CHUNK, prefill_token_budget=CHUNK)
    log = PackedLog(tiny_pair[0])
    try:
        engine.submit(request("runner", prompt_of(20, seed=1), 30))
        assert wait_until(lambda: len(events.tokens("runner")) >= 2, timeout=30)
        engine.submit(request("long", prompt_of(64, seed=2), 3))
        events.wait_finals(2)
    finally:
        log.remove()
    kinds = {kind for kind, _, _ in log.kinds()}
    assert "packed" not in kinds and {"prefill", "decode"} <= kinds
    assert engine.stats().packed_steps == 0


# ------------------------------------------------------------------------------------------------ lifecycle
def test_a_failed_packed_forward_ends_its_rows_and_its_prompt_only(packed, oracle, tiny_pair):
    """A packed forward that raises cannot be pinned on one of its requests: the prompt being prefilled and the rows
    decoding in it end with the error (their pages back); the engine serves the next request alone."""
    engine, events, pool = packed()
    seen = []

    def fail_at_second_packed(entry):
        if entry[0] == "packed":
            seen.append(entry)
            if len(seen) == 2:
                raise RuntimeError("injected packed failure")

    engine.submit(request("runner", prompt_of(21, seed=15), 30))
    assert wait_until(lambda: len(events.tokens("runner")) >= 1, timeout=30)
    log = PackedLog(tiny_pair[0], fail_at_second_packed)
    try:
        engine.submit(request("long", prompt_of(100, seed=17), 5))
        events.wait_finals(2)
    finally:
        log.remove()
    for rid in ("runner", "long"):
        final = events.finals(rid)[0]
        assert final.finish_reason is FinishReason.ERROR and "injected packed failure" in final.error, rid
    assert pool.free_pages() == pool.total_pages()
    after = prompt_of(40, seed=16)
    engine.submit(request("after", after, 4))
    events.wait_finals(3)
    assert events.tokens("after") == oracle(after, 4)
    assert pool.free_pages() == pool.total_pages()


def test_a_prompt_cancelled_between_its_packed_chunks_ends_alone(packed, oracle, tiny_pair):
    """A request cancelled while its prompt rides on the decode steps (after its second of seven chunks): it ends
    CANCELLED with no token and no further chunk of it runs; the running request keeps its tokens alone; every page
    is back once both have ended."""
    engine, events, pool = packed()
    runner = prompt_of(21, seed=25)
    engine.submit(request("runner", runner, 40))
    assert wait_until(lambda: len(events.tokens("runner")) >= 1, timeout=30)

    def cancel_after_second_chunk(entry):
        if entry[0] == "packed" and sum(kind == "packed" for kind, _, _ in log.kinds()) == 2:
            engine.cancel("long")

    log = PackedLog(tiny_pair[0], cancel_after_second_chunk)
    try:
        engine.submit(request("long", prompt_of(7 * CHUNK, seed=27), 5))
        events.wait_finals(2)
    finally:
        log.remove()
    final = events.finals("long")[0]
    assert final.finish_reason is FinishReason.CANCELLED and events.tokens("long") == []
    # the flag is read between forwards: the chunk in flight when it was set may finish, none after it
    assert sum(kind == "packed" for kind, _, _ in log.kinds()) <= 3, log.kinds()
    assert events.tokens("runner") == oracle(runner, 40)
    assert pool.free_pages() == pool.total_pages()


@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_packed_steps_is_validated_naming_the_field(value):
    with pytest.raises(ValueError, match="BatchingConfig.packed_steps must be True or False"):
        BatchingConfig(packed_steps=value)


# ------------------------------------------------------------------------------------------------ hybrid models
PROMPTS = [(30, 9), (17, 3), (45, 12), (5, 6), (26, 1), (33, 8)]


def _started(served, pool, packed: bool = True):
    """A started engine over ``pool`` that prefills in chunks of 8 tokens (one per decode step), with packed steps
    or alternating, and its events."""
    engine = BatchingEngine(served, CFG, pool, BatchingConfig(max_running=8, buckets=(1, 2, 4, 8), packed_steps=packed,
                                                              prefill_chunk_tokens=8, prefill_token_budget=8))
    events = Events()
    engine.start(events)
    return engine, events


def _serve(served, pool, prompts):
    """``prompts`` (with ``PROMPTS``' max_tokens) through a packed engine, the third on arriving while two decode."""
    engine, events = _started(served, pool)
    try:
        for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
            engine.submit(request(f"h{i}", prompt, n))
            if i == 1:
                assert wait_until(lambda: engine.steps >= 2, timeout=30)  # the rest arrive while two decode
        events.wait_finals(len(PROMPTS))
    finally:
        engine.stop(timeout=60)
    return engine, events


@pytest.mark.parametrize("arch", list(HYBRID_ARCHS))
def test_hybrid_models_packed_equal_each_alone(arch):
    """Sliding-window layers in packed forwards: the chunk's rows of transformers' sliding mask, the decoding rows'
    rings; chunks of 8 tokens (the window is 8 on these configs: chunks start inside, at and past it)."""
    served, _ = make_hybrid_models(arch)
    alone, _ = make_hybrid_models(arch)
    pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=10)
    prompts = [prompt_of(n, seed=900 + n) for n, _ in PROMPTS]
    engine, events = _serve(served, pool, prompts)
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"h{i}") == oracle_tokens(alone, prompt, CFG, n), f"{arch} request {i}"
    assert engine.stats().packed_steps > 0
    assert pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()


@pytest.mark.skipif(GENERATE_BROKEN, reason="this transformers' generate() cannot run Llama 4 (the oracle)")
def test_llama4_position_scaled_queries_keep_alternating():
    """Llama 4 scales a NoPE layer's queries by the forward's own columns, which a packed row does not have: its
    engine alternates decode and chunk forwards (no packed step) and its tokens stay each request's alone."""
    served, alone = make_llama4_models()[0], make_llama4_models()[0]
    pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=10)
    prompts = [prompt_of(n, seed=950 + n) for n, _ in PROMPTS]
    engine, events = _serve(served, pool, prompts)
    for i, (prompt, (_, n)) in enumerate(zip(prompts, PROMPTS)):
        assert events.tokens(f"h{i}") == oracle_tokens(alone, prompt, CFG, n), f"llama4 request {i}"
    assert engine.stats().packed_steps == 0


# ------------------------------------------------------------------------------------------------ the chunk's mask
class _Batch:
    layers = [type("L", (), {"device": torch.device("cpu")})()]


class _Cache:
    layers = [object()]
    is_sliding = [False]


class _SlidingCache:
    layers = [object()]
    is_sliding = [True]


@pytest.mark.parametrize("rows, start, tokens, kv_length", [(1, 0, 5, 5), (3, 5, 4, 9), (2, 6, 1, 7), (4, 14, 6, 20),
                                                            (2, 24, 8, 48), (1, 0, 8, 48), (3, 40, 8, 48)])
def test_the_chunk_mask_is_causal_by_position_where_transformers_skipped_it(rows, start, tokens, kv_length):
    """Query j of the chunk is position start + j; key column k is position k (a full-attention layer): the query
    sees k <= start + j. Keys past the chunk's end (a prefix hit whose window a chunk replays) stay hidden."""
    step = PackedStepCache(_Batch(), rows, cache=_Cache(), start=start, tokens=tokens)
    mask = step.chunk_mask(None, kv_length, 0)
    if start == 0 and tokens == kv_length:
        assert mask is None  # square causal: the path a forward of the chunk alone takes
        return
    expected = torch.tensor([[k <= start + j for k in range(kv_length)] for j in range(tokens)])
    assert torch.equal(mask[0, 0], expected)
    assert step.chunk_mask(None, kv_length, 0) is mask  # one object per forward: the attention memos hold


@pytest.mark.parametrize("start, tokens, kv_length", [(30, 5, 7), (8, 8, 8), (0, 4, 4), (40, 3, 7)])
def test_a_sliding_layers_skipped_mask_is_lower_right_causal(start, tokens, kv_length):
    """A sliding layer holds the positions just before the chunk's (fewer than its window when transformers skips
    its mask): its key column k is position start + tokens - kv_length + k, whatever the chunk's start."""
    step = PackedStepCache(_Batch(), 2, cache=_SlidingCache(), start=start, tokens=tokens)
    mask = step.chunk_mask(None, kv_length, 0)
    if tokens == kv_length:
        assert mask is None
        return
    expected = torch.ones(tokens, kv_length, dtype=torch.bool).tril(diagonal=kv_length - tokens)
    assert torch.equal(mask[0, 0], expected)


def test_a_chunk_past_its_keys_is_refused():
    with pytest.raises(RuntimeError, match="layer 0 returned 9 keys for a chunk at positions 6..9"):
        PackedStepCache(_Batch(), 1, cache=_Cache(), start=6, tokens=4).chunk_mask(None, 9, 0)


def test_the_chunk_mask_is_the_packed_masks_last_rows():
    step = PackedStepCache(_Batch(), 3, cache=_Cache(), start=6, tokens=4)
    packed = torch.rand(1, 1, 7, 10) > 0.5
    mask = step.chunk_mask(packed, 10, 0)
    assert torch.equal(mask, packed[:, :, 3:]) and step.chunk_mask(packed, 10, 0) is mask


def test_a_packed_step_refuses_a_cache_whose_layers_are_not_built():
    with pytest.raises(ValueError, match="model_config=model.config"):
        PackedStepCache(_Batch(), 2, cache=type("Empty", (), {"layers": []})(), start=0, tokens=4)
    with pytest.raises(ValueError, match="at least one decoding row"):
        PackedStepCache(_Batch(), 0, cache=_Cache(), start=0, tokens=4)


# ------------------------------------------------------------------------------------------------ prefix hits
# Gemma 3 with its global layer first and three sliding layers after it: the windows at the hit's end reach back
# through them into the replayed columns
GEMMA3_EARLY_GLOBAL = {"layer_types": [FULL, SLIDING, SLIDING, SLIDING]}


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("gemma3", {}), ("gpt_oss", {}),
                                             ("gemma3", GEMMA3_EARLY_GLOBAL)],
                         ids=["llama", "gemma3", "gpt_oss", "gemma3_early_global"])
def test_a_prefix_hit_prefilled_in_packed_steps_equals_the_request_alone(arch, overrides, tiny_pair):
    """A request sharing an earlier one's prefix reuses its pages (on a model with sliding-window layers it replays
    the windows before the hit's end, its full layers already holding the hit's columns, which the replayed queries
    must not see) while another request decodes, so its chunks, replayed ones included, ride on decode steps: every
    request's tokens are its own alone."""
    if arch == "llama":
        served, alone = tiny_pair
        pool = make_pool(served, config=CFG)
    else:
        served, _ = make_hybrid_models(arch, **overrides)
        alone, _ = make_hybrid_models(arch, **overrides)
        pool = cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=10)
    shared = prompt_of(48, seed=21)
    prompts = {"first": shared + prompt_of(30, seed=22), "runner": prompt_of(20, seed=23),
               "hit": shared + prompt_of(37, seed=24)}
    engine, events = _started(served, pool)
    try:
        engine.submit(request("first", prompts["first"], 4))
        events.wait_finals(1)
        hits = pool.stats().hit_pages
        engine.submit(request("runner", prompts["runner"], 40))
        assert wait_until(lambda: len(events.tokens("runner")) >= 2, timeout=30)
        packed_before = engine.stats().packed_steps
        engine.submit(request("hit", prompts["hit"], 6))
        events.wait_finals(3)
    finally:
        engine.stop(timeout=60)
    assert pool.stats().hit_pages > hits
    assert engine.stats().packed_steps > packed_before
    for rid, n in (("first", 4), ("runner", 40), ("hit", 6)):
        assert events.tokens(rid) == oracle_tokens(alone, prompts[rid], CFG, n), f"{arch} {rid}"
    assert pool.free_pages() == pool.total_pages()


def _prompt_logits(served, pool, prompts: dict, packed: bool) -> dict:
    """The logits at the last position of each prompt (each of a length of its own), in an engine with or without
    packed steps: one request first, a runner, then the rest arriving while it decodes (chunks of 8)."""
    last = {len(prompt) - 1: rid for rid, prompt in prompts.items()}
    seen: dict[str, torch.Tensor] = {}

    def keep(module, args, kwargs, output):  # prompt forwards only (every last chunk here is over one token long)
        positions = kwargs["position_ids"]
        rid = last.get(int(positions[0, -1])) if positions.shape[0] == 1 and positions.shape[1] > 1 else None
        if rid is not None and rid not in seen:
            seen[rid] = output.logits[0, -1].detach().clone()

    handle = served.register_forward_hook(keep, with_kwargs=True)
    engine, events = _started(served, pool, packed)
    try:
        rids = list(prompts)
        engine.submit(request(rids[0], prompts[rids[0]], 2))
        events.wait_finals(1)
        engine.submit(request(rids[1], prompts[rids[1]], 60))
        assert wait_until(lambda: len(events.tokens(rids[1])) >= 2, timeout=30)
        for rid in rids[2:]:
            engine.submit(request(rid, prompts[rid], 3))
        events.wait_finals(len(rids))
    finally:
        engine.stop(timeout=60)
        handle.remove()
    assert set(seen) == set(prompts)
    return seen


def test_a_replayed_prefix_gives_the_logits_of_an_alternating_engine():
    """Tokens of tiny random models barely depend on what a replayed chunk's global layer attends to, so the logits
    are compared: the last prompt position of a hit with 3 tokens after it (so the sliding layers' windows there
    still reach into the replayed columns), prefilled in packed steps after a replay whose global layer (the first,
    three sliding layers after it) must not let its queries see the hit's later columns, against the same engine
    alternating (float32; the packed row's GEMMs round alike to about 1e-6 here, a query that sees later columns
    moves them by about 1e-2)."""
    served, _ = make_hybrid_models("gemma3", layer_types=[FULL, SLIDING, SLIDING, SLIDING])
    shared = prompt_of(48, seed=31)
    prompts = {"first": shared + prompt_of(30, seed=32), "runner": prompt_of(20, seed=33),
               "hit": shared + prompt_of(3, seed=34)}
    pools = [cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=10) for _ in range(2)]
    alternating, packed = (_prompt_logits(served, pool, prompts, mode)["hit"]
                           for pool, mode in zip(pools, (False, True)))
    assert all(pool.stats().hit_pages > 0 for pool in pools)
    torch.testing.assert_close(packed, alternating, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", *HYBRID_ARCHS])
def test_every_prompts_logits_equal_an_alternating_engine(arch, tiny_pair):
    """Logits, not only tokens: the last position of every prompt (arriving while a request decodes, several
    chunks long, under a prefix hit, a few tokens after the hit) prefilled in packed steps against the same engine
    alternating (float32; rounding of the packed row's GEMMs only)."""
    if arch == "llama":
        served = tiny_pair[0]
        pools = [make_pool(served, config=CFG) for _ in range(2)]
    else:
        served, _ = make_hybrid_models(arch)
        pools = [cpu_pool(served, CFG, 2 << 20, 8, sliding_slots=10) for _ in range(2)]
    shared = prompt_of(48, seed=41)
    prompts = {"first": shared + prompt_of(30, seed=42), "runner": prompt_of(21, seed=43),
               "hit_near": shared + prompt_of(3, seed=44), "hit_far": shared + prompt_of(19, seed=45),
               "long": prompt_of(45, seed=46), "short": prompt_of(6, seed=47)}
    alternating, packed = (_prompt_logits(served, pool, prompts, mode) for pool, mode in zip(pools, (False, True)))
    for rid in prompts:
        torch.testing.assert_close(packed[rid], alternating[rid], rtol=0, atol=1e-4, msg=f"{arch} {rid}")
