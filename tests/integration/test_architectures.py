"""The architectures the integration supports: the same integration checks on every one (tiny random Llama, Mistral,
Qwen2, Qwen3 with q/k norm), GQA layouts from MHA to MQA, and Mistral / Qwen2 with sliding windows."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache
from tests.support.tiny_models import (
    compressed_padded_batch,
    compressing_config,
    greedy,
    keep_all_config,
    left_pad,
    make_models,
    random_ids,
)

ARCH_LAYOUTS = [
    ("llama", dict()),  # 4 query heads, 2 KV heads
    ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),  # MHA
    ("llama", dict(num_attention_heads=8, num_key_value_heads=1, hidden_size=128)),  # MQA, G = 8
    ("mistral", dict()),
    ("qwen2", dict()),
    ("qwen3", dict()),
    ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=32, hidden_size=96)),  # G = 3, D = 32
]
IDS = [f"{arch}-{'-'.join(f'{k}{v}' for k, v in kw.items()) or 'base'}" for arch, kw in ARCH_LAYOUTS]


@pytest.mark.parametrize("arch,overrides", ARCH_LAYOUTS, ids=IDS)
def test_keep_all_equals_sdpa(arch, overrides):
    rocket, sdpa = make_models(arch, **overrides)
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (37, 25)])
    out = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(keep_all_config()), max_new_tokens=10)
    assert torch.equal(out, greedy(sdpa, ids, attention_mask=mask, max_new_tokens=10))
    kwargs = dict(num_beams=2, max_new_tokens=6)
    beams = greedy(rocket, ids[:1], cache=RocketKVCache(keep_all_config()), **kwargs)
    assert torch.equal(beams, greedy(sdpa, ids[:1], **kwargs))


@pytest.mark.parametrize("arch,overrides", ARCH_LAYOUTS, ids=IDS)
def test_compression_engaged_and_padding_invariant(arch, overrides):
    rocket, _ = make_models(arch, **overrides)
    kv_heads = rocket.config.num_key_value_heads
    rows, ids, mask, cache, batch = compressed_padded_batch(rocket)
    config = cache.config
    for layer_idx in range(rocket.config.num_hidden_layers):
        assert cache.kept_tokens(layer_idx).tolist() == [[24 + 7] * kv_heads] * 2
        assert cache.layers[layer_idx].keys.shape[1] == kv_heads
    for b, row in enumerate(rows):
        alone = greedy(rocket, row[None], cache=RocketKVCache(config), max_new_tokens=8)
        assert torch.equal(batch[b, ids.shape[1] :], alone[0, len(row) :])


@pytest.mark.parametrize("arch,overrides", [
    ("mistral", dict(sliding_window=16)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
])
def test_sliding_window_configs_equal_sdpa(arch, overrides):
    """Mistral with a window (every layer slides) and Qwen2 with use_sliding_window (layers from max_window_layers on
    slide): the same tokens as transformers' own sliding-window cache, with and without compression of the
    full-attention layers (tests/integration/test_hybrid_models.py has the other hybrid families)."""
    rocket, sdpa = make_models(arch, **overrides)
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (45, 30)])
    out = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(keep_all_config()), max_new_tokens=10)
    assert torch.equal(out, greedy(sdpa, ids, attention_mask=mask, max_new_tokens=10))
    cache = RocketKVCache(compressing_config())
    greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=4)
    assert [layer.is_sliding for layer in cache.layers] == [arch == "mistral", True]
    assert [layer.stored for layer in cache.layers if layer.is_sliding] == [15] * (1 + (arch == "mistral"))
