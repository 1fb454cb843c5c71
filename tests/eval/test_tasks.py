"""Eval tasks (eval/tasks/): the synthetic generators (deterministic by seed, prompts of the target length holding
their answers, needles at their depths), the LongBench and RULER JSONL loaders, and the token positions of a span
with what a cache kept of them.

Tiny random models on CPU; the only file read is the SmolLM2 GGUF tokenizer (session fixture).
"""

from __future__ import annotations

import json

import pytest

from hf_rocketkv import RocketKVCache
from hf_rocketkv.eval import decode
from hf_rocketkv.eval.settings import EvalSettings
from hf_rocketkv.eval.tasks import TASKS, get_task
from hf_rocketkv.eval.tasks.base import encode_prompt, fill_paragraphs, insert_at_depths, span_token_positions
from tests.support.tiny_models import compressing_config, greedy, make_models, random_ids

SYNTHETIC = ["passkey", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words"]


def small_settings(**overrides) -> EvalSettings:
    kwargs = dict(lengths=[300], depths=[0.25, 0.75], samples=1, seed=0, fidelity_context=64, fidelity_positions=8)
    kwargs.update(overrides)
    return EvalSettings(**kwargs)


# ------------------------------------------------------------------------------------------------ generators
@pytest.mark.parametrize("name", SYNTHETIC + ["fidelity"])
def test_generators_are_deterministic_by_seed(name, smollm2_tokenizer):
    task = get_task(name)
    a = task.build(smollm2_tokenizer, small_settings(seed=3))
    b = task.build(smollm2_tokenizer, small_settings(seed=3))
    c = task.build(smollm2_tokenizer, small_settings(seed=4))
    assert a == b
    assert a != c
    expected = 1 if name == "fidelity" else (2 if task.uses_depth else 1)
    assert len(a) == expected


@pytest.mark.parametrize("name", SYNTHETIC)
def test_prompts_hit_the_target_length_and_hold_the_answers(name, smollm2_tokenizer):
    settings = small_settings(lengths=[600])
    for sample in get_task(name).build(smollm2_tokenizer, settings):
        ids = encode_prompt(smollm2_tokenizer, sample.prompt, True, sample.answer_prefix)
        assert 0.85 * 600 <= len(ids) <= 1.05 * 600, len(ids)
        if name != "common_words":  # cwe answers are words of the list, the others are quoted in the context
            for answer in sample.answers:
                assert answer in sample.prompt
        assert sample.max_new_tokens >= 8


def test_passkey_needle_sits_at_its_depth(smollm2_tokenizer):
    shallow, deep = get_task("passkey").build(smollm2_tokenizer, small_settings(lengths=[800]))
    for sample in (shallow, deep):
        assert f"The pass key is {sample.answers[0]}. Remember it." in sample.prompt
        assert sample.prompt.endswith("What is the pass key? Answer with the number only.")
    position = lambda s: s.prompt.index("The pass key is") / len(s.prompt)  # noqa: E731
    assert position(shallow) < 0.5 < position(deep)


def test_multikey_has_distractors_and_asks_for_one_key(smollm2_tokenizer):
    sample, _ = get_task("niah_multikey").build(smollm2_tokenizer, small_settings())
    assert sample.prompt.count("One of the special magic numbers for") == 4
    assert all(v in sample.prompt for v in sample.meta["distractors"])
    assert sample.answers[0] not in sample.meta["distractors"]


def test_variable_chain_and_common_word_counts(smollm2_tokenizer):
    (vt,) = get_task("variable_tracking").build(smollm2_tokenizer, small_settings())
    first, *rest = vt.answers
    assert f"VAR {first} = " in vt.prompt
    for previous, name in zip(vt.answers, rest):
        assert f"VAR {name} = VAR {previous}." in vt.prompt
    (cwe,) = get_task("common_words").build(smollm2_tokenizer, small_settings(lengths=[800]))
    words = cwe.prompt.split("\n")[1].split()  # "1. word 2. word ..."
    assert [words.count(w) for w in cwe.answers] == [cwe.meta["common_freq"]] * len(cwe.answers)
    rare = [w for w in set(words[1::2]) if w not in cwe.answers]
    assert rare and all(words.count(w) == cwe.meta["rare_freq"] for w in rare)


def test_fill_and_insert_helpers(smollm2_tokenizer):
    paragraphs = fill_paragraphs(smollm2_tokenizer, 400, seed=1)
    assert paragraphs == fill_paragraphs(smollm2_tokenizer, 400, seed=1)
    n = sum(len(smollm2_tokenizer(p, add_special_tokens=False).input_ids) + 1 for p in paragraphs)
    assert 300 <= n <= 410
    out = insert_at_depths(["a", "b", "c", "d"], [(0.0, "X"), (1.0, "Y"), (0.5, "Z")])
    assert out == ["X", "a", "b", "Z", "c", "d", "Y"]


def test_fidelity_sample_is_a_text_continuation(smollm2_tokenizer):
    (sample,) = get_task("fidelity").build(smollm2_tokenizer, small_settings())
    assert len(sample.context_ids) == 64 and len(sample.continuation_ids) == 8


def test_unknown_task_names_are_rejected():
    with pytest.raises(ValueError, match="unknown task 'needle'"):
        get_task("needle")
    with pytest.raises(ValueError, match="needs a file"):
        get_task("longbench")
    assert set(SYNTHETIC) | {"fidelity"} == set(TASKS)


# ------------------------------------------------------------------------------------------------ loaders
def test_longbench_loader(tmp_path, smollm2_tokenizer):
    path = tmp_path / "qasper.jsonl"
    rows = [
        {
            "context": "Alice lives in Paris. " * 400,
            "input": "Where does Alice live?",
            "answers": ["Paris"],
            "_id": "a1",
            "dataset": "qasper",
        },
        {"context": "Bob is 7.", "input": "How old is Bob?", "answers": "7", "_id": "b2"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = get_task(f"longbench:{path}")
    assert task.name == "longbench:qasper"
    samples = task.build(smollm2_tokenizer, small_settings(lengths=[256], samples=0))
    assert [s.answers for s in samples] == [["Paris"], ["7"]]
    assert samples[0].metrics == ("substring", "qa_f1")
    assert len(encode_prompt(smollm2_tokenizer, samples[0].prompt, True)) <= 270  # middle-truncated
    assert samples[0].prompt.rstrip().endswith("Question: Where does Alice live?")
    assert len(task.build(smollm2_tokenizer, small_settings(samples=1))) == 1
    path.write_text(json.dumps({"context": "x", "answers": ["y"]}) + "\n")
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['input'\]"):
        task.build(smollm2_tokenizer, small_settings())


def test_ruler_loader(tmp_path, smollm2_tokenizer):
    path = tmp_path / "qa_1.jsonl"
    path.write_text(
        json.dumps({"index": 5, "input": "ctx. Q?", "outputs": ["a", "b"], "length": 4096, "answer_prefix": " Answer:"})
        + "\n"
    )
    (sample,) = get_task(f"ruler:{path}").build(smollm2_tokenizer, small_settings())
    assert (sample.index, sample.answers, sample.metrics, sample.answer_prefix) == (
        5,
        ["a", "b"],
        ("string_match_part",),
        "Answer:",
    )
    path2 = tmp_path / "niah_multikey_1.jsonl"
    path2.write_text(json.dumps({"input": "ctx", "outputs": ["123"]}) + "\n")
    (sample2,) = get_task(f"ruler:{path2}").build(smollm2_tokenizer, small_settings())
    assert sample2.metrics == ("string_match_all",)
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        get_task(f"ruler:{tmp_path / 'bad.jsonl'}").build(smollm2_tokenizer, small_settings())


# ------------------------------------------------------------------------------------------------ spans


def test_span_positions_and_retention(smollm2_tokenizer):
    (sample,) = get_task("passkey").build(smollm2_tokenizer, small_settings(depths=[0.5]))
    ids = encode_prompt(smollm2_tokenizer, sample.prompt, True)
    positions = span_token_positions(smollm2_tokenizer, sample.prompt, True, "", sample.meta["key"])
    assert positions and smollm2_tokenizer.decode([ids[p] for p in positions]).strip() == sample.meta["key"]
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config(prompt_budget=16))
    greedy(rocket, random_ids(1, 40), max_new_tokens=2, cache=cache)
    assert decode.retention(cache, [36, 37, 38]) == {"kept": 1.0, "whole": 1.0}  # the window is always kept
    partly = decode.retention(cache, list(range(0, 30)))
    assert partly["whole"] == 0.0 and 0.0 < partly["kept"] < 1.0
    assert decode.retention(cache, []) is None
