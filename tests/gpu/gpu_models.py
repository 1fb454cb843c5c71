"""Models and generate() calls shared by the GPU tests: Llama-3.1-8B layer shapes with random weights, built on the
GPU the way the benchmarks build them (``hf_rocketkv.bench.decode.build_model``), so the tests compile the kernels
for the shapes the benchmarks time. Nothing is downloaded."""

from __future__ import annotations

import threading

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


def hybrid_models_on_cuda(arch: str):
    """tests/support/hybrid_models.py's pair (RocketKV model, transformers' eager oracle) for ``arch`` on the GPU; an
    MoE model's experts run as float32 batched matmuls (transformers' default ``grouped_mm`` is a bf16 kernel on
    CUDA: float32 runs would differ by its rounding, far more than fp8 pages or RocketKV do; graph-safe too)."""
    from tests.support.hybrid_models import make_hybrid_models

    models = tuple(model.to(CUDA) for model in make_hybrid_models(arch))
    for model in models:
        if getattr(model.config, "num_local_experts", None) and hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("batched_mm")
    return models


def random_prompt(batch: int, length: int, seed: int, low: int = 3) -> torch.Tensor:
    """``[batch, length]`` token ids on the GPU, drawn from a seeded CUDA generator (the same ids every run)."""
    generator = torch.Generator("cuda").manual_seed(seed)
    return torch.randint(low, LLAMA_31_8B["vocab_size"], (batch, length), device=CUDA, generator=generator)


def greedy(model, ids: torch.Tensor, cache, new_tokens: int, compiled: bool, **kwargs) -> torch.Tensor:
    """The ``[B, new_tokens]`` greedy tokens of one generate() call (EOS never stops it): ``compiled`` lets
    generate() run the decode steps through the cache's decode runner, else every step runs eagerly."""
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=not compiled,
                             **kwargs)
    return out[:, ids.shape[1]:]


class Collector:
    """A batching engine's sink: per request, the tokens streamed back and the final event."""

    def __init__(self):
        self.cond = threading.Condition()
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, object] = {}

    def __call__(self, event) -> None:
        with self.cond:
            self.tokens.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finish_reason is not None:
                self.finals[event.request_id] = event
                self.cond.notify_all()

    def wait(self, requests: int | list[str], timeout: float) -> bool:
        """Until ``requests`` (those request ids, or that many requests) have finished, or ``timeout`` seconds."""
        with self.cond:
            if isinstance(requests, int):
                return self.cond.wait_for(lambda: len(self.finals) >= requests, timeout)
            return self.cond.wait_for(lambda: all(rid in self.finals for rid in requests), timeout)
