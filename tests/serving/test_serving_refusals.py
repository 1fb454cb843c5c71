"""Serving-side audit fixes of commit e7fc374, each checked against an oracle that does not run the fixed code path:

* BatchingEngine / generate_batch refuse ``decode_budget`` and ``token_budget`` up front (NotImplementedError naming
  the field); the sequential engine still runs decode_budget, token for token what model.generate gives alone.
* ``hf-rocketkv serve``: invalid YAML -> one line with line/column, exit 2; an unknown top-level key beside
  ``sparse_attention_config`` -> exit 2 naming it; a config the engine refuses (keep_all / decode_budget with a pool)
  -> exit 2, 1-3 lines, no traceback.
* ``create_app(..., aliases=(path,))``: the alias is accepted as the request's model; ``GET /v1/models/{id}``.
* ``eval`` builds ``KIND:adakv`` methods (refused in session 14, run by the cache since session 15).
* ``generate_batch`` maps a GenerationConfig's ``eos_token_id`` and ``stop_strings``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_rocketkv import KVBlockPool
from hf_rocketkv.serving import SamplingParams, generate_batch
from hf_rocketkv.serving.batching import BatchingEngine
from tests.support.tiny_models import EOS, compressing_config, make_models, random_ids
from tests.serving.conftest import oracle_tokens
from tests.serving.helpers import char_tokenizer


def small_pool(model, config):
    return KVBlockPool(model, max_gpu_bytes=1 << 20, page_size=8, dtype=torch.float32, device="cpu",
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)


# ------------------------------------------------------------------------------------------------ fix 1: batching
@pytest.mark.parametrize("fields, name", [(dict(decode_budget=16, decode_interval=8, decode_window=4), "decode_budget"),
                                          (dict(token_budget=64), "token_budget")])
def test_batching_engine_refuses_unsupported_budget_fields_at_construction(tiny_pair, fields, name):
    config = compressing_config(**fields)
    with pytest.raises(NotImplementedError) as err:
        BatchingEngine(tiny_pair[0], config, small_pool(tiny_pair[0], config))
    assert name in str(err.value)


def test_generate_batch_with_pool_raises_on_decode_budget_and_sequential_runs_it(tiny_pair):
    model, oracle = tiny_pair
    config = compressing_config(decode_budget=16, decode_interval=8, decode_window=4)
    prompts = [random_ids(1, 40, seed=s)[0].tolist() for s in (31, 32)]
    gen = GenerationConfig(max_new_tokens=30, do_sample=False)
    with pytest.raises(NotImplementedError, match="decode_budget"):  # before: rows with finish_reason "error"
        generate_batch(model, prompts, gen, config, pool=small_pool(model, config))
    # the sequential engine runs decode-time compression: the same tokens as model.generate on each prompt alone
    results = generate_batch(model, prompts, config=config, engine="sequential",
                             sampling=SamplingParams.greedy(30, ignore_eos=True))
    expected = [oracle_tokens(oracle, p, config, 30) for p in prompts]
    assert [list(r.token_ids) for r in results] == expected
    # the budget really compresses in these 30 tokens (else the comparison would not exercise it)
    assert expected != [oracle_tokens(oracle, p, compressing_config(), 30) for p in prompts]


# ------------------------------------------------------------------------------------------------ fix 2: serve CLI
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved tiny random Llama with the character tokenizer (as test_serve_cli's end-to-end test)."""
    folder = tmp_path_factory.mktemp("tiny_serve") / "tiny"
    model, _ = make_models("llama")
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def test_serve_invalid_yaml_is_one_line_with_its_position(tmp_path, capsys):
    from hf_rocketkv.cli.serve import serve_main

    bad = tmp_path / "bad.yaml"
    bad.write_text("sparse_attention_config:\n  topk: 8\n  prompt_budget: [1, 2\n")  # unclosed flow sequence
    import yaml

    try:  # the oracle: PyYAML's own mark for this text (1-based in the message)
        yaml.safe_load(bad.read_text())
    except yaml.YAMLError as err:
        mark = err.problem_mark
    assert serve_main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert "invalid YAML" in lines[0] and f"line {mark.line + 1}" in lines[0] and f"column {mark.column + 1}" in lines[0]


@pytest.fixture
def no_serving(monkeypatch):
    """serve_main never starts uvicorn here: reaching the server (the config was accepted) fails the test at once."""
    from hf_rocketkv.cli import serve as cli

    def refuse(*args, **kwargs):
        raise AssertionError("serve_main accepted the config and started serving")

    monkeypatch.setattr(cli, "_run", refuse)


def test_serve_unknown_top_level_key_beside_the_section_exits_2(tmp_path, capsys, no_serving):
    from hf_rocketkv.cli.serve import serve_main

    extra = tmp_path / "extra.yaml"
    extra.write_text("sparse_attention_config:\n  topk: 8\nsparse_attention_confg:\n  topk: 4\n")
    # a --model that does not exist: the config is refused before any model loads (before: the key was ignored and
    # the default model loaded)
    missing = tmp_path / "nothing-here"
    assert serve_main(["--config", str(extra), "--model", str(missing), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "sparse_attention_confg" in err and 1 <= len(err.strip().splitlines()) <= 3 and "Traceback" not in err


@pytest.mark.parametrize("fields, name", [(dict(multi_turn="keep_all"), "multi_turn"),
                                          (dict(decode_budget=16, decode_interval=8, decode_window=4),
                                           "decode_budget")])
def test_serve_config_refused_by_the_engine_exits_2(tiny_dir, tmp_path, capsys, no_serving, fields, name):
    from hf_rocketkv.cli.serve import serve_main

    config = tmp_path / "c.yaml"
    compressing_config(**fields).to_yaml(config)
    argv = ["--model", str(tiny_dir), "--config", str(config), "--pool-gib", "0.01", "--port", "0",
            "--warmup-max-tokens", "0", "--log-level", "warning"]
    assert serve_main(argv) == 2  # before: the NotImplementedError escaped serve_main (a traceback)
    err = capsys.readouterr().err
    assert name in err and 1 <= len(err.strip().splitlines()) <= 3 and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ fix 3: server ids
def test_model_alias_and_models_by_id(make_manager, tokenizer):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from hf_rocketkv.serving import create_app
    from hf_rocketkv.serving.background import ServerThread

    manager = make_manager(tokenizer=tokenizer)
    alias = "/data/models/org/tiny-llama"  # what --model was: a folder path, slashes included
    with ServerThread(create_app(manager, "tiny", aliases=(alias,))) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        texts = []
        for model in ("tiny", alias):
            out = api.completions.create(model=model, prompt="hello there", max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
            assert out.model == "tiny" and out.usage.completion_tokens == 3
            texts.append(out.choices[0].text)
            assert api.models.retrieve(model).id == "tiny"
            raw = httpx.get(server.url + "/v1/models/" + model, timeout=30)
            assert raw.status_code == 200 and raw.json()["id"] == "tiny" and raw.json()["object"] == "model"
        assert texts[0] == texts[1]  # the same model behind both ids
        with pytest.raises(openai.BadRequestError) as bad:
            api.completions.create(model="tiny-other", prompt="hi", max_tokens=2)
        assert bad.value.status_code == 400 and bad.value.body["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            api.models.retrieve("org/other")
        for unknown in ("other", "org/other", alias + "x"):
            missing = httpx.get(server.url + "/v1/models/" + unknown, timeout=30)
            assert missing.status_code == 404
            error = missing.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"} and error["code"] == "model_not_found"


# ------------------------------------------------------------------------------------------------ fix 4: eval adakv
def test_adakv_methods_build_now_that_the_cache_runs_them():
    """Session 14 refused ``KIND:adakv`` (the cache could not store per-head counts); session 15 runs them."""
    from hf_rocketkv.eval.methods import build_method, build_methods

    base = compressing_config(prompt_budget=64, topk=4, page_size=4, window_size=8)
    for kind in ("rocketkv", "evict", "evict_read", "rocketkv_plain"):
        method = build_method(f"{kind}:adakv", base)
        assert method.config.stage1 == "adakv" and method.config.per_head_budgets
    assert [m.name for m in build_methods(["full", "rocketkv:adakv"], base)] == ["full", "rocketkv:adakv"]


# ------------------------------------------------------------------------------------------------ fix 5: GenerationConfig
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
                              config, pool=small_pool(model, config))
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
