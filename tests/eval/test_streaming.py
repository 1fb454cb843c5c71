"""The streaming baseline's cache (eval/streaming.py): attention sinks plus the most recent tokens, through generate()
on a tiny random Llama; the kept positions are worked out from the prompt length."""

from __future__ import annotations

from hf_rocketkv.eval.methods import ALL_PAGES
from hf_rocketkv.eval.streaming import StreamingCache
from tests.support.tiny_models import compressing_config, greedy, make_models, random_ids


def test_streaming_cache_keeps_sinks_and_recent_tokens():
    rocket, _ = make_models("llama")
    config = compressing_config(prompt_budget=16, topk=ALL_PAGES)
    cache = StreamingCache(config, sink_tokens=4)
    ids = random_ids(1, 40)
    greedy(rocket, ids, max_new_tokens=3, cache=cache)
    for layer in range(len(cache.layers)):
        kept = cache.kept_positions(layer)[0, :, :16]
        assert kept.tolist() == [[0, 1, 2, 3] + list(range(28, 40))] * kept.shape[0]
        assert cache.kept_tokens(layer).tolist() == [[18] * kept.shape[0]]  # 16 kept + 2 generated fed back
