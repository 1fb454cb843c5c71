"""Edges of the public API that a transformers user reaches and the other tests do not: each case must give the
right answer (checked against an independent path: transformers' own attention and DynamicCache, or the prompt alone
through model.generate) or a clear error naming what was wrong, never an exception from deep inside the package or a
silently different result.

- ``copy.deepcopy`` of a filled ``RocketKVCache``: transformers' documented prompt re-use pattern (prefill a shared
  prefix once, ``copy.deepcopy`` the cache for each question, ``generate`` on the copy).
- ``generate_batch`` given one prompt where a list of prompts is expected (a string, a 1-D tensor of ids), and a
  ``sampling`` of the wrong type.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_rocketkv import RocketKVCache, generate_batch
from hf_rocketkv.serving import SamplingParams
from tests.support.tiny_models import (
    PAD,
    char_tokenizer,
    compressing_config,
    cpu_pool,
    keep_all_config,
    make_models,
    random_ids,
)


def greedy(model, ids, cache, new_tokens):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)


def forward(model, ids, cache):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(ids, past_key_values=cache).logits


# ------------------------------------------------------------------------------------------ copy.deepcopy(cache)
def test_deepcopy_of_a_prefilled_prefix_then_generate_like_dynamic_cache(llama_pair):
    """transformers' prompt re-use recipe: prefill the prefix with a forward, deep-copy the cache, generate the
    prefix + question on the copy, twice from the same prefix. Nothing is evicted (keep_all_config), so the tokens
    are DynamicCache's."""
    rocket, sdpa = llama_pair
    prefix = random_ids(1, 20, seed=3)
    dense, cache = DynamicCache(), RocketKVCache(keep_all_config())
    forward(sdpa, prefix, dense)
    forward(rocket, prefix, cache)
    for seed in (4, 5):
        full = torch.cat([prefix, random_ids(1, 6, seed=seed)], 1)
        expected = greedy(sdpa, full, copy.deepcopy(dense), 5)
        assert torch.equal(greedy(rocket, full, copy.deepcopy(cache), 5), expected)


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("mistral", {"sliding_window": 16})],
                         ids=["llama", "mistral_window"])
@pytest.mark.parametrize("make_config", [keep_all_config, compressing_config], ids=["nothing_evicted", "compressed"])
def test_decode_steps_on_a_deepcopy_equal_those_on_an_uncopied_twin(arch, overrides, make_config):
    """Two caches filled by the same generate(); one is deep-copied. Decode steps on the copy give the logits of the
    same steps on the untouched twin, and the original then still gives them too (the copy shares nothing)."""
    rocket, _ = make_models(arch, **overrides)
    ids = random_ids(1, 40, seed=3)
    cache, twin = RocketKVCache(make_config()), RocketKVCache(make_config())
    out = greedy(rocket, ids, cache, 3)
    assert torch.equal(greedy(rocket, ids, twin, 3), out)
    copied = copy.deepcopy(cache)
    last = out[:, -1:]
    expected = torch.cat([forward(rocket, last, twin), forward(rocket, last, twin)], 1)
    assert torch.equal(torch.cat([forward(rocket, last, copied), forward(rocket, last, copied)], 1), expected)
    assert torch.equal(torch.cat([forward(rocket, last, cache), forward(rocket, last, cache)], 1), expected)


def test_deepcopy_of_a_pool_backed_cache_is_refused_naming_the_pool(llama_pair):
    rocket, _ = llama_pair
    config = compressing_config()
    cache = RocketKVCache(config, pool=cpu_pool(rocket, config))
    greedy(rocket, random_ids(1, 40, seed=3), cache, 2)
    with pytest.raises(TypeError, match=r"copy\.deepcopy\(RocketKVCache\(pool=\.\.\.\)\).*KVBlockPool"):
        copy.deepcopy(cache)


# ------------------------------------------------------------------------------------------ generate_batch
@pytest.fixture(scope="module")
def served():
    return make_models("llama", seed=0)[0]


def test_generate_batch_given_one_string_names_the_prompts(served):
    """``prompts`` is a list; a bare string is refused naming the field (not len(string) one-character requests)."""
    with pytest.raises(TypeError, match=r"prompts must be a list .* got a single str: pass \[prompt\]"):
        generate_batch(served, "hello", config=compressing_config(), sampling=SamplingParams.greedy(3),
                       tokenizer=char_tokenizer())


def test_generate_batch_given_a_1d_tensor_names_the_prompts_and_a_2d_tensor_runs_each_row(served):
    """A 1-D tensor of ids is refused naming ``prompts`` (not ``'int' object is not iterable``); a 2-D tensor is one
    prompt per row, each with the tokens model.generate gives it alone."""
    prompts = random_ids(2, 30, seed=5)
    config = compressing_config()
    sampling = SamplingParams.greedy(3, ignore_eos=True)
    with pytest.raises(TypeError, match=r"prompts must be a list .* got a 1-D tensor"):
        generate_batch(served, prompts[0], config=config, sampling=sampling)
    results = generate_batch(served, prompts, config=config, sampling=sampling)
    for row, result in zip(prompts, results):
        alone = greedy(served, row[None], RocketKVCache(config), 3)[0, len(row):].tolist()
        assert list(result.token_ids) == alone


@pytest.mark.parametrize("sampling", [{"max_tokens": 2}, [{"max_tokens": 2}], "greedy"])
def test_generate_batch_with_sampling_of_another_type_names_it(served, sampling):
    """``sampling`` takes a SamplingParams or a list of them; anything else is refused naming ``sampling`` and what
    it got (not 'got str', the dict's keys)."""
    with pytest.raises(TypeError, match=r"sampling must be a SamplingParams .* got (dict|a list of dict|str)$"):
        generate_batch(served, [[5, 6, 7]], config=compressing_config(), sampling=sampling)


def test_a_single_id_tensor_as_a_prompt_is_an_invalid_request(served):
    """GenerationManager.add_request with a 0-d tensor (one id, not a prompt): InvalidRequest naming the prompt."""
    from hf_rocketkv.serving import GenerationManager, InvalidRequest

    manager = GenerationManager(served, config=compressing_config())
    try:
        with pytest.raises(InvalidRequest, match="prompt must be a string or a list of token ids, got a single id"):
            manager.add_request(torch.tensor(5), SamplingParams.greedy(2))
    finally:
        manager.stop()
