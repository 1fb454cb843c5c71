"""The continuous-batching engine (serving/batching/engine.py) on a GPU, as benchmarks/batching_throughput.py drives it:
one engine whose decode graphs are captured before it starts (``warm_up``), then a fixed workload (every request
submitted at once) and a staggered one of mixed prompt lengths.

Checked per workload: every request finishes with reason ``length`` and exactly its max_tokens tokens, no request
reports an error, no decode graph is captured after the warm-up (each bucket's graph is replayed), the decode steps
ran batched, and every pool page is free again once the requests are done. On bf16 pool pages and on fp8 (e4m3)
pages. Llama-3.1-8B layer shapes (4 layers), random bf16 weights, greedy decoding with EOS ignored.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVConfig
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from hf_rocketkv.serving.engines.interface import EngineRequest
from hf_rocketkv.serving.sampling import SamplingParams

from .gpu_models import CUDA, Collector, llama_8b_layers

LAYERS, MAX_RUNNING, NEW_TOKENS = 4, 8, 32
FIXED = [2048] * 8  # prompt lengths
MIXED = [300, 4096, 1024, 700, 2500, 1500]
POOL_BYTES = 2 << 30


@pytest.fixture(scope="module")
def model():
    return llama_8b_layers(LAYERS)


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _request(rid: str, length: int, rng: random.Random, vocab: int) -> EngineRequest:
    prompt = tuple(rng.randrange(3, vocab) for _ in range(length))
    return EngineRequest(rid, prompt, SamplingParams.greedy(NEW_TOKENS, ignore_eos=True), frozenset())


@pytest.mark.parametrize("packed", [False, True], ids=["alternating", "packed_steps"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16_pages", "fp8_pages"])
def test_every_request_finishes_with_its_tokens_and_the_pool_empties(model, kv_dtype, packed):
    """``packed``: each prompt chunk (1024 tokens) in the forward of a decode step (``packed_steps``)."""
    config = RocketKVConfig(backend="triton")
    pool = KVBlockPool(model, max_gpu_bytes=POOL_BYTES, page_size=16, kt_page_size=config.page_size,
                       kt_dtype=config.kt_cache_dtype, device=CUDA, dtype=kv_dtype)
    chunks = {"packed_steps": True, "prefill_chunk_tokens": 1024, "prefill_token_budget": 1024} if packed else {}
    batching = BatchingConfig(max_running=MAX_RUNNING, max_queue=64, buckets=(1, 2, 4, 8), **chunks)
    engine = BatchingEngine(model, config, pool, batching)
    assert engine.graphs_in_use, "the engine must capture its decode graphs on CUDA"
    engine.warm_up(max_new_tokens=NEW_TOKENS)
    captures = engine.graphs.captures
    sink = Collector()
    engine.start(sink)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    try:
        for name, lengths, gap_s in (("fixed", FIXED, 0.0), ("mixed", MIXED, 0.05)):
            before = engine.stats()
            ids = [f"{name}{i}" for i in range(len(lengths))]
            for rid, length in zip(ids, lengths):
                engine.submit(_request(rid, length, rng, vocab))
                time.sleep(gap_s)
            assert sink.wait(ids, timeout=600), f"the {name} workload did not finish"
            after = engine.stats()
            for rid in ids:
                final = sink.finals[rid]
                assert final.error is None, f"{rid}: {final.error}"
                assert final.finish_reason.value == "length", f"{rid} ended with {final.finish_reason}"
                assert len(sink.tokens[rid]) == NEW_TOKENS, f"{rid} streamed {len(sink.tokens[rid])} tokens"
            assert engine.graphs.captures == captures, f"{name}: a decode graph was captured after the warm-up"
            if name == "fixed":  # submitted at once: the decode steps must batch them
                steps = after.decode_steps - before.decode_steps
                assert (after.decode_rows - before.decode_rows) / max(1, steps) > 1, "no decode step ran batched"
            if packed:  # 2048-token prompts arriving while others decode: their chunks rode on decode steps
                assert after.packed_steps > before.packed_steps, f"{name}: no chunk shared a decode step's forward"
            # the final event may reach the sink just before the engine thread gives the request's pages back
            emptied = _wait_until(lambda: pool.free_pages() == pool.total_pages(), timeout=5.0)
            assert emptied, f"{name}: {pool.total_pages() - pool.free_pages()} pages held after every request ended"
    finally:
        engine.stop(drain=False, timeout=120)
        pool.close()
