"""The eval decode loop (eval/decode.py): a prompt prefilled once up to a shared prefix, then each method runs the
tail itself; greedy tokens equal model.generate's, teacher-forced log-probs equal a plain forward's, and the kept
tokens and bytes helpers read the cache.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.eval import decode
from hf_rocketkv.eval.methods import build_method
from tests.support.tiny_models import compressing_config, greedy, make_models, random_ids


@pytest.mark.parametrize("name", ["full", "rocketkv", "stage1", "stage2", "streaming"])
def test_shared_prefix_decode_equals_generate(name):
    """Prefilling all but a tail once and running the tail per method gives generate()'s tokens."""
    rocket, sdpa = make_models("llama")
    method = build_method(name, compressing_config(prompt_budget=24, topk=3))
    ids = random_ids(1, 60, seed=7)
    if method.config is None:
        reference = greedy(sdpa, ids, max_new_tokens=6)[0, 60:].tolist()
    else:
        reference = greedy(rocket, ids, max_new_tokens=6, cache=method.new_cache())[0, 60:].tolist()
    prefix = decode.shared_prefix(rocket, ids, tail=16)
    assert prefix.split == 44 and len(prefix.kv) == 2
    prefilled = decode.prefill(rocket, method, prefix, max_new_tokens=6)
    if method.config is not None:
        assert prefilled.cache.is_compressed
    tokens, _ = decode.greedy(rocket, prefilled, 60, 6, eos_ids=set())
    assert tokens == reference


def test_teacher_forcing_of_full_method_matches_a_plain_forward():
    _, sdpa = make_models("llama")
    ids = random_ids(1, 40, seed=3)
    prefix = decode.shared_prefix(sdpa, ids[:, :32], tail=8)
    prefilled = decode.prefill(sdpa, build_method("full", compressing_config()), prefix)
    log_probs = torch.stack(list(decode.teacher_forced_log_probs(sdpa, prefilled, 32, ids[0, 32:].tolist())))
    with torch.no_grad():
        sdpa.set_attn_implementation("sdpa")
        expected = torch.log_softmax(sdpa(ids).logits[0, 31:39].float(), dim=-1)
    torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=1e-4)


def test_kept_tokens_and_bytes_helpers():
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config())
    greedy(rocket, random_ids(1, 50), max_new_tokens=2, cache=cache)
    assert decode.kept_tokens_per_layer(cache) == [25.0, 25.0]
    assert decode.cache_bytes(cache) == cache.memory_bytes()
