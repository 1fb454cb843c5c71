"""``hf-rocketkv bench`` on a machine without the memory for it, and ``--device cuda`` on a machine without CUDA: a
refusal in two lines and exit status 2, found before torch is imported (bench/fit.py, cli/checks.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from hf_rocketkv.bench import fit
from hf_rocketkv.bench.options import decode_parser
from hf_rocketkv.cli import main
from hf_rocketkv.cli import checks
from tests.support.repo import subprocess_env

GiB = 2**30


@pytest.fixture
def fake_benchmarks(monkeypatch):
    """The benchmarks replaced by fakes that record their argv (a refused run never reaches them)."""
    started = []
    for name in ("decode", "workload"):
        fake = types.ModuleType(f"hf_rocketkv.bench.{name}")
        fake.main = lambda argv, name=name: started.append((name, argv)) or 0
        monkeypatch.setitem(sys.modules, f"hf_rocketkv.bench.{name}", fake)
    return started


@pytest.mark.parametrize("argv, first", [
    (["bench", "--workload"], "the largest call ("),
    (["bench"], "the smallest point (rocketkv, batch 1 x 8192 prompt tokens + 32 new)"),
    (["bench", "--device", "cpu", "--context", "4096"], "the smallest point (dynamic, batch 1 x 4096 prompt"),
])
def test_a_run_that_cannot_fit_is_refused_with_the_estimate(argv, first, monkeypatch, capsys, tmp_path,
                                                            fake_benchmarks):
    monkeypatch.chdir(tmp_path)
    cli_main = importlib.import_module("hf_rocketkv.cli.main")
    monkeypatch.setattr(cli_main, "cuda_absent_reason", lambda: "test: no CUDA")
    monkeypatch.setattr(fit, "host_available_bytes", lambda: (8 * GiB, "test"))
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"hf-rocketkv bench: error: {first}"), lines
    assert "Llama-3.1-8B-shaped model (32 layers, float32)" in lines[0] and "8.0 GiB free on the CPU (test)" in lines[0]
    assert lines[1].startswith("pass --quick") and fake_benchmarks == []


def test_a_run_that_fits_starts(monkeypatch, tmp_path, fake_benchmarks):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fit, "host_available_bytes", lambda: (8 * GiB, "test"))
    assert main(["bench", "--quick", "--no-plot"]) == 0
    assert main(["bench", "--workload", "--quick", "--calls", "2"]) == 0
    assert [name for name, _ in fake_benchmarks] == ["decode", "workload"]


def test_on_a_cuda_machine_the_gpu_is_checked_by_the_benchmark_not_the_host(monkeypatch, tmp_path, fake_benchmarks):
    """Where CUDA may be present the command line cannot know the GPU's memory without torch: the benchmark checks it
    before building its model (tests/bench/test_fit.py)."""
    monkeypatch.chdir(tmp_path)
    cli_main = importlib.import_module("hf_rocketkv.cli.main")
    monkeypatch.setattr(cli_main, "cuda_absent_reason", lambda: None)
    monkeypatch.setattr(fit, "host_available_bytes", lambda: (GiB, "test"))
    assert main(["bench", "--workload"]) == 0 and fake_benchmarks[0][0] == "workload"


def test_torch_build_is_read_without_importing_torch():
    version, gpu_build = checks.torch_build()
    assert version == torch.__version__
    assert gpu_build == (torch.version.cuda is not None or torch.version.hip is not None)


def test_cuda_absence_from_the_build_the_driver_and_the_platform(monkeypatch, tmp_path):
    monkeypatch.setattr(checks, "torch_build", lambda: ("9.9+cpu", False))
    assert checks.cuda_absent_reason() == "torch 9.9+cpu is a build without CUDA"
    monkeypatch.setattr(checks, "torch_build", lambda: ("9.9+cu130", True))
    driver = tmp_path / "nvidia0"
    traces = (str(tmp_path / "nvidia*"),)
    assert checks.cuda_absent_reason(traces, "linux").startswith("no NVIDIA driver is loaded")
    driver.write_text("")
    assert checks.cuda_absent_reason(traces, "linux") is None  # a driver: torch is asked
    assert checks.cuda_absent_reason(traces, "win32") is None  # no cheap answer there: torch is asked
    assert checks.cuda_absent_reason(traces, "darwin") == "CUDA does not run on macOS"
    monkeypatch.setattr(checks, "torch_build", lambda: (None, None))  # version.py unreadable: only the driver counts
    assert checks.cuda_absent_reason(traces, "linux") is None


def decode_default_needs() -> int:
    """Bytes the decode benchmark's smallest default point needs on the CPU (float32)."""
    args = decode_parser().parse_args([])
    with pytest.raises(fit.WontFit):
        fit.check_bench(args, workload=False, device_type="cpu", available=1, where="", prompt_budget=2048,
                        prefill_batch_size=None)
    shapes = fit.Shapes.of(fit.LLAMA_31_8B)
    return shapes.parameters() * 4 + fit.state_bytes(shapes, 4, "rocketkv", 1, 8192, 32, 2048)


@pytest.mark.skipif(checks.cuda_absent_reason() is None, reason="this machine may have CUDA")
def test_the_refusals_come_before_torch_is_imported(tmp_path):
    """As a user runs them, in a fresh interpreter: no torch, so each answers in a fraction of a second."""
    commands = ["generate --prompt hi --device cuda", "bench --device cuda:1", "serve --device cuda",
                "warmup --cache-dir c --device cuda"]
    available, _ = fit.host_available_bytes()
    if available is not None and available * 0.92 < decode_default_needs():
        commands += ["bench", "bench --workload"]  # an 8B-shaped model does not fit in this machine's memory
    code = f"""
        import contextlib, io, shlex, sys
        from hf_rocketkv.cli import main
        for command in {commands!r}:
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                rc = main(shlex.split(command))
            print(rc, len(err.getvalue().strip().splitlines()), command)
        print("loaded:", sorted(m for m in ("transformers", "torch") if m in sys.modules))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=subprocess_env(), check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" ", 2)[:2] for line in lines[:-1]] == [["2", "1"]] * 4 + [["2", "2"]] * (len(commands) - 4)
    assert lines[-1] == "loaded: []", done.stdout
