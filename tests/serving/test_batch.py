"""generate_batch (serving/batch.py): many prompts through a manager, results in input order, budgets the batching
engine cannot serve refused up front (the sequential engine runs them), and a transformers GenerationConfig's
length, EOS ids and stop strings followed.

Oracle: model.generate on each prompt alone with a fresh RocketKVCache of the same config (``oracle_tokens``, on a
second copy of the model).
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from hf_rocketkv.serving import InvalidRequest, SamplingParams, generate_batch
from tests.serving.helpers import make_pool, oracle_tokens, prompts
from tests.support.tiny_models import EOS, compressing_config, random_ids


def test_generate_batch_with_pool_raises_on_decode_budget_and_sequential_runs_it(tiny_pair):
    model, oracle = tiny_pair
    config = compressing_config(decode_budget=16, decode_interval=8, decode_window=4)
    prompts = [random_ids(1, 40, seed=s)[0].tolist() for s in (31, 32)]
    gen = GenerationConfig(max_new_tokens=30, do_sample=False)
    with pytest.raises(NotImplementedError, match="decode_budget"):  # up front, not rows ending in "error"
        generate_batch(model, prompts, gen, config, pool=make_pool(model, config=config))
    # the sequential engine runs decode-time compression: the same tokens as model.generate on each prompt alone
    results = generate_batch(model, prompts, config=config, engine="sequential",
                             sampling=SamplingParams.greedy(30, ignore_eos=True))
    expected = [oracle_tokens(oracle, p, config, 30) for p in prompts]
    assert [list(r.token_ids) for r in results] == expected
    # the budget really compresses in these 30 tokens (else the comparison would not exercise it)
    assert expected != [oracle_tokens(oracle, p, compressing_config(), 30) for p in prompts]


def _free_run_with_inner_token(model, config, n):
    """A prompt and the oracle's greedy run (eos off) in which some token X first appears at index k >= 2, with no
    model EOS before it and tokens after it: generate_batch must stop right at X."""
    for seed in range(40, 80):
        prompt = random_ids(1, 30, seed=seed)[0].tolist()
        run = oracle_tokens(model, prompt, config, n)
        for k in range(2, n - 2):
            if run[k] not in run[:k] and EOS not in run[: k + 1]:
                return prompt, run, k
    pytest.fail("no prompt with a usable token")


def test_generate_batch_stops_at_generation_config_eos(tiny_pair):
    model, oracle = tiny_pair
    config = compressing_config()
    prompt, run, k = _free_run_with_inner_token(oracle, config, 16)
    eos = run[k]
    expected = run[: run.index(eos) + 1]  # docs/serving.md: the stop id is the last token
    assert len(expected) < 16
    [single] = generate_batch(model, [prompt], GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=eos),
                              config)
    assert list(single.token_ids) == expected and single.finish_reason == "stop"
    # a list of eos ids: the first one reached ends it; with the pool (batching engine) too
    [listed] = generate_batch(model, [prompt], GenerationConfig(max_new_tokens=16, do_sample=False,
                                                                eos_token_id=[127 if eos != 127 else 126, eos]),
                              config, pool=make_pool(model, config=config))
    other = 127 if eos != 127 else 126
    cut = min(i for i, t in enumerate(run) if t in (eos, other))
    assert list(listed.token_ids) == run[: cut + 1]


def test_generate_batch_stops_at_generation_config_stop_strings(tiny_pair, tokenizer):
    model, oracle = tiny_pair
    config = compressing_config()
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer(prompt).input_ids
    run = oracle_tokens(oracle, ids, config, 24)
    if EOS in run:
        run = run[: run.index(EOS)]
    full = tokenizer.decode(run, skip_special_tokens=True)
    start = next(i for i in range(3, len(full) - 4) if full[i:i + 2] not in full[:i + 1])  # first occurrence at i
    stop = full[start:start + 2]
    assert full.index(stop) == start and len(full) > start + 2
    gen = GenerationConfig(max_new_tokens=24, do_sample=False, stop_strings=stop)
    [result] = generate_batch(model, [prompt], gen, config, tokenizer=tokenizer)
    assert result.text == full[:start] and result.finish_reason == "stop"
    gen_list = GenerationConfig(max_new_tokens=24, do_sample=False, stop_strings=["\x00never", stop])
    [listed] = generate_batch(model, [prompt], gen_list, config, tokenizer=tokenizer)
    assert listed.text == full[:start]


def test_generate_batch_returns_input_order(tiny_pair, cfg, tokenizer):
    batch = prompts(3)
    params = [SamplingParams.greedy(n, ignore_eos=True) for n in (5, 3, 4)]
    results = generate_batch(tiny_pair[0], batch, config=cfg, sampling=params, tokenizer=tokenizer)
    for prompt, n, result in zip(batch, (5, 3, 4), results):
        expected = oracle_tokens(tiny_pair[1], prompt, cfg, n)
        assert list(result.token_ids) == expected
        assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
    text = generate_batch(tiny_pair[0], ["Hello there, how are you today? Fine."], config=cfg, tokenizer=tokenizer,
                          sampling=SamplingParams.greedy(3, ignore_eos=True))
    assert len(text[0].token_ids) == 3
    with pytest.raises(InvalidRequest, match=r"prompts\[1\]"):
        generate_batch(tiny_pair[0], [batch[0], [999]], config=cfg)


def test_generate_batch_follows_generation_config(tiny_pair, cfg):
    batch = prompts(2)
    results = generate_batch(tiny_pair[0], batch, GenerationConfig(max_new_tokens=4, do_sample=False), config=cfg)
    for prompt, result in zip(batch, results):
        assert list(result.token_ids) == oracle_tokens(tiny_pair[1], prompt, cfg, 4, eos_token_id=EOS)


@pytest.mark.parametrize("engine", ["auto", "sequential"])
def test_generate_batch_refuses_a_model_without_rocketkv_attention_up_front(engine):
    """A model on sdpa: one ValueError naming the attention and the fix, before any prompt runs (not N results
    ending in "error"); the same model after hf_rocketkv.enable generates."""
    import hf_rocketkv
    from tests.support.tiny_models import make_models

    _, sdpa = make_models("llama", seed=0)
    config = compressing_config()
    pool = make_pool(sdpa, config=config) if engine == "auto" else None
    prompts = [random_ids(1, 30, seed=s)[0].tolist() for s in (1, 2)]
    with pytest.raises(ValueError, match=r"attn_implementation is 'sdpa'.*hf_rocketkv.enable\(model\)"):
        generate_batch(sdpa, prompts, config=config, pool=pool, engine=engine,
                       sampling=SamplingParams.greedy(3, ignore_eos=True))
    hf_rocketkv.enable(sdpa)
    results = generate_batch(sdpa, prompts, config=config, pool=pool, engine=engine,
                             sampling=SamplingParams.greedy(3, ignore_eos=True))
    assert [len(r.token_ids) for r in results] == [3, 3]


def test_manager_refuses_a_model_without_rocketkv_attention():
    from hf_rocketkv.serving import GenerationManager
    from tests.support.tiny_models import make_models

    _, sdpa = make_models("llama", seed=0)
    with pytest.raises(ValueError, match="model: its attn_implementation is 'sdpa'"):
        GenerationManager(sdpa, None, compressing_config(), engine="sequential")
