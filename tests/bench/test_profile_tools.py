"""The profile helpers of benchmarks/ that turn a trace into numbers (``profile_prefix_hit.gpu_gaps``) and time host
functions (``prefill_host_time.Timers``), on hand-made inputs whose answers are worked out by hand below."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from tests.support.repo import ROOT


@pytest.fixture(scope="module")
def tools():
    return {name: importlib.import_module(f"benchmarks.probes.{name}") for name in ("profile_prefix_hit", "prefill_host_time")}


def event(name, ts, dur, cat, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "pid": 1}


def test_gpu_gaps_charges_idle_time_to_what_the_host_was_doing(tools, tmp_path):
    # window 0..100 us on thread 1; the GPU works 10..30 and 50..60 (two overlapping kernels in the first span);
    # the host is in f1 (0..40, with aten::cat 30..35 inside) then in f2 (40..100). Another thread's function is
    # ignored. Idle: 0..10, 30..50, 60..100 = 70 us; f1: 10 + 10, f2: 10 + 40; aten::cat: 5.
    trace = {"traceEvents": [
        event("engine.py(1): _prefill", 0, 100, "python_function"),
        event("hf_rocketkv/a.py(1): f1", 0, 40, "python_function"),
        event("hf_rocketkv/b.py(2): f2", 40, 60, "python_function"),
        event("hf_rocketkv/c.py(3): other_thread", 0, 100, "python_function", tid=2),
        event("aten::cat", 30, 5, "cpu_op"),
        event("kernel_a", 10, 15, "kernel", tid=7),
        event("kernel_b", 20, 10, "kernel", tid=7),
        event("memcpy", 50, 10, "gpu_memcpy", tid=7),
    ]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    report = tools["profile_prefix_hit"].gpu_gaps(path, "_prefill", step_us=1.0)
    assert report["window_ms"] == pytest.approx(0.100)
    assert report["device_busy_ms"] == pytest.approx(0.030)
    assert report["device_idle_ms"] == pytest.approx(0.070)
    assert report["idle_before_first_kernel_ms"] == pytest.approx(0.010)
    assert report["idle_after_last_kernel_ms"] == pytest.approx(0.040)
    ours = {row["name"]: row["idle_ms"] for row in report["idle_by_our_function"]}
    assert ours == {"hf_rocketkv/b.py(2): f2": pytest.approx(0.050), "hf_rocketkv/a.py(1): f1": pytest.approx(0.020)}
    ops = {row["name"]: row["idle_ms"] for row in report["idle_by_op"]}
    assert ops["aten::cat"] == pytest.approx(0.005)
    assert ops["(none)"] == pytest.approx(0.065)


def test_gpu_gaps_says_when_the_window_function_is_missing(tools, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [event("x.py(1): other", 0, 10, "python_function")]}))
    assert "no python_function" in tools["profile_prefix_hit"].gpu_gaps(path, "_prefill")["error"]


class Target:
    def work(self, n):
        return n + 1


def test_timers_count_calls_and_put_the_originals_back(tools):
    module = tools["prefill_host_time"]
    timers = module.Timers()
    original = Target.__dict__["work"]
    with module.patched(timers, ((__name__, "Target.work"), (__name__, "Target.missing"))) as skipped:
        assert Target().work(1) == 2 and Target().work(2) == 3
    assert Target.__dict__["work"] is original
    assert skipped == [f"{__name__}:Target.missing"]
    assert timers.calls == {"Target.work": 2} and timers.seconds["Target.work"] >= 0



def _busy(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def test_cprofile_top_ranks_the_function_that_did_the_work(tools):
    """The function that does the work of ``fn`` (a plain loop: its time is its own) tops the own-time ranking,
    counted once per call; cumulative time is never below own time; no hf_rocketkv code ran."""
    module = tools["prefill_host_time"]
    report = module.cprofile_top(lambda: [_busy(300_000) for _ in range(3)], rows=3)
    rows = report["by_own_time"]
    assert len(rows) == 3  # _busy, the lambda, its list comprehension, the profiler's disable: at most 3 kept
    assert rows[0]["function"].endswith("(_busy)") and rows[0]["calls"] == 3
    assert rows[0]["own_ms"] > 10 * rows[1]["own_ms"]
    assert all(r["cumulative_ms"] >= r["own_ms"] for r in rows)
    assert report["hf_rocketkv_by_cumulative"] == []


def test_decode_host_time_quick_profiles_only_the_decode_steps(tmp_path):
    """The eager decode host-time script on the tiny CPU model: both caches timed, and its cProfile window holds
    decode steps only (RocketKV's decode attention ran, stage 1's compaction at the end of the prefill did not)."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", "benchmarks.probes.decode_host_time", "--quick", "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "decode_host_time.json").read_text())
    assert report["eager_ms_per_token"]["rocketkv"] > 0 and report["eager_ms_per_token"]["dynamic"] > 0
    ours = [r["function"] for r in report["cprofile"]["hf_rocketkv_by_cumulative"]]
    assert any("decode_attention" in f for f in ours)
    assert not any("finish_prefill" in f or "compact" in f for f in ours), ours


def test_hybrid_step_profile_sorts_kernels_by_kind():
    probe = importlib.import_module("benchmarks.probes.profile_hybrid_step")
    assert probe.kind_of("nvjet_tst_128x64_64x8_1x1_v_bz_TNT") == "gemm"
    assert probe.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert probe.kind_of("pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert probe.kind_of("_page_logits_kernel") == "rocketkv triton"
    assert probe.kind_of("_rms_norm_kernel") == "norm and rope"
    assert probe.kind_of("void at::native::index_elementwise_kernel<...>") == "copy and index"
    assert probe.kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise and reduce"
    assert probe.kind_of("something_else") == "other"
