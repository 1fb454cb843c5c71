"""The hf-rocketkv command: generate report, eval outputs, YAML errors naming the key, bench delegation.

Runs ``hf_rocketkv.cli.main(argv)`` in-process on a tiny random Llama saved to a tmp folder with the SmolLM2
tokenizer (so chat templates and real text work), on CPU.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_rocketkv.cli import CONFIG_DIR, compact_list, main
from hf_rocketkv.eval.settings import load_run_config

TINY_YAML = """\
sparse_attention_config:
  algorithm: rocket
  window_size: 8
  kernel_size: 5
  prompt_budget: 48
  topk: 4
  topr: 16
  page_size: 4
  kt_cache_dtype: bfloat16
  backend: torch
eval:
  lengths: [160]
  depths: [0.5]
  samples: 1
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    folder = tmp_path_factory.mktemp("tiny_smollm2_vocab")
    smollm2_tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_yaml(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML)
    return path


def test_generate_prints_text_and_report(tiny_model_dir, tiny_yaml, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            "--config",
            str(tiny_yaml),
            "--prompt-file",
            str(doc),
            "--prompt",
            "What jumps?",
            "--chat",
            "--max-new-tokens",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- hf-rocketkv report ---" in out
    prompt_tokens = int(out.split("prompt tokens: ")[1].split()[0])
    assert prompt_tokens > 300
    assert "stored tokens per layer and KV head (kept prompt + generated): min 51 / mean 51.0 / max 51" in out
    assert "per layer: 51 x2" in out
    assert "RocketKVCache.memory_bytes() = " in out and f"*{prompt_tokens + 3}*" in out  # full: prompt + 3 fed back
    assert "prefill: " in out and "ms/token over 3 steps" in out


def test_eval_writes_json_markdown_and_heatmap(tiny_model_dir, tiny_yaml, tmp_path, capsys):
    out_dir = tmp_path / "out"
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--config",
            str(tiny_yaml),
            "--task",
            "passkey",
            "--task",
            "fidelity",
            "--methods",
            "full",
            "rocketkv",
            "streaming",
            "--max-new-tokens",
            "2",
            "--fidelity-context",
            "96",
            "--fidelity-positions",
            "4",
            "--output",
            str(out_dir),
            "--no-progress",
        ]
    )
    assert rc == 0
    results = json.loads((out_dir / "results.json").read_text())
    assert [r["method"] for r in results["records"]] == ["full", "rocketkv", "streaming"]
    assert {r["kept_tokens_mean"] for r in results["records"][1:]} == {48.0}
    assert "key_retention" in results["records"][1] and "key_retention" not in results["records"][0]
    assert [f["method"] for f in results["fidelity"]] == ["full", "rocketkv", "streaming"]
    assert results["fidelity"][0]["top1_agreement"] == 1.0 and results["fidelity"][0]["mean_kl"] == 0.0
    assert results["eval"]["lengths"] == [160] and results["command"].startswith("hf-rocketkv eval")
    assert (out_dir / "heatmap_passkey.png").stat().st_size > 1000
    md = (out_dir / "results.md").read_text()
    assert "| rocketkv | 48 | 16 |" in md and "## Fidelity vs the full cache" in md
    assert "results.md" in capsys.readouterr().out


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        (
            "sparse_attention_config:\n  prompt_budgte: 256\n",
            "unknown key(s) ['prompt_budgte'] in sparse_attention_config",
        ),
        ("sparse_attention_config:\n  topk: 0\n", "RocketKVConfig.topk"),
        ("eval:\n  sampels: 3\n", "unknown key(s) ['sampels'] in 'eval'"),
        ("evals:\n  samples: 3\n", "unknown top-level key(s) ['evals']"),
        ("eval:\n  depths: [2]\n", "eval.depths must be"),
        ("sparse_attention_config: [1\n", "invalid YAML"),
    ],
)
def test_yaml_errors_name_the_key(tmp_path, capsys, yaml_text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    rc = main(["eval", "--config", str(path), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert expected in err and "bad.yaml" in err


def test_bad_names_fail_before_the_model_loads(tmp_path, capsys):
    assert main(["eval", "--task", "needle", "--output", str(tmp_path)]) == 2
    assert "unknown task 'needle'" in capsys.readouterr().err
    assert main(["eval", "--methods", "full", "h2o", "--output", str(tmp_path)]) == 2
    assert "unknown method 'h2o'" in capsys.readouterr().err
    assert main(["eval", "--config", str(tmp_path / "missing.yaml"), "--output", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["generate", "--max-new-tokens", "3"]) == 2
    assert "needs --prompt-file and/or --prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--bogus"])


def test_bundled_configs_parse():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert {"default", "smollm2-cpu"} <= set(names)
    default = load_run_config(CONFIG_DIR / "default.yaml")
    assert (default.rocket.prompt_budget, default.rocket.topk, default.rocket.page_size) == (2048, 64, 4)
    cpu = load_run_config(CONFIG_DIR / "smollm2-cpu.yaml")
    assert (cpu.rocket.prompt_budget, cpu.rocket.topk, cpu.rocket.page_size) == (256, 16, 4)
    assert cpu.eval.tasks == ["passkey"]


def test_bench_delegates_and_passes_unknown_args(monkeypatch):
    seen = {}
    fake = types.ModuleType("hf_rocketkv.bench.decode")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "hf_rocketkv.bench.decode", fake)
    assert main(["bench", "--config", "smollm2-cpu", "--batch", "8", "--help"]) == 0
    assert seen["argv"] == ["--config", str(CONFIG_DIR / "smollm2-cpu.yaml"), "--batch", "8", "--help"]


def test_bench_without_the_module_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hf_rocketkv.bench.decode", None)  # import raises ModuleNotFoundError
    assert main(["bench", "--lengths", "1024"]) == 2
    assert "hf_rocketkv/bench/decode.py" in capsys.readouterr().err


def test_compact_list():
    assert compact_list([265, 265, 265, 2185, 7]) == "265 x3, 2185, 7"
    assert compact_list([]) == ""


def test_set_overrides_config_fields():
    from hf_rocketkv import RocketKVConfig
    from hf_rocketkv.cli import apply_overrides

    config = apply_overrides(RocketKVConfig(), ["prompt_budget=512", "kt_cache_dtype=bfloat16"])
    assert (config.prompt_budget, config.kt_cache_dtype, config.topk) == (512, "bfloat16", 64)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['budget'\]"):
        apply_overrides(RocketKVConfig(), ["budget=3"])
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        apply_overrides(RocketKVConfig(), ["prompt_budget"])
    with pytest.raises(ValueError, match="RocketKVConfig.page_size"):
        apply_overrides(RocketKVConfig(), ["page_size=3"])
