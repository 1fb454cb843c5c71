"""generate_batch's default engine settings on a GPU (serving/batch.py, ``offline_batching_config``): on a card of
>= 70 GiB other than an A100 a prompt of up to 16k tokens is prefilled in one forward, elsewhere in 8k chunks as the
server does. Prompts of 3k, 9k and 12.5k tokens, through the default and through ``batching=BatchingConfig()`` (the
server's 8k chunks): each run gives every prompt's tokens alone, and the prefill forwards are the chunks the
settings ask for.

Oracle: model.generate on each prompt alone with a fresh RocketKVCache (no pool, the whole prompt in one forward).
Llama-3.1-8B layer shapes (2 layers), random float32 weights (bf16 rows round differently in a batch than alone),
greedy decoding with EOS ignored.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.serving import BatchingConfig, SamplingParams, generate_batch, offline_batching_config

from .gpu_models import CUDA, greedy, llama_8b_layers, random_prompt

PROMPTS, NEW_TOKENS = (3000, 9000, 12500), 8
CONFIG = RocketKVConfig(backend="triton", kt_cache_dtype="float32")


@pytest.fixture(scope="module")
def model():
    return llama_8b_layers(2, torch.float32)


class PrefillChunks:
    """The token count of every prefill forward of the model (the engine's prefill forwards ask for the last logits
    only), recorded by a forward pre-hook."""

    def __init__(self, model):
        self.tokens: list[int] = []
        self._lock = threading.Lock()
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if "logits_to_keep" in kwargs:
            with self._lock:
                self.tokens.append(kwargs["input_ids"].shape[1])

    def remove(self) -> None:
        self._handle.remove()


def _chunks(length: int, chunk: int) -> list[int]:
    return [min(chunk, length - start) for start in range(0, length, chunk)]


@pytest.mark.parametrize("batching", [None, BatchingConfig()], ids=["offline_default", "server_chunks"])
def test_generate_batch_tokens_equal_each_prompt_alone(model, batching):
    prompts = [random_prompt(1, n, seed=n)[0].tolist() for n in PROMPTS]
    expected = [greedy(model, torch.tensor([p], device=CUDA), RocketKVCache(CONFIG), NEW_TOKENS, False)[0].tolist()
                for p in prompts]
    pool = KVBlockPool(model, max_gpu_bytes=4 << 30, page_size=16, kt_page_size=CONFIG.page_size,
                       kt_dtype=CONFIG.kt_cache_dtype, device=CUDA, dtype=torch.float32)
    chunk = (batching or offline_batching_config(model)).prefill_chunk_tokens
    name = torch.cuda.get_device_name().lower()
    large = torch.cuda.get_device_properties(CUDA).total_memory >= 70 * 2**30 and "a100" not in name
    assert chunk == (16384 if batching is None and large else 8192)
    log = PrefillChunks(model)
    try:
        results = generate_batch(model, prompts, config=CONFIG, pool=pool, batching=batching,
                                 sampling=SamplingParams.greedy(NEW_TOKENS, ignore_eos=True))
    finally:
        log.remove()
        pool.close()
    assert [list(r.token_ids) for r in results] == expected
    assert sorted(log.tokens) == sorted(t for n in PROMPTS for t in _chunks(n, chunk))
