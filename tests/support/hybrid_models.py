"""Tiny random models with sliding-window layers, soft-capping and sinks (Gemma 2, Gemma 3, Cohere 2, gpt-oss with
tiny experts, Mistral with a window), each beside its oracle: the same weights on transformers' own eager attention
and cache (``DynamicCache`` with ``DynamicSlidingWindowLayer`` for the sliding layers).

fp32 on the CPU, hidden 64, 4 layers, 4 query heads over 2 KV heads, head_dim 16, window 8, random weights from a
fixed seed (a larger init spread than the default, so greedy tokens vary); gpt-oss' sinks are drawn at random too
(they are created uninitialised).

Llama 4 (``make_llama4_models``): three chunked-attention layers (chunk 8) and one full-attention NoPE layer whose
queries are scaled by position (``attn_temperature_tuning`` with ``floor_scale`` 4, so the scale changes every 4
positions), two tiny experts on every other layer.
"""

from __future__ import annotations

import torch
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    MistralConfig,
    MistralForCausalLM,
)

from tests.support.tiny_models import BASE_CONFIG, paired_models

WINDOW = 8
SLIDING, FULL = "sliding_attention", "full_attention"

HYBRID_ARCHS = {
    # Gemma 2: alternating sliding / global layers, logits soft-capped at 5 (small, so the cap bites)
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(attn_logit_softcapping=5.0, query_pre_attn_scalar=16,
                                                     final_logit_softcapping=None)),
    # Gemma 3: several sliding layers per global one, q/k norms, per-layer-type RoPE
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(layer_types=[SLIDING, SLIDING, FULL, SLIDING],
                                                         query_pre_attn_scalar=16)),
    "cohere2": (Cohere2Config, Cohere2ForCausalLM, dict(layer_types=[SLIDING, SLIDING, SLIDING, FULL])),
    # gpt-oss: alternating layers, learned sinks, MoE with tiny experts, YaRN RoPE
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                      intermediate_size=32)),
    # Mistral with a window: every layer slides
    "mistral": (MistralConfig, MistralForCausalLM, dict()),
}


def hybrid_config(arch: str, **overrides):
    config_cls, _, extra = HYBRID_ARCHS[arch]
    kwargs = {**BASE_CONFIG, "num_hidden_layers": 4, "sliding_window": WINDOW, "initializer_range": 0.2, **extra,
              **overrides}
    return config_cls(**kwargs)


def make_hybrid_models(arch: str, seed: int = 0, **overrides):
    """``(rocket, oracle)``: one random tiny model of ``arch`` on ``rocketkv`` attention and the same weights on
    transformers' eager attention."""
    _, model_cls, _ = HYBRID_ARCHS[arch]
    return paired_models(model_cls, hybrid_config(arch, **overrides), "eager", seed, prepare_oracle=random_sinks)


def random_sinks(model) -> None:
    """Attention sinks drawn from N(0, 1) (transformers initialises them to zeros, which would hide their effect)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)


CHUNK = 8
LLAMA4 = dict(attention_chunk_size=CHUNK, no_rope_layers=[1, 1, 1, 0], attn_temperature_tuning=True, floor_scale=4,
              attn_scale=0.5, num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=64,
              interleave_moe_layer_step=2)


def llama4_config(**overrides) -> Llama4TextConfig:
    """Layer types ``[chunked, chunked, chunked, full]`` (the full one is the NoPE layer)."""
    return Llama4TextConfig(**{**BASE_CONFIG, "num_hidden_layers": 4, "initializer_range": 0.2, **LLAMA4,
                               **overrides})


def make_llama4_models(seed: int = 0, **overrides):
    """``(rocket, oracle)`` of a tiny random Llama 4 text model (``Llama4ForCausalLM``): ``rocketkv`` attention,
    and the same weights on transformers' eager attention (its own cache: ``DynamicSlidingWindowLayer`` of the chunk
    size for the chunked layers)."""
    return paired_models(Llama4ForCausalLM, llama4_config(**overrides), "eager", seed)
