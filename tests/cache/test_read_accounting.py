"""``hf_rocketkv.cache.decode_read_bytes``: the bytes one decode step reads from a layer (the decode benchmark's GB/s).

Oracles independent of the selection: with ``topk`` at least the pages in use, stage 2 reads every stored token, so
the count is the stored tokens' K and V plus every page's KT rows, all from the layer's shapes and lengths; with a
small ``topk`` it reads at most ``topk`` pages of tokens per row and KV head.
"""

from __future__ import annotations

import torch

import hf_rocketkv
from hf_rocketkv.cache import decode_read_bytes
from hf_rocketkv.integration import compat
from tests.support.tiny_models import make_models, random_ids


def _layer_after_generate(**config):
    rocket, _ = make_models("llama")
    rocket_config = hf_rocketkv.RocketKVConfig(prompt_budget=16, window_size=4, kernel_size=3, page_size=4,
                                               backend="torch", **config)
    cache = hf_rocketkv.RocketKVCache(rocket_config)
    ids = random_ids(2, 40)
    with torch.no_grad():
        rocket.generate(ids, **compat.cache_kwargs(cache), max_new_tokens=5, do_sample=False,
                        attention_mask=torch.ones_like(ids), disable_compile=True)
    layer = cache.layers[0]
    query = torch.randn(2, rocket.config.num_attention_heads, 1, layer.keys.shape[-1], dtype=layer.keys.dtype)
    return layer, query


def test_every_page_selected_reads_every_stored_token_and_every_kt_page():
    layer, query = _layer_after_generate(topk=64)
    batch, kv_heads, _, head_dim = layer.keys.shape
    assert layer.lengths.shape == (batch,)  # one length per row (stage 1 keeps the same count in every head)
    tokens = int(layer.lengths.sum()) * kv_heads
    pages = int(((layer.lengths + 3) // 4).sum()) * kv_heads
    kt_row = head_dim * layer.kt.element_size()
    expected = tokens * 2 * head_dim * layer.keys.element_size() + pages * 2 * kt_row
    assert decode_read_bytes(layer, query) == expected


def test_a_small_topk_reads_at_most_topk_pages_of_tokens_per_head():
    layer, query = _layer_after_generate(topk=2)
    batch, kv_heads, _, head_dim = layer.keys.shape
    everything = _layer_after_generate(topk=64)
    kt_bytes = int(((layer.lengths + 3) // 4).sum()) * kv_heads * 2 * head_dim * layer.kt.element_size()
    token_bytes = decode_read_bytes(layer, query) - kt_bytes
    per_token = 2 * head_dim * layer.keys.element_size()
    assert token_bytes % per_token == 0
    assert 0 < token_bytes // per_token <= batch * kv_heads * 2 * 4
    assert decode_read_bytes(*everything) > decode_read_bytes(layer, query)
