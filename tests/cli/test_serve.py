"""``hf-rocketkv serve`` (cli/serve.py, serve_main): usage errors, configs it refuses, the optional serve extra, and
whole servers in a subprocess (one process, and two ranks under torchrun).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hf_rocketkv.cli.serve import load_config, serve_main
from tests.support.repo import ROOT, TORCHRUN, subprocess_env
from tests.support.tiny_models import char_tokenizer, compressing_config, make_models


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--port", "x"], "invalid int value"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--pool-gib", "-1"], "--pool-gib must be > 0"),
    (["--engine", "sequential", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 sets the KV pool's page dtype"),
    (["--kv-cache-dtype", "int4"], "invalid choice"),
    (["--engine", "fast"], "invalid choice"),
    (["--max-running", "0"], "--max-running must be in [1, 128]"),
    (["--warmup-max-tokens", "-1"], "--warmup-max-tokens must be >= 0"),
    (["--warmup-max-tokens", "many"], "argument --warmup-max-tokens: invalid int value"),
    (["--config", "no-such.yaml"], "no such file"),
])
def test_usage_errors_are_short_and_exit_2(capsys, argv, message):
    assert serve_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and 1 <= len(err.strip().splitlines()) <= 3


def test_bad_config_values_and_port_in_use(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sparse_attention_config:\n  algorithm: rocket\n  topk: 0\n")
    assert serve_main(["--config", str(bad)]) == 2
    assert "RocketKVConfig.topk" in capsys.readouterr().err

    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert serve_main(["--port", str(taken.getsockname()[1])]) == 2  # fails before any model loads
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_warmup_max_tokens_defaults_to_the_chat_default():
    from hf_rocketkv.cli.serve import build_parser, warmup_max_tokens

    parser = build_parser()
    assert warmup_max_tokens(parser.parse_args([])) == 4096
    assert warmup_max_tokens(parser.parse_args(["--default-max-tokens", "300"])) == 300
    assert warmup_max_tokens(parser.parse_args(["--default-max-tokens", "300", "--warmup-max-tokens", "0"])) == 0
    assert warmup_max_tokens(parser.parse_args(["--warmup-max-tokens", "64"])) == 64


def test_chunked_prefill_flags_reach_the_batching_config():
    from hf_rocketkv.cli.serve import batching_config, build_parser
    from hf_rocketkv.serving.batching.scheduler import BatchingConfig

    parser = build_parser()
    default = batching_config(parser.parse_args([]))
    assert (default.prefill_chunk_tokens, default.prefill_token_budget) == (
        BatchingConfig.prefill_chunk_tokens, BatchingConfig.prefill_token_budget)
    chosen = batching_config(parser.parse_args(["--prefill-chunk-tokens", "2048", "--prefill-token-budget", "32",
                                                "--max-running", "8", "--max-queue", "5"]))
    assert (chosen.prefill_chunk_tokens, chosen.prefill_token_budget) == (2048, 32)
    assert (chosen.max_running, chosen.max_queue) == (8, 5)
    assert default.concurrent_prefill_tokens is None
    assert batching_config(parser.parse_args(["--concurrent-prefill-tokens", "512"])).concurrent_prefill_tokens == 512


def test_compile_regions_flag_compiles_norms_and_mlps_only_when_asked():
    from hf_rocketkv.cli.serve import build_parser, prepare_model
    from hf_rocketkv.integration.regions import region_modules
    from tests.support.tiny_models import make_models

    parser = build_parser()
    model, _ = make_models("llama")
    prepare_model(model, parser.parse_args([]))
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
    prepare_model(model, parser.parse_args(["--compile-regions"]))
    regions = region_modules(model)
    assert regions and all(m._compiled_call_impl is not None for m in regions)
    others = [m for m in model.modules() if all(m is not r for r in regions)]
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in others)  # attention and the cache stay eager


def test_load_config_by_name_path_and_flat(tmp_path):
    assert load_config("smollm2-cpu").prompt_budget == 256  # bundled, its eval section ignored
    assert load_config(None).prompt_budget == 2048
    flat = tmp_path / "flat.yaml"
    flat.write_text("prompt_budget: 128\ntopk: 8\n")
    assert (load_config(str(flat)).prompt_budget, load_config(str(flat)).topk) == (128, 8)


def test_missing_serve_extra_names_the_install_command(monkeypatch):
    import importlib

    from hf_rocketkv.serving.http import deps

    real = importlib.import_module

    def fake(name, *args, **kwargs):  # importlib's own function: the package's lazy names call it too
        if name == "uvicorn":
            raise ImportError("No module named 'uvicorn'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(deps.importlib, "import_module", fake)
    with pytest.raises(ImportError, match=r"uvicorn.*pip install hf_rocketkv\[serve\]"):
        deps.require_serve_deps()


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env())


def test_import_without_the_serve_extra():
    """A fresh interpreter: importing the library loads no server module; with fastapi/uvicorn/prometheus_client
    unimportable the library still works, the server names what to install, and serve_main exits 2."""
    result = run_python("""
        import sys
        import hf_rocketkv, hf_rocketkv.serving
        print("loaded:", sorted(m for m in ("fastapi", "uvicorn", "prometheus_client") if m in sys.modules))
        for name in ("fastapi", "uvicorn", "prometheus_client", "starlette"):
            sys.modules[name] = None  # makes `import name` raise ImportError
        from hf_rocketkv.serving import GenerationManager, SamplingParams, ServeDependencyError
        assert callable(hf_rocketkv.generate_batch)
        try:
            from hf_rocketkv.serving import create_app
        except ServeDependencyError as err:
            print("create_app:", err)
        from hf_rocketkv.cli.serve import serve_main
        print("exit", serve_main([]))
    """)
    assert result.returncode == 0, result.stderr
    assert "loaded: []" in result.stdout
    assert "create_app:" in result.stdout and "pip install hf_rocketkv[serve]" in result.stdout
    assert "exit 2" in result.stdout and "pip install hf_rocketkv[serve]" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("engine_args", [["--kv-memory-fraction", "0.001"], ["--engine", "sequential"],
                                         ["--engine", "batching", "--pool-gib", "0.01"],
                                         ["--engine", "batching", "--pool-gib", "0.01", "--kv-cache-dtype", "fp8"]])
def test_serve_main_end_to_end(tmp_path, engine_args):
    """The real command in a subprocess on a saved tiny model: it prints its address, answers, exits 0 on SIGINT;
    with the default engine (batching over a pool sized from the free RAM, a small fraction of it here), the
    sequential engine (no pool), the batching one over --pool-gib, and the batching one on fp8 pages."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    model, _ = make_models("llama")
    model.save_pretrained(tmp_path / "tiny")
    char_tokenizer().save_pretrained(tmp_path / "tiny")
    config = tmp_path / "c.yaml"
    compressing_config().to_yaml(config)
    command = [sys.executable, "-c", "import sys; from hf_rocketkv.cli.serve import serve_main; "
               "sys.exit(serve_main(sys.argv[1:]))", "--model", str(tmp_path / "tiny"), "--config", str(config),
               "--port", "0", "--served-model-name", "tiny", "--log-level", "warning", "--threads", "1", *engine_args]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env())
    try:
        url = server_address(process, timeout=120)
        assert wait_for_health(httpx, url)
        body = {"model": "tiny", "prompt": "hello world " * 4, "max_tokens": 5, "ignore_eos": True}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        process.stderr.close()
    assert code == 0


CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


def test_serve_options_are_checked_and_applied(tmp_path, monkeypatch):
    """--set overrides the config after --config is read; --chat-template is a file or the template itself;
    --api-key falls back to HF_ROCKETKV_API_KEY; what create_app gets."""
    from hf_rocketkv.cli.serve import build_parser
    from hf_rocketkv.cli.serve_options import check_options

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    parser = build_parser()
    monkeypatch.delenv("HF_ROCKETKV_API_KEY", raising=False)
    args = parser.parse_args(["--model", str(tmp_path / "m"), "--set", "topk=8", "--set", "prompt_budget=512",
                              "--chat-template", str(template), "--api-key", "k1"])
    config, app_options = check_options(args, load_config("smollm2-cpu"))
    assert (config.topk, config.prompt_budget, config.page_size) == (8, 512, 4)  # the rest from smollm2-cpu
    assert app_options == {"api_key": "k1", "chat_template": CHAT_TEMPLATE}
    monkeypatch.setenv("HF_ROCKETKV_API_KEY", "from-env")
    args = parser.parse_args(["--model", str(tmp_path / "m"), "--chat-template", "{{ messages[0]['content'] }}"])
    config, app_options = check_options(args, load_config(None))
    assert config.topk == 64  # no --set: the config as read
    assert app_options == {"api_key": "from-env", "chat_template": "{{ messages[0]['content'] }}"}


@pytest.mark.slow
def test_serve_main_with_key_template_and_set(tmp_path):
    """The real command with --api-key, --chat-template and --set, driven by the openai client: the wrong key is
    refused (401), the right one gets a chat reply whose prompt went through the given template."""
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    model, _ = make_models("llama")
    tokenizer = char_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    command = [sys.executable, "-m", "hf_rocketkv.cli", "serve", "--model", str(tmp_path / "tiny"), "--port", "0",
               "--served-model-name", "tiny", "--log-level", "warning", "--threads", "1", "--api-key", "sk-1",
               "--chat-template", str(tmp_path / "chat.jinja"), "--set", "prompt_budget=24", "--set", "window_size=8",
               "--set", "kernel_size=5", "--set", "topk=3", "--set", "kt_cache_dtype=bfloat16"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        url = server_address(process, timeout=120)
        assert wait_for_health(httpx, url)  # /health needs no key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-2", max_retries=0).models.list()
        api = openai.OpenAI(base_url=url + "/v1", api_key="sk-1", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "hello"}]
        reply = api.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                            extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == len("[user] hello\n[assistant]") and reply.usage.completion_tokens == 3
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        process.stderr.close()
    assert code == 0


def server_address(process: subprocess.Popen, timeout: float) -> str:
    """The http://127.0.0.1:PORT the serve command prints on stderr once it listens (asserts it does in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            break
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if match:
            return match.group(1)
    raise AssertionError(f"the server did not start (exit {process.poll()})")


def wait_for_health(httpx, url: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def test_tensor_parallel_usage_errors(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert serve_main([]) == 2
    assert "under torchrun (WORLD_SIZE=2)" in capsys.readouterr().err
    assert serve_main(["--pool-gib", "1", "--device", "cpu"]) == 2
    assert "each rank uses its own device" in capsys.readouterr().err
    assert serve_main(["--pool-gib", "1", "--concurrent-prefill-tokens", "512"]) == 2
    assert "--concurrent-prefill-tokens under torchrun (WORLD_SIZE=2)" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert serve_main(["--pool-gib", "1"]) == 2
    assert "WORLD_SIZE must be an integer" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("arch,rank_kv_heads", [("llama", 2), ("gemma3", 1), ("gpt_oss", 2)])
def test_serve_under_torchrun_rank0_serves_every_rank_steps(tmp_path, arch, rank_kv_heads):
    """``torchrun --nproc_per_node=2 -m hf_rocketkv.cli serve`` (gloo, CPU): rank 0 listens, rank 1 follows in
    lockstep. A rank that did not step would leave rank 0's forward waiting in its all-reduce, so answers at all
    prove the lockstep; the greedy text must equal the same request through one process (the model's oracle).
    Gemma 3 (sliding layers, 1 of 2 KV heads per rank) and gpt-oss (sinks, sliding layers; its plan keeps the
    attention whole, so each rank's pool holds both KV heads) run the same way."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    if arch == "llama":
        model, _ = make_models("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    else:
        from tests.support.hybrid_models import make_hybrid_models

        model, _ = make_hybrid_models(arch)
    model.save_pretrained(tmp_path / "tiny")
    char_tokenizer().save_pretrained(tmp_path / "tiny")
    config = tmp_path / "c.yaml"
    compressing_config(kt_cache_dtype="float32").to_yaml(config)
    common = ["--model", str(tmp_path / "tiny"), "--config", str(config), "--served-model-name", "tiny",
              "--log-level", "warning", "--threads", "1", "--pool-gib", "0.01", "--dtype", "float32"]
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [*TORCHRUN, "-m", "hf_rocketkv.cli", "serve", "--port", "0", *common]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    prompt = "lockstep " * 5
    try:
        url = server_address(process, timeout=180)
        assert wait_for_health(httpx, url)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        texts = []
        for stream in (False, True):
            with httpx.Client(timeout=60) as client:
                if stream:
                    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
                        assert response.status_code == 200
                        chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
                    import json

                    texts.append("".join(json.loads(c)["choices"][0]["text"] for c in chunks))
                else:
                    response = client.post(url + "/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    assert response.json()["usage"]["completion_tokens"] == 6
                    texts.append(response.json()["choices"][0]["text"])
        assert texts[0] == texts[1]
        metrics = httpx.get(url + "/metrics", timeout=30).text
        total_pages = float(re.search(r"^hf_rocketkv_pool_total_pages (\S+)$", metrics, re.M).group(1))
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: every rank gets it, as from a terminal
        try:
            rest = process.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            rest = process.communicate()[1]
    # rank 1 waits for rank 0's last inbox instead of leaving rank 0's engine in a broken collective
    assert "Connection closed by peer" not in rest and "terminate called" not in rest, rest[-3000:]

    single = [sys.executable, "-c", textwrap.dedent(f"""
        import torch
        from hf_rocketkv import RocketKVCache, RocketKVConfig
        from hf_rocketkv.models import load_model_and_tokenizer
        model, tok = load_model_and_tokenizer({str(tmp_path / "tiny")!r}, dtype=torch.float32)
        ids = tok({prompt!r}, return_tensors="pt").input_ids
        cache = RocketKVCache(RocketKVConfig.from_yaml({str(config)!r}))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        print(repr(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
    """)]
    result = subprocess.run(single, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == repr(texts[0])

    # --pool-gib is per GPU: each rank's pages hold the KV heads its attention receives (Llama: 2 of 4, so twice the
    # pages of a one-process pool of the same size; gpt-oss: all of them, so the same pages)
    from hf_rocketkv import KVBlockPool

    cfg = compressing_config(kt_cache_dtype="float32")
    one_gpu = KVBlockPool(model.config, max_gpu_bytes=int(0.01 * 2**30), dtype=torch.float32,
                          kt_page_size=cfg.page_size, kt_dtype=cfg.kt_cache_dtype).total_pages()
    shard = KVBlockPool(model.config, max_gpu_bytes=int(0.01 * 2**30), dtype=torch.float32,
                        kt_page_size=cfg.page_size, kt_dtype=cfg.kt_cache_dtype,
                        num_kv_heads=rank_kv_heads).total_pages()
    assert total_pages == shard
    if rank_kv_heads < model.config.num_key_value_heads:
        assert shard >= 2 * one_gpu - 1
    else:
        assert shard == one_gpu


# ------------------------------------------------------------------------------------------------ configs refused
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved tiny random Llama with the character tokenizer (as the end-to-end tests save one)."""
    folder = tmp_path_factory.mktemp("tiny_serve") / "tiny"
    model, _ = make_models("llama")
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def no_serving(monkeypatch):
    """serve_main never starts uvicorn here: reaching the server (the config was accepted) fails the test at once."""
    from hf_rocketkv.cli import serve as cli

    def refuse(*args, **kwargs):
        raise AssertionError("serve_main accepted the config and started serving")

    monkeypatch.setattr(cli, "_run", refuse)


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


def test_serve_unknown_top_level_key_beside_the_section_exits_2(tmp_path, capsys, no_serving):
    from hf_rocketkv.cli.serve import serve_main

    extra = tmp_path / "extra.yaml"
    extra.write_text("sparse_attention_config:\n  topk: 8\nsparse_attention_confg:\n  topk: 4\n")
    # a --model that does not exist: the config is refused before any model loads (a key left unread would let the
    # command go on to the missing model)
    missing = tmp_path / "nothing-here"
    assert serve_main(["--config", str(extra), "--model", str(missing), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "sparse_attention_confg" in err and 1 <= len(err.strip().splitlines()) <= 3 and "Traceback" not in err


@pytest.mark.parametrize("fields, name", [(dict(multi_turn="keep_all"), "multi_turn"),
                                          (dict(decode_budget=16, decode_interval=8, decode_window=4),
                                           "decode_budget")])
def test_serve_config_refused_by_the_batching_engine_exits_2(tiny_dir, tmp_path, capsys, no_serving, fields, name):
    """``--engine batching`` with a config it cannot serve: one line naming the field, before the model loads (the
    default engine falls back to the sequential one instead: tests/cli/test_serve_defaults.py)."""
    from hf_rocketkv.cli.serve import serve_main

    config = tmp_path / "c.yaml"
    compressing_config(**fields).to_yaml(config)
    argv = ["--model", str(tiny_dir), "--config", str(config), "--pool-gib", "0.01", "--port", "0",
            "--warmup-max-tokens", "0", "--log-level", "warning", "--engine", "batching"]
    assert serve_main(argv) == 2  # not the engine's NotImplementedError escaping serve_main (a traceback)
    err = capsys.readouterr().err
    assert name in err and "--engine batching" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("engine", ["auto", "sequential"])
def test_serve_adakv_with_a_pool_names_the_config_and_the_flag(tiny_dir, tmp_path, capsys, no_serving, engine):
    from hf_rocketkv.cli import serve as cli

    config = tmp_path / "adakv.yaml"
    compressing_config(stage1="adakv").to_yaml(config)
    argv = ["--model", str(tiny_dir), "--config", str(config), "--pool-gib", "0.01", "--port", "0",
            "--warmup-max-tokens", "0", "--log-level", "warning", "--engine", engine]
    assert cli.serve_main(argv) == 2
    err = capsys.readouterr().err
    assert 1 <= len(err.strip().splitlines()) <= 3 and "Traceback" not in err
    assert "stage1" in err and "--pool-gib" in err, err
    assert "cannot load --model" not in err, err  # the config is what is refused, before the model loads


def test_compile_cache_flag_points_the_caches_at_the_folder(tmp_path, monkeypatch):
    """--compile-cache DIR: Triton's and inductor's caches in DIR before the model loads; a file is a usage error."""
    from hf_rocketkv.cli.checks import UsageError
    from hf_rocketkv.cli.serve import build_parser
    from hf_rocketkv.cli.serve_options import use_compile_cache_flag

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    parser = build_parser()
    assert use_compile_cache_flag(parser.parse_args([])) is None
    line = use_compile_cache_flag(parser.parse_args(["--compile-cache", str(tmp_path / "cc")]))
    assert line.startswith(f"compile cache {tmp_path / 'cc'}")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cc" / "triton")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="--compile-cache"):
        use_compile_cache_flag(parser.parse_args(["--compile-cache", str(tmp_path / "file")]))


def test_shard_kv_heads_follows_the_models_plan():
    """--pool-gib under torchrun: each rank's pool holds the KV heads its attention receives: a shard where the plan
    splits k_proj by heads (Llama, Gemma), every head where it leaves the attention whole (gpt-oss)."""
    from types import SimpleNamespace

    from transformers import GptOssConfig, LlamaConfig

    from hf_rocketkv.models import shard_kv_heads

    def model(config, plan):
        return SimpleNamespace(config=config, tp_plan=plan)

    llama = LlamaConfig(num_attention_heads=8, num_key_value_heads=4)
    assert shard_kv_heads(model(llama, {"model.layers.*.self_attn.k_proj": "colwise"}), 2) == 2
    assert shard_kv_heads(model(llama, {"model.layers.*.self_attn.k_proj": "colwise"}), 3) is None
    oss = GptOssConfig(num_attention_heads=8, num_key_value_heads=4)
    assert shard_kv_heads(model(oss, {"model.embed_tokens": "embedding_rowwise"}), 2) == 4


def test_a_tensor_parallel_ranks_prefill_reserve_counts_its_shard_of_kv_heads(monkeypatch):
    """Under torchrun with 2 ranks, serve's automatically sized pool keeps out the prefill reserve of the rank's
    shard: half the KV heads' dense K/V of a 32k-token prompt, the 8k-token chunk's activations counted whole (the
    hidden states are not sharded). Written out by hand here, not by the function under test."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from hf_rocketkv import memory
    from hf_rocketkv.cli.serve import EnginePlan, build_parser, build_pool

    class Rank(torch.nn.Module):  # a rank's sharded model: its config is the whole model's, its plan splits k_proj
        def __init__(self):
            super().__init__()
            self.config = LlamaConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                      hidden_size=128, intermediate_size=256)
            self.weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
            self.tp_plan = {"model.layers.*.self_attn.k_proj": "colwise"}

    reserves = []
    real = memory.auto_pool_size

    def auto_pool_size(device, fraction=None, free=None, reserve=0):
        reserves.append(reserve)
        return real(device, fraction, free, reserve)

    monkeypatch.setattr(memory, "auto_pool_size", auto_pool_size)
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = SimpleNamespace(page_size=4, kt_cache_dtype="bfloat16")
    pool, _line = build_pool(build_parser().parse_args([]), Rank(), config, EnginePlan("batching", True))
    dense_kv = 2 * 2 * (4 // 2) * 16 * 32768 * 2  # K and V x layers x the rank's KV heads x head_dim x tokens x bf16
    activations = 8192 * (8 * 128 + 4 * 256) * 2  # chunk x (8 x hidden + 4 x intermediate) x bf16, not sharded
    assert reserves == [dense_kv + activations]
    assert reserves[0] == 2 * 2 * 4 * 16 * 32768 * 2 // 2 + activations  # the whole model's K/V, halved
    assert pool.geometry.num_kv_heads == 2
