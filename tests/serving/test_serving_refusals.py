"""What the serving layer refuses up front, and the served model's ids (fourteenth-session audit fixes).

* BatchingEngine refuses ``decode_budget`` and ``token_budget`` when built (its batched step neither compresses
  during decode nor derives page sizes per request), naming the field, instead of failing every request later; the
  sequential engine still runs decode_budget, token for token what model.generate gives alone.
* ``hf-rocketkv serve``: invalid YAML in one line with its position, unknown top-level keys and a config the engine
  refuses: exit 2, one to three lines, no traceback.
* The server accepts the ``--model`` string as the request's model (an alias) and answers ``/v1/models/{id}``.
* ``generate_batch`` honours the GenerationConfig's ``eos_token_id``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_rocketkv import KVBlockPool
from hf_rocketkv.serving import SamplingParams, generate_batch
from hf_rocketkv.serving.batching import BatchingEngine
from tests.helpers import compressing_config, random_ids
from tests.serving.conftest import oracle_tokens


def pool_for(model, config):
    return KVBlockPool(model, max_gpu_bytes=1 << 20, page_size=8, dtype=torch.float32, device="cpu",
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)


@pytest.mark.parametrize("fields", [dict(decode_budget=16, decode_window=4), dict(token_budget=64)])
def test_batching_engine_refuses_what_its_step_cannot_run(tiny_pair, fields):
    field = next(iter(fields))
    config = compressing_config(**fields)
    with pytest.raises(NotImplementedError, match=f"RocketKVConfig.{field}"):
        BatchingEngine(tiny_pair[0], config, pool_for(tiny_pair[0], config))
    with pytest.raises(NotImplementedError, match=f"RocketKVConfig.{field}"):
        generate_batch(tiny_pair[0], [[5, 6, 7]], config=config, pool=pool_for(tiny_pair[0], config),
                       sampling=SamplingParams.greedy(3))


def test_the_sequential_engine_runs_decode_budget(tiny_pair):
    config = compressing_config(decode_budget=16, decode_interval=8, decode_window=4)
    prompts = [random_ids(1, 40, seed=s)[0].tolist() for s in (11, 12)]
    results = generate_batch(tiny_pair[0], prompts, config=config, engine="sequential",
                             sampling=SamplingParams.greedy(30, ignore_eos=True))
    assert [list(r.token_ids) for r in results] == [oracle_tokens(tiny_pair[1], p, config, 30) for p in prompts]


def test_generate_batch_stops_at_the_generation_configs_eos(tiny_pair):
    config = compressing_config()
    prompt = random_ids(1, 30, seed=21)[0].tolist()
    free_run = oracle_tokens(tiny_pair[1], prompt, config, 12)
    eos = free_run[5]  # a token the model really emits (its first occurrence ends the output)
    expected = free_run[: free_run.index(eos) + 1]
    [result] = generate_batch(tiny_pair[0], [prompt], GenerationConfig(max_new_tokens=12, do_sample=False,
                                                                        eos_token_id=eos), config)
    assert list(result.token_ids) == expected


def test_serve_config_errors_are_one_to_three_lines(tmp_path, capsys):
    from hf_rocketkv.serving.cli import serve_main

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("sparse_attention_config:\n  prompt_budget: [1\n")
    assert serve_main(["--config", str(bad_yaml)]) == 2
    err = capsys.readouterr().err
    assert "invalid YAML at line" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err

    extra_key = tmp_path / "extra.yaml"
    extra_key.write_text("sparse_attention_config:\n  topk: 8\nfoo: 1\n")
    assert serve_main(["--config", str(extra_key)]) == 2
    err = capsys.readouterr().err
    assert "unknown top-level key(s) ['foo']" in err and 1 <= len(err.strip().splitlines()) <= 3


def test_the_model_path_is_an_alias_and_models_answer_by_id(make_manager, tokenizer):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from hf_rocketkv.serving import create_app
    from hf_rocketkv.serving.background import ServerThread

    manager = make_manager(tokenizer=tokenizer)
    path = "/models/org/tiny-model"
    with ServerThread(create_app(manager, "tiny-model", aliases=(path,))) as server:
        for model in ("tiny-model", path):
            body = {"model": model, "prompt": "hello", "max_tokens": 2}
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "tiny-model"
            got = httpx.get(server.url + "/v1/models/" + model, timeout=30)  # a path id keeps its slashes
            assert got.status_code == 200 and got.json()["id"] == "tiny-model"
        wrong = httpx.post(server.url + "/v1/completions", json={"model": "other", "prompt": "hi"}, timeout=30)
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_found"
        missing = httpx.get(server.url + "/v1/models/other", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
