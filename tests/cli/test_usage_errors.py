"""Every subcommand of ``hf-rocketkv`` (generate, eval, bench, warmup, serve) run with a table of bad arguments: each
mistake is one to three lines on stderr naming it, exit status 2, no traceback, and nothing heavy happens first (no
model loads, no benchmark or server starts). A fresh interpreter then shows that the mistakes are found before
transformers is imported.

The table runs in a folder holding the files its rows name (``files`` below); rows that need this machine to lack
CUDA skip on a CUDA machine.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from hf_rocketkv.cli import main
from tests.support.repo import subprocess_env

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
GOOD_ROW = json.dumps({"context": "The sky is blue.", "input": "What colour is the sky?", "answers": ["blue"]})

# (argv, text the error must hold); {tmp} is the folder of the files
ROWS = [
    # generate
    ("generate --prompt hi --device gpu", "--device gpu: not a torch device"),
    pytest.param("generate --prompt hi --device cuda", "--device cuda: CUDA is not available", marks=NO_CUDA),
    pytest.param("generate --prompt hi --device cuda:1", "--device cuda:1: CUDA is not available", marks=NO_CUDA),
    ("generate --prompt hi --device meta", "--device meta: meta tensors hold no data"),
    ("generate --prompt hi --device cuda:x", "--device cuda:x: not a torch device"),
    ("generate --prompt hi --model no/such/folder", "--model no/such/folder: no such file or folder"),
    ("generate --prompt hi --model notes.txt", "--model notes.txt: a file, but not a .gguf file"),
    ("generate --prompt-file missing.txt", "--prompt-file missing.txt: no such file"),
    ("generate --prompt-file folder", "--prompt-file folder: a folder, not a file"),
    ("generate --prompt hi --max-new-tokens -3", "argument --max-new-tokens: must be an integer >= 1, got -3"),
    ("generate --prompt hi --prefill-chunk-size x", "argument --prefill-chunk-size: expected an integer >= 0"),
    ("generate --prompt hi --config missing.yaml", "--config missing.yaml: no such file"),
    ("generate --prompt hi --set topk", "expected FIELD=VALUE"),
    ("generate --prompt hi --set topk=[1", "the value is not valid YAML"),
    ("generate --prompt hi --set page_size=3", "RocketKVConfig.page_size"),
    # eval
    ("eval --output out --device gpu", "--device gpu: not a torch device"),
    pytest.param("eval --output out --device cuda", "--device cuda: CUDA is not available", marks=NO_CUDA),
    ("eval --output out --model no/such/folder", "--model no/such/folder: no such file or folder"),
    ("eval --output notes.txt", "--output notes.txt: a file, not a folder"),
    ("eval --task longbench:missing.jsonl --output out", "--task longbench:missing.jsonl: no such file"),
    ("eval --task longbench:late.jsonl --output out",
     "late.jsonl:4: not valid JSON: Expecting value: line 1 column 1 (char 0) (2 more bad line(s): 6, 7)"),
    ("eval --task longbench:types.jsonl --output out", "types.jsonl:2: field 'answers' must be text or a non-empty"),
    ("eval --task ruler:array.jsonl --output out", "array.jsonl:1: not a JSON object (a list)"),
    ("eval --task ruler:blank.jsonl --output out", "blank.jsonl: no rows: the file is empty"),
    ("eval --task ruler:latin1.jsonl --output out", "latin1.jsonl:1: not UTF-8 text"),
    ("eval --task needle --output out", "unknown task 'needle'"),
    ("eval --methods full nope --output out", "unknown method 'nope'"),
    ("eval --lengths 0 --output out", "argument --lengths: must be an integer >= 1, got 0"),
    ("eval --depths -0.1 --output out", "argument --depths: must be a number in [0, 1], got -0.1"),
    ("eval --seed x --output out", "argument --seed: expected an integer >= 0, got 'x'"),
    ("eval", "the following arguments are required: --output"),
    # bench
    ("bench --device gpu", "--device gpu: not a torch device"),
    pytest.param("bench --device cuda", "--device cuda: CUDA is not available", marks=NO_CUDA),
    ("bench --batch 0", "argument --batch: must be an integer >= 1, got 0"),
    ("bench --context 1k", "argument --context: expected an integer >= 1, got '1k'"),
    ("bench --memory-fraction 0", "argument --memory-fraction: must be a number in (0, 1], got 0"),
    ("bench --memory-fraction 1.5", "argument --memory-fraction: must be a number in (0, 1], got 1.5"),
    ("bench --memory-fraction nan", "argument --memory-fraction: must be a number in (0, 1], got nan"),
    ("bench --caches dynamic paged", "argument --caches: invalid choice: 'paged'"),
    ("bench --prefill-batch-size 0", "argument --prefill-batch-size: must be an integer >= 1, got 0"),
    ("bench --out notes.txt", "--out notes.txt: a file, not a folder"),
    ("bench --config missing.yaml", "--config missing.yaml: no such file"),
    ("bench --config typo.yaml", "unknown key(s) ['prompt_budgte']"),
    ("bench --bogus", "unrecognized arguments: --bogus"),
    ("bench --workload --budget-s 0", "argument --budget-s: must be a number in (0, inf), got 0"),
    ("bench --workload --min-context 4096 --max-context 1024", "--min-context 4096 is above --max-context 1024"),
    ("bench --workload --calls none", "argument --calls: expected an integer >= 1, got 'none'"),
    ("bench --workload --caches rocketkv-adakv", "argument --caches: invalid choice: 'rocketkv-adakv'"),
    # warmup
    ("warmup --cache-dir notes.txt", "--cache-dir notes.txt: a file, not a folder"),
    ("warmup --cache-dir c --device gpu", "--device gpu: not a torch device"),
    pytest.param("warmup --cache-dir c --device cuda", "--device cuda: CUDA is not available", marks=NO_CUDA),
    ("warmup --cache-dir c --model no/such/folder", "--model no/such/folder: no such file or folder"),
    ("warmup --cache-dir c --batch 0", "argument --batch: must be an integer >= 1, got 0"),
    ("warmup --cache-dir c --new-tokens 1", "argument --new-tokens: must be an integer >= 2, got 1"),
    ("warmup --cache-dir c --set window_size=0", "RocketKVConfig.window_size"),
    ("warmup", "the following arguments are required: --cache-dir"),
    ("warmup --cache-dir c --engine --pool-gib inf", "--pool-gib must be > 0, got inf (a finite number of GiB)"),
    ("warmup --cache-dir c --engine --pool-gib nan", "--pool-gib must be > 0, got nan"),
    # serve
    ("serve --device gpu", "--device gpu: not a torch device"),
    pytest.param("serve --device cuda", "--device cuda: CUDA is not available", marks=NO_CUDA),
    ("serve --model no/such/folder", "--model no/such/folder: no such file or folder"),
    ("serve --port 70000", "--port must be in [0, 65535], got 70000"),
    ("serve --port http", "argument --port: invalid int value: 'http'"),
    ("serve --max-queue 0", "--max-queue must be >= 1, got 0"),
    ("serve --threads 0", "--threads must be >= 1, got 0"),
    ("serve --pool-gib -1", "--pool-gib must be > 0, got -1"),
    ("serve --pool-gib inf", "--pool-gib must be > 0, got inf (a finite number of GiB)"),
    ("serve --pool-gib nan", "--pool-gib must be > 0, got nan"),
    ("serve --config missing.yaml", "--config missing.yaml: no such file"),
    ("serve --set topk=0", "RocketKVConfig.topk"),
    ("serve --set budget=3", "unknown key(s) ['budget']"),
    ("serve --set topk", "expected FIELD=VALUE"),
    ("serve --chat-template missing.jinja", "--chat-template missing.jinja: no such file"),
    ("serve --chat-template broken.jinja", "--chat-template broken.jinja: not a valid Jinja template (line 1"),
    ("serve --chat-template '{% for m in messages %}'", "not a valid Jinja template"),
    ("serve --chat-template empty.jinja", "--chat-template empty.jinja: the template is empty"),
    ("serve --api-key ''", "--api-key: the key must be non-empty and hold no spaces"),
    ("serve --api-key 'two words'", "--api-key: the key must be non-empty and hold no spaces"),
    ("serve --engine turbo", "argument --engine: invalid choice: 'turbo'"),
]


def make_files(folder) -> None:
    (folder / "notes.txt").write_text("some notes\n")
    (folder / "folder").mkdir()
    (folder / "typo.yaml").write_text("sparse_attention_config:\n  prompt_budgte: 256\n")
    # a good file but for lines 4, 6 and 7: the whole file is read, not only the rows a run would use
    lines = [GOOD_ROW, GOOD_ROW, "", "", GOOD_ROW, "{", "{"]
    lines[3] = "not json"
    (folder / "late.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "types.jsonl").write_text(GOOD_ROW + "\n" + json.dumps({"context": "c", "input": "q", "answers": []}))
    (folder / "array.jsonl").write_text("[1, 2]\n")
    (folder / "blank.jsonl").write_text("\n  \n")
    (folder / "latin1.jsonl").write_bytes('{"input": "café", "outputs": ["x"]}\n'.encode("latin-1"))
    (folder / "broken.jinja").write_text("{% for message in messages %}{{ message.content }}")
    (folder / "empty.jinja").write_text("  \n")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("usage_errors")
    make_files(folder)
    return folder


@pytest.fixture
def nothing_heavy_runs(monkeypatch):
    """Fail the test if a model loads, a benchmark starts or a server is built: every row is refused before."""

    def refuse(what):
        def fail(*_args, **_kwargs):
            raise AssertionError(f"{what}: the mistake should have been reported first")

        return fail

    cli_main = importlib.import_module("hf_rocketkv.cli.main")  # the module (the package exports main())
    cli_serve = importlib.import_module("hf_rocketkv.cli.serve")
    monkeypatch.setattr(cli_main, "load_model", refuse("a model was loaded"))
    monkeypatch.setattr(cli_serve, "build_manager", refuse("the server loaded its model"))
    monkeypatch.setattr(cli_serve, "bind_socket", refuse("the server bound its port"))
    for name in ("decode", "workload"):
        fake = types.ModuleType(f"hf_rocketkv.bench.{name}")
        fake.main = refuse(f"the {name} benchmark started")
        monkeypatch.setitem(sys.modules, f"hf_rocketkv.bench.{name}", fake)


@pytest.mark.parametrize("command, expected", ROWS)
def test_a_mistake_is_short_and_comes_first(command, expected, files, monkeypatch, capsys, nothing_heavy_runs):
    import shlex

    monkeypatch.chdir(files)
    monkeypatch.delenv("HF_ROCKETKV_API_KEY", raising=False)
    argv = shlex.split(command)
    try:
        rc = main(argv)
    except SystemExit as stop:  # pragma: no cover - main() returns its status
        rc = stop.code
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert rc == 2, err
    assert 1 <= len(lines) <= 3 and "Traceback" not in err, err
    assert lines[0].startswith(f"hf-rocketkv {argv[0]}") and ": error: " in lines[0], err
    assert expected in err, err
    assert not (files / "out").exists() and not (files / "c").exists()  # nothing was written


def test_mistakes_are_found_before_transformers_is_imported(files):
    """A fresh interpreter runs a mistake of every subcommand: none of them imports transformers (their checks read
    the arguments, files and devices only), so each answers in a fraction of a second."""
    commands = ["generate --prompt hi --device gpu", "generate --prompt hi --model no/such/folder",
                "eval --task longbench:late.jsonl --output out", "bench --batch 0", "bench --out notes.txt",
                "bench --workload --budget-s 0", "warmup --cache-dir notes.txt", "serve --port 70000",
                "serve --chat-template broken.jinja", "serve --set topk=0", "generate --help", "bench --help",
                "serve --help"]
    code = f"""
        import contextlib, io, shlex, sys
        from hf_rocketkv.cli import main
        for command in {commands!r}:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                rc = main(shlex.split(command))
            print(rc, command)
        print("loaded:", sorted(m for m in ("transformers", "torch", "fastapi") if m in sys.modules))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=files, capture_output=True, text=True,
                          timeout=120, env=subprocess_env(), check=False)
    assert done.returncode == 0, done.stderr
    statuses = done.stdout.splitlines()[:-1]
    assert [line.split(" ", 1)[0] for line in statuses] == ["2"] * 10 + ["0"] * 3, done.stdout
    assert done.stdout.splitlines()[-1] == "loaded: []", done.stdout


def test_an_internal_error_is_one_line_and_exit_1_with_the_traceback_under_debug(files, monkeypatch, capsys):
    """Not a mistake in the command line: exit status 1, one line naming the error (its first line only) and how to
    see the traceback; ``--debug`` shows it."""
    cli_main = importlib.import_module("hf_rocketkv.cli.main")

    def broken(*_args, **_kwargs):
        raise RuntimeError("the kernel broke\nand a second line of detail")

    monkeypatch.setattr(cli_main, "load_model", broken)
    monkeypatch.chdir(files)
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("hf-rocketkv generate: error: RuntimeError: the kernel broke (an internal error, not a mistake in "
                   "the command line; run it again with --debug for the traceback)")
    assert main(["generate", "--prompt", "hi", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].endswith("(an internal error, not a mistake in the "
                                                                        "command line; the traceback is above)")
