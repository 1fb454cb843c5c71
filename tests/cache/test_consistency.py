"""cache/consistency.py: a forward whose batch differs from the rows a RocketKVCache holds is refused with a
ValueError naming both sizes, before anything is written, so the cache stays usable with the right batch.

Before the check, a manual decode forward with batch 3 on a cache prefilled with batch 2 raised a raw indexing
``RuntimeError`` from the page append, and batch 1 broadcast its one token into both rows before failing in stage 2.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache
from tests.support.tiny_models import (
    compressing_config,
    keep_all_config,
    make_models,
    random_ids,
)
from hf_rocketkv.integration.compat import cache_kwargs

PROMPT = 40


@pytest.fixture(scope="module")
def rocket():
    return make_models("llama")[0]


def forward(model, cache, ids, position):
    positions = torch.arange(position, position + ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, **cache_kwargs(cache), use_cache=True, position_ids=positions).logits


def prefilled(model, config, batch=2):
    cache = RocketKVCache(config)
    forward(model, cache, random_ids(batch, PROMPT, seed=7), 0)
    return cache


def state(cache):
    """What a refused forward must leave untouched: logical length, stored tokens and kept positions per layer."""
    return [(cache.get_seq_length(), layer.kept_tokens().clone(), layer.positions.clone()) for layer in cache.layers]


def assert_same_state(before, after):
    assert len(before) == len(after)
    for (seen_a, kept_a, pos_a), (seen_b, kept_b, pos_b) in zip(before, after):
        assert seen_a == seen_b and torch.equal(kept_a, kept_b) and torch.equal(pos_a, pos_b)


CONFIGS = {
    "compressed": lambda: compressing_config(prompt_budget=24, window_size=8, kernel_size=5),
    "keep_all": keep_all_config,
}


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("wrong_batch", [1, 3])
@pytest.mark.parametrize("new_tokens", [1, 3], ids=["decode", "later_turn"])
def test_batch_mismatch_is_a_clear_value_error_and_the_cache_stays_usable(rocket, config_name, wrong_batch,
                                                                          new_tokens):
    config = CONFIGS[config_name]()
    cache = prefilled(rocket, config)
    assert cache.is_compressed
    before = state(cache)
    with pytest.raises(ValueError, match=rf"holds 2 row\(s\) \(batch size 2\) but this forward's input has batch "
                                         rf"size {wrong_batch}"):
        forward(rocket, cache, random_ids(wrong_batch, new_tokens, seed=9), PROMPT)
    assert_same_state(before, state(cache))

    # the same cache then decodes its two rows exactly as a cache that never saw the refused forward
    untouched = prefilled(rocket, config)
    step = random_ids(2, new_tokens, seed=11)
    got = forward(rocket, cache, step, PROMPT)
    expected = forward(rocket, untouched, step, PROMPT)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert cache.get_seq_length() == untouched.get_seq_length() == PROMPT + new_tokens


def chunked(model, ids, wrong_batch=None):
    """A prompt fed in two chunks with deferred compression (the dense store until ``finish_prefill``); with
    ``wrong_batch`` a refused second chunk of that batch comes in between."""
    cache = RocketKVCache(compressing_config(prompt_budget=24, window_size=8, kernel_size=5))
    cache.hints.defer_compression = True
    forward(model, cache, ids[:, :20], 0)
    assert not cache.is_compressed
    if wrong_batch is not None:
        with pytest.raises(ValueError, match=rf"holds 2 row\(s\).*batch size {wrong_batch}"):
            forward(model, cache, random_ids(wrong_batch, PROMPT - 20, seed=5), 20)
    forward(model, cache, ids[:, 20:], 20)
    cache.finish_prefill()
    assert cache.is_compressed
    return cache


@pytest.mark.parametrize("wrong_batch", [1, 3])
def test_batch_mismatch_during_a_chunked_prefill(rocket, wrong_batch):
    """A second prefill chunk (the dense store, before stage 1) with another batch is refused; the right chunk then
    gives exactly the kept tokens of a prefill that never saw it."""
    ids = random_ids(2, PROMPT, seed=7)
    cache, reference = chunked(rocket, ids, wrong_batch), chunked(rocket, ids)
    assert_same_state(state(reference), state(cache))
