"""Audit of per-KV-head lengths in the cache (``stage1="adakv"``, commits 6a11e9a..HEAD).

Defects (these tests fail on the audited code):
* tensor parallelism: AdaKV allots the row's budget across the KV heads a rank holds, not across the model's, so a
  ``tp_plan="auto"`` run keeps other tokens than one process and nothing refuses it;
* ``hf-rocketkv serve --pool-gib`` with an adakv config: the pool's refusal is reported as "cannot load --model";
* eval: ``rocketkv_fp8kv*`` methods (a KVBlockPool) with an adakv config pass the up-front method check and crash
  with a traceback mid-run;
* decode-time compression's max-pooled scores tie, and ``topk`` breaks ties differently for another capacity, so
  capacity buckets (and so ``decode_runner="torch_compile"``) change the tokens of an adakv + decode_budget run.

Guards (pass; verified behaviour): generate()'s deferred stop check (crop(-1)) with per-head lengths, token_budget
with adakv, beam search + batch buckets + compiled decode with adakv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import CompileConfig

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.policies.decode_compression import decode_keep_slots
from tests.support.tiny_models import PAD, compressing_config, greedy, left_pad, make_models, random_ids
from tests.integration.test_generate import _CpuEvent

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ tensor parallel
@pytest.mark.slow
def test_tensor_parallel_adakv_equals_one_process_or_is_refused(tmp_path):
    """docs/serving.md: "stage 1 and stage 2 are per KV head, so no rank needs another's scores" -- not for AdaKV,
    whose allocation ranks the scores of every KV head of the row. Each rank must keep what one process keeps for
    its heads, or the run must be refused with a message naming stage1."""
    rocket = dict(prompt_budget=24, window_size=8, kernel_size=5, topk=3, topr=8, page_size=4,
                  kt_cache_dtype="float32", backend="torch", stage1="adakv")
    model, _ = make_models("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    model.save_pretrained(tmp_path / "model")
    ids, mask = left_pad([random_ids(1, 48, seed=1)[0], random_ids(1, 40, seed=2)[0]])
    spec = dict(input_ids=ids.tolist(), attention_mask=mask.tolist(), max_new_tokens=4, pad_token_id=PAD,
                rocketkv=rocket)
    (tmp_path / "in.json").write_text(json.dumps(spec))
    output = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO / "tests" / "integration" / "tp_worker.py"), str(tmp_path / "model"), str(tmp_path / "in.json"),
                             str(output)], env=env, capture_output=True, text=True, timeout=400)
    if result.returncode != 0:  # a refusal is acceptable if it says why
        assert "stage1" in result.stderr and not output.exists(), result.stderr[-3000:]
        return
    cache = RocketKVCache(RocketKVConfig(**rocket))
    expected = greedy(model, ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4)
    single = [cache.kept_tokens(i) for i in range(len(cache.layers))]  # [B, 4] per layer
    for rank in json.loads(output.read_text())["ranks"]:
        heads = slice(2 * rank["rank"], 2 * rank["rank"] + 2)
        for layer_idx, kept in enumerate(rank["kept_tokens"]):
            assert kept == single[layer_idx][:, heads].tolist(), (rank["rank"], layer_idx)
        assert rank["tokens"] == expected.tolist()


# ------------------------------------------------------------------------------------------------ serve CLI
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.serving.helpers import char_tokenizer

    folder = tmp_path_factory.mktemp("tiny_adakv") / "tiny"
    model, _ = make_models("llama")
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("engine", ["auto", "sequential"])
def test_serve_adakv_with_a_pool_names_the_config_and_the_flag(tiny_dir, tmp_path, capsys, monkeypatch, engine):
    from hf_rocketkv.cli import serve as cli

    def refuse(*args, **kwargs):
        raise AssertionError("serve_main accepted the config and started serving")

    monkeypatch.setattr(cli, "_run", refuse)
    config = tmp_path / "adakv.yaml"
    compressing_config(stage1="adakv").to_yaml(config)
    argv = ["--model", str(tiny_dir), "--config", str(config), "--pool-gib", "0.01", "--port", "0",
            "--warmup-max-tokens", "0", "--log-level", "warning", "--engine", engine]
    assert cli.serve_main(argv) == 2
    err = capsys.readouterr().err
    assert 1 <= len(err.strip().splitlines()) <= 3 and "Traceback" not in err
    assert "stage1" in err and "--pool-gib" in err, err
    assert "cannot load --model" not in err, err  # the model loaded fine: the config is what is refused


# ------------------------------------------------------------------------------------------------ eval
@pytest.mark.parametrize("method, base", [("rocketkv_fp8kv", dict(stage1="adakv")),
                                          ("rocketkv_fp8kv_head", dict(stage1="adakv")),
                                          ("rocketkv_fp8kv@stage1=adakv", dict())])
def test_eval_pool_methods_refuse_per_head_budgets_when_built(method, base):
    """``build_methods`` is eval's up-front check (before the model loads); the fp8 pool of these methods refuses
    per-head budgets only when the method's first cache is made, after the model loaded and other methods ran."""
    from hf_rocketkv.eval.methods import build_methods

    with pytest.raises(ValueError, match="stage1"):
        build_methods(["full", method], compressing_config(**base))


def test_eval_cli_reports_an_fp8_pool_method_with_adakv_before_loading_the_model(tmp_path, capsys):
    from hf_rocketkv.cli.main import main

    argv = ["eval", "--model", str(tmp_path / "no-model-here"), "--task", "passkey", "--methods", "full",
            "rocketkv_fp8kv", "--lengths", "96", "--samples", "1", "--set", "stage1=adakv",
            "--output", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "stage1" in err and "rocketkv_fp8kv" in err, err  # not the missing --model: methods are checked first


# ------------------------------------------------------------------------------------------------ decode compression
@pytest.mark.parametrize("per_head", [False, True])
def test_decode_keep_slots_do_not_depend_on_the_capacity(per_head):
    """Slots past every length are never selectable, so padding the store must not change the kept slots. With the
    max-pooling (kernel 7) neighbouring slots tie and ``topk`` picks among ties by the tensor's size."""
    torch.manual_seed(0)
    queries, keys = torch.randn(1, 2, 4, 16), torch.randn(1, 1, 40, 16)
    lengths, gen_start = torch.tensor([40]), torch.tensor([24])
    if per_head:
        queries, keys = torch.randn(1, 4, 4, 16), torch.randn(1, 2, 40, 16)
        lengths, gen_start = torch.tensor([[40, 33]]), torch.tensor([[24, 17]])
    exact, _ = decode_keep_slots(queries, keys, lengths, gen_start, 12, 0.25, 7)
    padded, _ = decode_keep_slots(queries, F.pad(keys, (0, 0, 0, 216)), lengths, gen_start, 12, 0.25, 7)
    assert torch.equal(exact, padded), (exact.tolist(), padded.tolist())


def test_adakv_decode_budget_tokens_do_not_depend_on_capacity_buckets():
    rocket, _ = make_models("llama", num_hidden_layers=1)
    ids, mask = left_pad([random_ids(1, 30 + 7 * r, seed=r)[0] for r in range(3)])
    config = compressing_config(kt_cache_dtype="float32", stage1="adakv", decode_budget=12, decode_interval=4,
                                decode_window=4, decode_runner="torch_compile", batch_buckets=())
    outs = [greedy(rocket, ids, attention_mask=mask, max_new_tokens=20, disable_compile=True,
                   past_key_values=RocketKVCache(c)) for c in (config, config.replace(capacity_buckets=()))]
    assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------------------------------------ guards
@pytest.mark.parametrize("extra", [{}, dict(multi_turn="keep_all")])
def test_deferred_stop_check_crop_with_per_head_lengths(monkeypatch, extra):
    import transformers.generation.utils as generation_utils

    rocket, _ = make_models("llama")
    ids, mask = left_pad([random_ids(1, 40, seed=21)[0], random_ids(1, 33, seed=22)[0]])
    probe = greedy(rocket, ids, attention_mask=mask, max_new_tokens=12,
                   past_key_values=RocketKVCache(compressing_config(stage1="adakv", **extra)))
    eos = int(probe[0, 40 + 5])
    monkeypatch.setattr(generation_utils.torch, "Event", _CpuEvent)
    runs = []
    for deferred in (True, False):
        cache = RocketKVCache(compressing_config(stage1="adakv", deferred_stop_check=deferred, **extra))
        cache.hints.deferred_stop_devices = ("cuda", "cpu")
        crops, crop = [], cache.crop
        monkeypatch.setattr(cache, "crop", lambda n, _c=crop, _l=crops: (_l.append(n), _c(n))[1])
        out = greedy(rocket, ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, eos_token_id=eos)
        runs.append((out, cache, crops))
    (out, cache, crops), (plain_out, plain, plain_crops) = runs
    assert torch.equal(out, plain_out) and -1 in crops and not plain_crops
    for got, want in zip(cache.layers, plain.layers):
        assert got.lengths.dim() == 2 and torch.equal(got.lengths, want.lengths)
        assert torch.equal(got.positions, want.positions) and got.host_max_length == want.host_max_length
        assert int(got.seen) == int(want.seen)


def test_token_budget_with_adakv_keeps_the_derived_total_per_row():
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config(stage1="adakv", token_budget=32))
    greedy(rocket, random_ids(2, 60), max_new_tokens=5, past_key_values=cache)
    derived = cache.layers[0].config.prompt_budget
    for layer_idx in range(len(cache.layers)):
        kept = cache.kept_tokens(layer_idx)
        assert kept.shape == (2, 2) and kept.sum(dim=1).tolist() == [2 * (derived + 4)] * 2


@pytest.mark.slow
def test_beam_search_with_batch_buckets_and_compiled_decode_equals_eager():
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    ids, mask = left_pad([random_ids(1, 30 + 7 * r, seed=r)[0] for r in range(3)])
    config = compressing_config(kt_cache_dtype="float32", stage1="adakv", decode_runner="torch_compile")
    compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False, backend="eager")
    compile_config._compile_all_devices = True
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, num_beams=2, disable_compile=True,
                   past_key_values=RocketKVCache(config.replace(capacity_buckets=(), batch_buckets=())))
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, num_beams=2, past_key_values=cache,
                 compile_config=compile_config)
    assert torch.equal(out, eager)
    assert cache.layers[0].lengths.shape == (6, 2)  # padding rows stripped (3 rows x 2 beams), per-head lengths
