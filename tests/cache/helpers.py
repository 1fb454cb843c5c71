"""Helpers of the cache tests (the fixtures they share, such as ``model``, live in tests/conftest.py)."""

from __future__ import annotations

import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration.compat import cache_kwargs


def kept(cache: RocketKVCache) -> list[list[list[list[int]]]]:
    """Kept input columns per (layer, row, KV head), in slot order."""
    out = []
    for layer in cache.layers:
        lengths = layer.lengths.tolist()
        out.append([[layer.positions[b, h, :n].tolist() for h in range(layer.num_kv_heads)]
                    for b, n in enumerate(lengths)])
    return out


def engine_prefill(model, pool, config, prompt: torch.Tensor, new_tokens: int) -> tuple[RocketKVCache, int]:
    """``prompt`` (1-D ids) through ``model`` with its own pool-backed cache, as the batching engine prefills a
    request admitted for ``new_tokens``; returns ``(cache, first token)``."""
    cache = RocketKVCache(config, pool=pool)
    ids = prompt[None]
    cache.hints.max_length = len(prompt) + new_tokens
    cache.begin_prefill(ids, None, max_new_tokens=new_tokens)
    start = cache.get_seq_length()
    with torch.no_grad():
        out = model(input_ids=ids[:, start:], attention_mask=torch.ones_like(ids),
                    position_ids=torch.arange(start, len(prompt))[None], **cache_kwargs(cache), use_cache=True,
                    logits_to_keep=1)
    return cache, int(out.logits[0, -1].argmax())
