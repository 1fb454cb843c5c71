"""Hybrid models (sliding-window + global layers) on a KVBlockPool on a GPU: the Triton kernels on the global layers'
pool pages, the sliding layers' rings in the pool's slab, decode steps captured as CUDA graphs (generate()'s per
request, the batching engine's per bucket).

- generate() on the pool: graphed decode is bit-identical to eager decode (bf16, eviction on), for one row and for a
  batch whose rows' slots are not consecutive; with every page attended (fp32) its tokens are those of transformers'
  own eager attention and cache;
- the batching engine, warmed up (every bucket captured before it starts): each request's tokens are those of the
  request alone through generate() (fp32, every page attended), nothing is captured while serving, every page and
  slot comes back; Llama 4 too (chunked layers, a NoPE layer scaled by position), against plain eager forwards of
  the request alone (transformers 5.17's generate() cannot run Llama 4).

Tiny random configs of tests/support/hybrid_models.py (4 layers, window 8) moved to the GPU.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.integration.call_state import call_state
from hf_rocketkv.memory import RowDemand
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from hf_rocketkv.serving.engines.interface import EngineRequest
from hf_rocketkv.serving.sampling import SamplingParams
from hf_rocketkv.integration.compat import cache_kwargs
from tests.support.hybrid_models import make_hybrid_models, make_llama4_models

from .gpu_models import CUDA, Collector, greedy

ARCHS = ["gpt_oss", "gemma3"]
PROMPT, NEW_TOKENS = 200, 24
REPLAYS = NEW_TOKENS - 2
COMPRESSING = RocketKVConfig(prompt_budget=64, window_size=8, kernel_size=5, topk=6, topr=8, page_size=4,
                             backend="triton")
KEEP_ALL = RocketKVConfig(prompt_budget=1024, window_size=8, kernel_size=5, topk=4096, topr=16, page_size=4,
                          kt_cache_dtype="float32", backend="triton")


def _pool(model, config, dtype, slots=8):
    return KVBlockPool(model, max_gpu_bytes=64 << 20, page_size=16, dtype=dtype, device=CUDA,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, sliding_slots=slots)


def _prompt(vocab: int, batch: int = 1, length: int = PROMPT) -> torch.Tensor:
    generator = torch.Generator("cuda").manual_seed(batch + length)
    return torch.randint(3, vocab, (batch, length), device=CUDA, generator=generator)


def _step_dtype(model) -> torch.dtype:
    """float32, except for gpt-oss: transformers' MoE experts cannot be captured in float32 on CUDA (``grouped_mm``
    copies to the host inside ``torch._grouped_mm``, the ``eager`` experts read ``nonzero()``), so the engine would
    decode eagerly (one warning line); in bfloat16 the grouped GEMM is captured."""
    return torch.bfloat16 if getattr(model.config, "num_local_experts", None) else torch.float32


def _all_back(pool) -> bool:
    return pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_decode_on_the_pool_is_bit_identical_to_eager(arch, batch):
    rocket, _ = make_hybrid_models(arch)
    rocket = rocket.to(CUDA, torch.bfloat16)
    pool = _pool(rocket, COMPRESSING, torch.bfloat16)
    # both runs prefill cold: a prefix hit would prefill only the prompt's tail, through another attention kernel
    # than a whole prompt's (bf16 rounding); this test compares the decode runners alone
    pool.prefix_reuse = False
    hole = None
    if batch > 1:  # slot 0 free, slot 1 held: the batch's slots are 0, 2, 3 (its rings gathered each step)
        demand = RowDemand(prompt_tokens=4, new_tokens=1, view_tokens=5, hit_cap_tokens=0)
        first, hole = pool.admit(4, 1, demand), pool.admit(4, 1, demand)
        pool.release(first)
    ids = _prompt(rocket.config.vocab_size, batch)
    runs = []
    for compiled in (False, True):
        cache = RocketKVCache(COMPRESSING, pool=pool)
        runs.append(greedy(rocket, ids, cache, NEW_TOKENS, compiled))
        step = call_state(cache).graphed_step
        if compiled:
            assert step is not None and step.replays == REPLAYS, f"{arch}: the decode steps did not replay a graph"
        cache.close()
    assert torch.equal(runs[1], runs[0]), f"{arch}: {(runs[1] == runs[0]).float().mean().item():.3f} equal"
    if hole is not None:
        pool.release(hole)
    assert _all_back(pool)


@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_keep_all_decode_on_the_pool_equals_transformers_eager(arch):
    rocket, oracle = make_hybrid_models(arch)
    rocket, oracle = rocket.to(CUDA), oracle.to(CUDA)
    pool = _pool(rocket, KEEP_ALL, torch.float32)
    ids = _prompt(rocket.config.vocab_size)
    cache = RocketKVCache(KEEP_ALL, pool=pool)
    tokens = greedy(rocket, ids, cache, NEW_TOKENS, compiled=True)
    expected = greedy(oracle, ids, None, NEW_TOKENS, compiled=False)
    assert torch.equal(tokens, expected), f"{arch}: {(tokens == expected).float().mean().item():.3f} equal"
    cache.close()
    assert _all_back(pool)


def _serve_after_warm_up(engine, prompts: list[list[int]], prefix: str, captures: int) -> Collector:
    """Every prompt through a warmed-up engine (12 greedy tokens each, request ``f"{prefix}{i}"``); checks that every
    step replayed a graph captured at warm-up (``captures`` graphs then) and returns the sink."""
    sink = Collector()
    engine.start(sink)
    try:
        for i, prompt in enumerate(prompts):
            engine.submit(EngineRequest(f"{prefix}{i}", tuple(prompt), SamplingParams.greedy(12, ignore_eos=True),
                                        frozenset()))
        assert sink.wait(len(prompts), timeout=300)
    finally:
        engine.stop(timeout=60)
    assert engine.graphs is not None, "a decode graph failed to capture: the engine decoded eagerly"
    assert engine.graphs.captures == captures  # every step replayed a graph captured at warm-up
    return sink


PREFILL_MODES = {"serial_prefill": {}, "prefill_beside_decode": {"concurrent_prefill_tokens": 16},
                 "packed_steps": {"packed_steps": True, "prefill_chunk_tokens": 32, "prefill_token_budget": 32}}


@pytest.mark.parametrize("mode", list(PREFILL_MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_the_batching_engine_with_graphs_equals_each_request_alone(arch, mode):
    """``mode``: prompts prefilled between decode steps; on a thread and stream of their own in chunks of 16 tokens
    while rows decode (``concurrent_prefill_tokens``); in chunks of 32 tokens, each in the forward of a decode step
    (``packed_steps``: eager, while decode-only steps replay their graphs)."""
    rocket, _ = make_hybrid_models(arch)
    alone, _ = make_hybrid_models(arch)
    dtype = _step_dtype(rocket)
    rocket, alone = rocket.to(CUDA, dtype), alone.to(CUDA, dtype)
    pool = _pool(rocket, KEEP_ALL, dtype, slots=6)
    engine = BatchingEngine(rocket, KEEP_ALL, pool, BatchingConfig(max_running=4, buckets=(1, 2, 4),
                                                                   **PREFILL_MODES[mode]))
    assert engine.graphs_in_use
    engine.warm_up(max_new_tokens=16)
    captures = engine.graphs.captures
    assert _all_back(pool)
    lengths = [37, 120, 9, 64, 200, 15]
    prompts = [_prompt(rocket.config.vocab_size, 1, n)[0].tolist() for n in lengths]
    sink = _serve_after_warm_up(engine, prompts, "h", captures)
    if mode == "packed_steps":
        assert engine.stats().packed_steps > 0
    for i, prompt in enumerate(prompts):
        assert sink.finals[f"h{i}"].error is None, sink.finals[f"h{i}"].error
        assert len(sink.tokens[f"h{i}"]) == 12
        if dtype != torch.float32:  # bf16: a row's GEMMs round differently in a batch than alone; no token oracle
            continue
        ids = torch.tensor([prompt], device=CUDA)
        expected = greedy(alone, ids, RocketKVCache(KEEP_ALL), 12, compiled=False)[0].tolist()
        assert sink.tokens[f"h{i}"] == expected, f"{arch} request {i}"
    assert _all_back(pool)


def _plain_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of one request alone through plain eager forwards on its own RocketKVCache (KEEP_ALL)."""
    cache = RocketKVCache(KEEP_ALL, model_config=model.config)
    ids, tokens = torch.tensor([prompt], device=CUDA), []
    with torch.no_grad():
        for _ in range(new_tokens):
            token = int(model(ids, **cache_kwargs(cache)).logits[0, -1].argmax())
            tokens.append(token)
            ids = torch.tensor([[token]], device=CUDA)
    return tokens


def test_the_batching_engine_serves_llama4_with_graphs():
    """Llama 4 (dense MLPs, so float32 steps are captured): rows at different positions in one captured step, chunk
    boundaries crossed while decoding; each request's tokens those of the request alone."""
    rocket, _ = make_llama4_models(moe_layers=[])
    alone, _ = make_llama4_models(moe_layers=[])
    rocket, alone = rocket.to(CUDA), alone.to(CUDA)
    pool = _pool(rocket, KEEP_ALL, torch.float32, slots=6)
    engine = BatchingEngine(rocket, KEEP_ALL, pool, BatchingConfig(max_running=4, buckets=(1, 2, 4)))
    assert engine.graphs_in_use
    engine.warm_up(max_new_tokens=16)
    captures = engine.graphs.captures
    prompts = [_prompt(rocket.config.vocab_size, 1, n)[0].tolist() for n in (37, 120, 9, 64, 200, 15)]
    sink = _serve_after_warm_up(engine, prompts, "l", captures)
    for i, prompt in enumerate(prompts):
        assert sink.finals[f"l{i}"].error is None, sink.finals[f"l{i}"].error
        assert sink.tokens[f"l{i}"] == _plain_greedy(alone, prompt, 12), f"llama4 request {i}"
    assert _all_back(pool)
