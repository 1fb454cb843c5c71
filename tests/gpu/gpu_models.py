"""Models and generate() calls shared by the GPU tests: Llama-3.1-8B layer shapes with random weights, built on the
GPU the way the benchmarks build them (``hf_rocketkv.bench.decode.build_model``), so the tests compile the kernels
for the shapes the benchmarks time. Nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model

CUDA = torch.device("cuda")

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs (tensor parallelism over NCCL)")


def llama_8b_layers(layers: int, dtype: torch.dtype = torch.bfloat16):
    """Llama-3.1-8B with ``layers`` decoder layers, random weights (seed 0), on the GPU, RocketKV attention on."""
    import hf_rocketkv

    model = build_model(LLAMA_31_8B, layers, dtype, CUDA, 0)
    hf_rocketkv.enable(model)
    return model


def random_prompt(batch: int, length: int, seed: int, low: int = 3) -> torch.Tensor:
    """``[batch, length]`` token ids on the GPU, drawn from a seeded CUDA generator (the same ids every run)."""
    generator = torch.Generator("cuda").manual_seed(seed)
    return torch.randint(low, LLAMA_31_8B["vocab_size"], (batch, length), device=CUDA, generator=generator)


def greedy(model, ids: torch.Tensor, cache, new_tokens: int, compiled: bool, **kwargs) -> torch.Tensor:
    """The ``[B, new_tokens]`` greedy tokens of one generate() call (EOS never stops it): ``compiled`` lets
    generate() run the decode steps through the cache's decode runner, else every step runs eagerly."""
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=not compiled,
                             **kwargs)
    return out[:, ids.shape[1]:]
