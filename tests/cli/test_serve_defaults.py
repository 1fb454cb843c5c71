"""``hf-rocketkv serve``'s defaults: the batching engine over a pool sized from the free memory, the sequential
engine (said in one line) for a config the batching engine cannot serve, the CPU threads chosen as for ``generate``,
and every mistake answered in one to three lines, exit status 2, before any model loads."""

from __future__ import annotations

import argparse
import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_rocketkv.cli import serve as cli
from hf_rocketkv.cli.threads import ThreadChoice
from hf_rocketkv.memory import sizing
from tests.support.tiny_models import char_tokenizer, compressing_config, make_models

MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved tiny random Llama with the character tokenizer, and its compressing config beside it."""
    folder = tmp_path_factory.mktemp("tiny_defaults")
    model, _ = make_models("llama")
    model.save_pretrained(folder / "tiny")
    char_tokenizer().save_pretrained(folder / "tiny")
    compressing_config().to_yaml(folder / "c.yaml")
    compressing_config(multi_turn="keep_all").to_yaml(folder / "keep_all.yaml")
    compressing_config(stage1="adakv").to_yaml(folder / "adakv.yaml")
    return folder


@pytest.fixture
def files(tiny_dir, tmp_path, monkeypatch):
    """A folder of wrong inputs (the working directory of the test) beside the tiny model's."""
    from transformers import Gemma2Config, Llama4TextConfig, LlamaConfig

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    Gemma2Config(**small, num_key_value_heads=2, head_dim=8).save_pretrained(tmp_path / "gemma2")
    Llama4TextConfig(**small, num_key_value_heads=2, head_dim=8).save_pretrained(tmp_path / "llama4")
    LlamaConfig(**small, num_key_value_heads=2).save_pretrained(tmp_path / "llama-no-weights")
    (tmp_path / "empty-folder").mkdir()
    (tmp_path / "notes.txt").write_text("some notes\n")
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "broken.yaml").write_text("sparse_attention_config: [1\n")
    (tmp_path / "typo.yaml").write_text("sparse_attention_config:\n  prompt_budgte: 256\n")
    for name in ("c.yaml", "keep_all.yaml", "adakv.yaml"):
        (tmp_path / name).write_text((tiny_dir / name).read_text())
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_model_loading(monkeypatch):
    """Reading weights, building a pool or serving fails the test: the mistake must be found before."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded (or served) for a command that should have been refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(cli, "build_pool", refuse)
    monkeypatch.setattr(cli, "_run", refuse)


TAKEN = "TAKEN"  # stands for the port of a socket the test holds
BAD_ARGUMENTS = [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--port", "x"], "invalid int value"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--port", TAKEN], "cannot listen on 127.0.0.1"),
    (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid"),
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--max-model-len", "1"], "--max-model-len must be >= 2"),
    (["--default-max-tokens", "0"], "--default-max-tokens must be >= 1"),
    (["--pool-gib", "0"], "--pool-gib must be > 0"),
    (["--pool-gib", "nan"], "--pool-gib must be > 0"),
    (["--pool-gib", "lots"], "invalid float value"),
    (["--kv-memory-fraction", "0"], "--kv-memory-fraction must be in (0, 1]"),
    (["--kv-memory-fraction", "1.5"], "--kv-memory-fraction must be in (0, 1]"),
    (["--kv-memory-fraction", "0.5", "--pool-gib", "1"], "give one of them"),
    (["--engine", "sequential", "--kv-memory-fraction", "0.5"], "(--engine sequential) has a pool only with"),
    (["--engine", "sequential", "--kv-cache-dtype", "fp8"], "sets the KV pool's page dtype"),
    (["--engine", "fast"], "invalid choice"),
    (["--max-running", "0"], "--max-running must be in [1, 128]"),
    (["--prefill-chunk-tokens", "0"], "--prefill-chunk-tokens must be >= 1"),
    (["--prefill-token-budget", "-32"], "--prefill-token-budget must be >= 1"),
    (["--prefill-token-budget", "1.5"], "invalid int value"),
    (["--concurrent-prefill-tokens", "0"], "--concurrent-prefill-tokens must be >= 1"),
    (["--warmup-max-tokens", "-1"], "--warmup-max-tokens must be >= 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--dtype", "fp16"], "invalid choice"),
    (["--device", "gpu"], "--device gpu: not a torch device"),
    (["--device", "tpu"], "--device tpu: not a torch device"),
    (["--device", "cuda"], "--device cuda: CUDA is not available"),
    (["--device", "cuda:1"], "--device cuda:1: CUDA is not available"),
    (["--device", "meta"], "--device meta: meta tensors hold no data"),
    (["--config", "nope.yaml"], "--config nope.yaml: no such file"),
    (["--config", "broken.yaml"], "--config broken.yaml: invalid YAML at line 2"),
    (["--config", "typo.yaml"], "prompt_budgte"),
    (["--config", "keep_all.yaml", "--engine", "batching"], "--engine batching: --config keep_all.yaml sets "
                                                             "multi_turn='keep_all'"),
    (["--config", "adakv.yaml", "--engine", "batching"], "sets stage1='adakv'"),
    (["--config", "adakv.yaml", "--pool-gib", "1"], "--config adakv.yaml with --pool-gib"),
    (["--model", "models/llama"], "--model models/llama: no such file or folder"),
    (["--model", "notes.txt"], "--model notes.txt: a file, but not a .gguf file"),
    (["--model", "empty-folder"], "--model empty-folder: not a checkpoint folder"),
    (["--model", "broken.gguf"], "--model broken.gguf: cannot read its config"),
    (["--model", "llama-no-weights"], "--model llama-no-weights: no weights in this folder"),
    (["--model", "llama4"], "--model llama4: no weights in this folder"),  # (chunked layers are served)
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(argv) for argv, _ in BAD_ARGUMENTS])
def test_every_mistake_is_short_exits_2_and_loads_no_model(files, no_model_loading, capsys, argv, message):
    if argv[:2] == ["--device", "cuda"] or argv[:2] == ["--device", "cuda:1"]:
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = [port if item == TAKEN else item for item in argv]
        assert cli.serve_main(["--port", "0", "--log-level", "warning", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and 1 <= len(err.strip().splitlines()) <= 3, err


# ------------------------------------------------------------------------------------------------ the engine
def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, fields, expected", [
    ((), {}, ("batching", True, None)),
    (("--pool-gib", "1"), {}, ("batching", True, None)),
    (("--engine", "sequential"), {}, ("sequential", False, None)),
    (("--engine", "sequential", "--pool-gib", "1"), {}, ("sequential", True, None)),
    ((), dict(multi_turn="keep_all"), ("sequential", False, "multi_turn='keep_all'")),
    ((), dict(decode_budget=16, decode_interval=8, decode_window=4), ("sequential", False, "decode_budget=16")),
    ((), dict(token_budget=64), ("sequential", False, "token_budget=64")),
    ((), dict(stage1="adakv"), ("sequential", False, "stage1='adakv'")),
    ((), dict(budget_schedule="pyramid"), ("sequential", False, "budget_schedule='pyramid'")),
    ((), dict(dense_layers=1), ("sequential", False, "dense_layers=1")),
    (("--pool-gib", "1"), dict(multi_turn="keep_all"), ("sequential", True, "multi_turn='keep_all'")),
])
def test_the_engine_plan(argv, fields, expected):
    """auto is the batching engine over a pool; a config it cannot serve runs on the sequential engine (with a pool
    only when --pool-gib gives one), said in one line naming the field."""
    plan = cli.plan_engine(parse("--config", "c.yaml", *argv), compressing_config(**fields))
    name, pool, field = expected
    assert (plan.name, plan.pool) == (name, pool)
    if field is None:
        assert plan.note is None
    else:
        assert plan.note.startswith("sequential engine, one request at a time: --config c.yaml sets " + field)
        assert "\n" not in plan.note


def test_a_sliding_window_model_runs_on_the_batching_engine():
    """A model with sliding-window layers plans as Llama does: the batching engine over a pool (its sliding layers
    take one window per request there, in the model's dtype under fp8 pages); a config the batching engine refuses
    still falls back, naming the field."""
    for argv in ((), ("--engine", "batching"), ("--pool-gib", "1"), ("--kv-cache-dtype", "fp8")):
        plan = cli.plan_engine(parse("--model", "gemma2", *argv), compressing_config(), sliding=True)
        assert (plan.name, plan.pool, plan.note) == ("batching", True, None)
    sequential = cli.plan_engine(parse("--model", "gemma2", "--engine", "sequential", "--pool-gib", "1"),
                                 compressing_config(), sliding=True)
    assert (sequential.name, sequential.pool) == ("sequential", True)
    config_first = cli.plan_engine(parse("--model", "gemma2"), compressing_config(multi_turn="keep_all"), sliding=True)
    assert "multi_turn='keep_all'" in config_first.note


# ------------------------------------------------------------------------------------------------ threads
def test_threads_are_chosen_as_for_generate(monkeypatch):
    """Without --threads and OMP_NUM_THREADS, serve takes cli/threads.py's choice (the one generate takes);
    --threads wins; with OMP_NUM_THREADS set torch's own setting stays."""
    from hf_rocketkv.cli import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "default_threads", lambda: ThreadChoice(1, "auto: made up for the test"))
    torch.set_num_threads(2)
    assert cli.set_threads(parse()) == "1 CPU thread(s), auto: made up for the test"
    assert torch.get_num_threads() == 1
    assert cli.set_threads(parse("--threads", "2")) == "2 CPU thread(s), --threads"
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(1)
    assert cli.set_threads(parse()) == "1 CPU thread(s), from OMP_NUM_THREADS"
    assert torch.get_num_threads() == 1


# ------------------------------------------------------------------------------------------------ whole servers
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 2, "hello world, " * 6, "a b c d e f g h i j k l m n",
           "serving many requests at once " * 2]


def streamed_texts(url: str) -> list[str]:
    """The four prompts as concurrent streaming completions (greedy, 6 tokens each), their texts in order."""
    httpx = pytest.importorskip("httpx")

    def one(prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            chunks = [line[6:] for line in reply.iter_lines() if line.startswith("data: {")]
        return "".join(json.loads(chunk)["choices"][0]["text"] for chunk in chunks)

    with ThreadPoolExecutor(len(PROMPTS)) as threads:
        return list(threads.map(one, PROMPTS))


def serve_and_stream(monkeypatch, argv: list[str]) -> dict:
    """serve_main(argv) in this process with the HTTP part replaced by a server thread on the same app that streams
    the four prompts; returns the engine, the pool and the texts."""
    pytest.importorskip("fastapi")
    from hf_rocketkv.serving.http.background import ServerThread
    from hf_rocketkv.serving.http.server import create_app

    seen = {}

    def run(manager, model_name, sock, args, app_options, tokenizer=None):
        # serve's _run: a PendingManager (warm-up still to run) is finished before requests are served
        if isinstance(manager, cli.PendingManager):
            manager = manager.finish()
        seen.update(engine=manager.engine, pool=manager.pool)
        with ServerThread(create_app(manager, "tiny", default_max_tokens=args.default_max_tokens)) as server:
            seen["texts"] = streamed_texts(server.url)
        return manager, False

    monkeypatch.setattr(cli, "_run", run)
    assert cli.serve_main(["--port", "0", "--log-level", "warning", "--threads", "1", *argv]) == 0
    return seen


@pytest.mark.slow
def test_default_serve_batches_over_a_pool_sized_from_free_memory(tiny_dir, monkeypatch, capsys):
    """The documented command without --engine or --pool-gib: a BatchingEngine over a pool of 0.25 of the
    (made-up) available RAM, said in one line; four concurrent streams get the texts the sequential engine gives."""
    from hf_rocketkv.serving.batching.engine import BatchingEngine
    from hf_rocketkv.serving.engines.sequential import SequentialEngine

    monkeypatch.setattr(sizing, "host_available", lambda: 64 * MIB)
    common = ["--model", str(tiny_dir / "tiny"), "--config", str(tiny_dir / "c.yaml")]
    batched = serve_and_stream(monkeypatch, common)
    err = capsys.readouterr().err
    assert isinstance(batched["engine"], BatchingEngine)
    pool = batched["pool"]
    assert pool.total_pages() == 16 * MIB // pool.bytes_per_page  # 0.25 x 64 MiB
    line = (f"hf-rocketkv serve: batching engine, KV pool 0.02 GiB (0.25 of 0.1 GiB available RAM): "
            f"{pool.total_pages()} pages of 16 tokens")
    assert line in err.splitlines(), err
    assert "hf-rocketkv serve: 1 CPU thread(s), --threads" in err.splitlines()
    assert pool.free_pages() == pool.total_pages()  # every request gave its pages back

    sequential = serve_and_stream(monkeypatch, [*common, "--engine", "sequential"])
    assert isinstance(sequential["engine"], SequentialEngine) and sequential["pool"] is None
    assert batched["texts"] == sequential["texts"] and all(batched["texts"])


@pytest.mark.slow
def test_a_config_the_batching_engine_refuses_runs_sequentially_with_one_line(tiny_dir, monkeypatch, capsys):
    from hf_rocketkv.serving.engines.sequential import SequentialEngine

    config = tiny_dir / "keep_all.yaml"
    served = serve_and_stream(monkeypatch, ["--model", str(tiny_dir / "tiny"), "--config", str(config)])
    assert isinstance(served["engine"], SequentialEngine) and served["pool"] is None
    lines = capsys.readouterr().err.splitlines()
    notes = [line for line in lines if "sequential engine" in line]
    assert notes == [f"hf-rocketkv serve: sequential engine, one request at a time: --config {config} sets "
                     f"multi_turn='keep_all' (the batching engine serves one turn per request)"]
    assert not any("KV pool" in line for line in lines)
