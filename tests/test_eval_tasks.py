"""Eval harness: task generators (deterministic by seed), scoring, JSONL loaders, methods, streaming baseline,
prefix sharing (same answers as model.generate), YAML settings errors, reports and heat maps.

Tiny random models on CPU; the only file read is the SmolLM2 GGUF tokenizer (session fixture).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.eval import decode
from hf_rocketkv.eval.methods import ALL_PAGES, KEEP_ALL, build_method, build_methods
from hf_rocketkv.eval.plot import compression_plot, fidelity_points
from hf_rocketkv.eval.report import heatmap, markdown, summarize, write_report
from hf_rocketkv.eval.scoring import qa_f1, score, string_match_all, string_match_part, substring
from hf_rocketkv.eval.settings import EvalSettings, run_config_from_dict
from hf_rocketkv.eval.streaming import StreamingCache
from hf_rocketkv.eval.tasks import TASKS, get_task
from hf_rocketkv.eval.tasks.base import encode_prompt, fill_paragraphs, insert_at_depths, span_token_positions
from hf_rocketkv.policies import KeepFirst, KnormPolicy

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


# ------------------------------------------------------------------------------------------------ scoring
def test_scoring_functions():
    assert substring("The pass key is 12345.", ["12345"]) == 1.0
    assert substring("The pass key is 1234.", ["12345"]) == 0.0
    assert substring("ANSWER: Paris", ["paris"]) == 1.0
    assert string_match_part("x 7 y", ["7", "8"]) == 1.0
    assert string_match_all("AAA and CCC", ["AAA", "BBB", "CCC", "DDD"]) == 0.5
    assert string_match_all("anything", []) == 0.0
    assert qa_f1("the big red fox", ["a red fox"]) == pytest.approx(0.8)
    assert qa_f1("nothing", ["red fox"]) == 0.0
    assert score("string_match_all", "a b", ["a", "c"]) == 0.5
    with pytest.raises(ValueError, match="unknown metric"):
        score("bleu", "a", ["a"])


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


# ------------------------------------------------------------------------------------------------ methods
def test_method_budgets():
    base = compressing_config(prompt_budget=64, topk=4, page_size=4, window_size=8)
    methods = {
        m.name: m
        for m in build_methods(
            list(("full", "rocketkv", "stage1", "stage2", "streaming", "stage1_read", "streaming_read")), base
        )
    }
    assert methods["full"].config is None and methods["full"].attn_implementation == "sdpa"
    assert methods["rocketkv"].config == base
    assert (methods["rocketkv"].kept_budget, methods["rocketkv"].read_budget) == (64, 16)
    assert methods["stage1"].config.topk == ALL_PAGES and methods["stage1"].config.prompt_budget == 64
    assert methods["stage2"].config.prompt_budget == KEEP_ALL and methods["stage2"].config.topk == 4
    assert methods["stage1_read"].config.prompt_budget == 16 and methods["streaming_read"].streaming
    assert build_method("stage1_read", base.replace(topk=1)).config.prompt_budget == 8  # raised to window_size
    assert methods["streaming"].new_cache().config.stage1 == "streaming" and not methods["stage1"].streaming
    with pytest.raises(ValueError, match="unknown method 'h2o'"):
        build_method("h2o", base)
    with pytest.raises(ValueError, match="listed twice"):
        build_methods(["full", "full"], base)


def test_policy_methods_budgets_and_options():
    """KIND:POLICY methods: evict (B kept, all read), evict_read (K*P kept), rocketkv with and without the stage-2
    options; forced sinks reach stage 1 through the cache layer (labelled +keep_first=s), not the baselines that read
    every kept page; names are checked."""
    base = compressing_config(prompt_budget=64, topk=8, page_size=4, window_size=8, stage2_sink_tokens=4,
                              stage2_recent_tokens=12)
    methods = {m.name: m for m in build_methods(
        ["evict:knorm", "evict_read:h2o", "rocketkv:random", "rocketkv_plain:snapkv", "rocketkv", "rocketkv_plain",
         "stage2", "stage2_plain", "stage1", "streaming_read"], base)}
    evict = methods["evict:knorm"]
    assert evict.config.stage2 == "none" and evict.config.stage1 == "knorm" and evict.config.stage2_sink_tokens == 0
    assert (evict.kept_budget, evict.read_budget, evict.read_tokens(100)) == (64, None, 100)
    assert methods["evict_read:h2o"].config.prompt_budget == 32 and methods["evict_read:h2o"].needs_full_prefill
    rocket = methods["rocketkv:random"]
    assert rocket.config.stage1 == "random" and rocket.config.stage1_keep_first == 4  # the layer wraps it
    assert rocket.config.stage2_forced_pages == (1, 4) and (rocket.kept_budget, rocket.read_budget) == (64, 32)
    assert rocket.describe()["config"]["stage1"] == "random+keep_first=4" and rocket.read_tokens(20) == 20
    json.dumps([m.describe() for m in methods.values()])  # results.json stays JSON
    plain = methods["rocketkv_plain:snapkv"]
    assert plain.config.stage1 == "snapkv" and plain.config.stage2_forced_pages == (0, 1)
    assert methods["rocketkv"].config.stage1 == "snapkv" and methods["rocketkv_plain"].name == "rocketkv_plain"
    assert methods["rocketkv"].describe()["config"]["stage1"] == "snapkv+keep_first=4"
    for name in ("stage1", "streaming_read"):  # every kept page read: no forced pages, so no stage-1 sinks either
        assert methods[name].config.stage1_keep_first == 0 and methods[name].config.stage2_recent_tokens == 0
    assert methods["stage1"].describe()["config"]["stage1"] == "snapkv"
    # a KeepFirst object keeps its label; the layer forces the larger of its count and the config's sinks
    wrapped = build_method("rocketkv", base.replace(stage1=KeepFirst(KnormPolicy(), 6)))
    assert wrapped.describe()["config"]["stage1"] == "knorm+keep_first=6"
    assert methods["stage2_plain"].config.stage2_recent_tokens == 0 and methods["stage2"].kept_budget is None
    with pytest.raises(ValueError, match="unknown stage-1 policy 'tova' in method 'evict:tova'"):
        build_method("evict:tova", base)
    with pytest.raises(ValueError, match=r"KIND:POLICY takes KIND in \['evict', 'evict_read'"):
        build_method("stage1:knorm", base)


def test_method_overrides_after_at():
    base = compressing_config(prompt_budget=64, topk=8, page_size=4, window_size=8)
    method = build_method("rocketkv@prompt_budget=32,topk=4,stage2_recent_tokens=4", base)
    assert method.name == "rocketkv@prompt_budget=32,topk=4,stage2_recent_tokens=4"
    assert (method.kept_budget, method.read_budget, method.config.stage2_forced_pages) == (32, 16, (0, 2))
    assert build_method("evict:knorm@stage2=none", base).config.stage1 == "knorm"
    with pytest.raises(ValueError, match="method 'rocketkv@topk': expected FIELD=VALUE"):
        build_method("rocketkv@topk", base)
    with pytest.raises(ValueError, match="method 'rocketkv@tpk=3': unknown key.*did you mean 'topk'"):
        build_method("rocketkv@tpk=3", base)
    with pytest.raises(ValueError, match="forced stage-2 pages must fit in topk=8"):
        build_method("rocketkv@stage2_recent_tokens=64", base)


def test_h2o_method_prefills_the_whole_prompt():
    """H2O scores with every prompt query, so its method runs the whole prompt itself (no shared dense prefix) and
    keeps what the same policy keeps in model.generate."""
    rocket, _ = make_models("llama")
    ids = random_ids(1, 48, seed=5)
    method = build_method("evict:h2o", compressing_config(prompt_budget=24, topk=3))
    prefix = decode.shared_prefix(rocket, ids, 8)
    prefilled = decode.prefill(rocket, method, prefix)
    reference = RocketKVCache(method.config)
    greedy(rocket, ids, 1, past_key_values=reference)
    for layer in range(len(reference.layers)):
        # the kept positions, without the empty slots (-1) each cache reserved for its own decode steps
        assert torch.equal(_filled(prefilled.cache.kept_positions(layer)), _filled(reference.kept_positions(layer)))


def _filled(positions: torch.Tensor) -> torch.Tensor:
    """``positions`` [B, Hkv, C] without its trailing all-empty (-1) slots."""
    used = int((positions >= 0).any(dim=(0, 1)).nonzero().max()) + 1
    return positions[..., :used]


def test_compression_plot(tmp_path):
    runs = []
    for read, top1 in ((64, 0.8), (128, 0.9)):
        results = _fake_results()
        results["fidelity"] = [dict(results["fidelity"][0], read_tokens_mean=float(read), top1_agreement=top1),
                               dict(results["fidelity"][0], method="full", read_tokens_mean=2100.0, top1_agreement=1.0)]
        runs.append(results)
    assert fidelity_points(runs)["rocketkv"] == [(64.0, pytest.approx(0.8)), (128.0, pytest.approx(0.9))]
    png = compression_plot(runs, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_streaming_cache_keeps_sinks_and_recent_tokens():
    rocket, _ = make_models("llama")
    config = compressing_config(prompt_budget=16, topk=ALL_PAGES)
    cache = StreamingCache(config, sink_tokens=4)
    ids = random_ids(1, 40)
    greedy(rocket, ids, max_new_tokens=3, past_key_values=cache)
    for layer in range(len(cache.layers)):
        kept = cache.kept_positions(layer)[0, :, :16]
        assert kept.tolist() == [[0, 1, 2, 3] + list(range(28, 40))] * kept.shape[0]
        assert cache.kept_tokens(layer).tolist() == [[18] * kept.shape[0]]  # 16 kept + 2 generated fed back


# ------------------------------------------------------------------------------------------------ prefix sharing
@pytest.mark.parametrize("name", ["full", "rocketkv", "stage1", "stage2", "streaming"])
def test_shared_prefix_decode_equals_generate(name):
    """Prefilling all but a tail once and running the tail per method gives generate()'s tokens."""
    rocket, sdpa = make_models("llama")
    method = build_method(name, compressing_config(prompt_budget=24, topk=3))
    ids = random_ids(1, 60, seed=7)
    if method.config is None:
        reference = greedy(sdpa, ids, max_new_tokens=6)[0, 60:].tolist()
    else:
        reference = greedy(rocket, ids, max_new_tokens=6, past_key_values=method.new_cache())[0, 60:].tolist()
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
    greedy(rocket, random_ids(1, 50), max_new_tokens=2, past_key_values=cache)
    assert decode.kept_tokens_per_layer(cache) == [25.0, 25.0]
    assert decode.cache_bytes(cache) == cache.memory_bytes()


# ------------------------------------------------------------------------------------------------ settings
def test_yaml_settings_errors_name_the_key():
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['evaluation'\]"):
        run_config_from_dict({"evaluation": {}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lenghts'\] in 'eval'"):
        run_config_from_dict({"eval": {"lenghts": [1024]}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['top_k'\]"):
        run_config_from_dict({"sparse_attention_config": {"algorithm": "rocket", "top_k": 3}})
    with pytest.raises(ValueError, match="eval.depths must be"):
        run_config_from_dict({"eval": {"depths": [1.5]}})
    with pytest.raises(ValueError, match="eval.samples must be"):
        run_config_from_dict({"eval": {"samples": "two"}})
    run = run_config_from_dict(
        {"sparse_attention_config": {"prompt_budget": 256, "topk": 16}, "eval": {"tasks": "passkey"}}
    )
    assert run.rocket.prompt_budget == 256 and run.eval.tasks == ["passkey"]
    assert run.eval.replace(samples=None, seed=5).seed == 5


# ------------------------------------------------------------------------------------------------ report
def _fake_results():
    methods = [
        {"name": n, "kept_budget": k, "read_budget": r, "attn_implementation": "x", "config": None}
        for n, k, r in (("full", None, None), ("rocketkv", 256, 64))
    ]
    records = []
    for method, base in (("full", 1.0), ("rocketkv", 0.5)):
        for length in (1024, 2048):
            for depth in (0.1, 0.9):
                records.append(
                    {
                        "task": "passkey",
                        "method": method,
                        "length": length,
                        "depth": depth,
                        "score": base if depth == 0.9 else 1.0,
                        "kept_tokens_mean": 256.0,
                        "method_prefill_s": 0.1,
                        "decode_s_per_token": 0.01,
                    }
                )
    fidelity = [
        {
            "method": "rocketkv",
            "top1_agreement": 0.9,
            "mean_kl": 0.1,
            "next_token_accuracy": 0.4,
            "positions": 10,
            "kept_tokens_mean": 256.0,
            "read_tokens_mean": 64.0,
        }
    ]
    return {
        "model": "m",
        "config": {"prompt_budget": 256},
        "methods": methods,
        "records": records,
        "fidelity": fidelity,
    }


def test_summary_markdown_and_heatmap(tmp_path):
    results = _fake_results()
    s = summarize(results)
    assert s["tasks"]["passkey"]["rocketkv"] == {"score": 0.75, "n": 4}
    assert s["grid"]["passkey"]["rocketkv"]["2048|0.9"] == 0.5
    text = markdown(results)
    assert "| rocketkv | 256 | 64 | 75.0 (n=4) |" in text
    assert "| rocketkv | 256 | 64 | 64 | 90.0 | 0.1000 | 40.0 | 10 |" in text
    png = heatmap(results, "passkey", tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = write_report(results, tmp_path)
    assert {p.name for p in written} == {"results.md", "heatmap_passkey.png"}


def test_span_positions_and_retention(smollm2_tokenizer):
    (sample,) = get_task("passkey").build(smollm2_tokenizer, small_settings(depths=[0.5]))
    ids = encode_prompt(smollm2_tokenizer, sample.prompt, True)
    positions = span_token_positions(smollm2_tokenizer, sample.prompt, True, "", sample.meta["key"])
    assert positions and smollm2_tokenizer.decode([ids[p] for p in positions]).strip() == sample.meta["key"]
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config(prompt_budget=16))
    greedy(rocket, random_ids(1, 40), max_new_tokens=2, past_key_values=cache)
    assert decode.retention(cache, [36, 37, 38]) == {"kept": 1.0, "whole": 1.0}  # the window is always kept
    partly = decode.retention(cache, list(range(0, 30)))
    assert partly["whole"] == 0.0 and 0.0 < partly["kept"] < 1.0
    assert decode.retention(cache, []) is None
