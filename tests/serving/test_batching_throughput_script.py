"""benchmarks.batching_throughput drives hf_rocketkv's engine and transformers' continuous batching (``--engine
transformers``) through the same workload: the same prompts at the same arrival times, every request finished with
the tokens it asked for, and the report fields the docs' tables read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import batching_throughput


def _run(engine: str, out: Path) -> dict:
    rc = batching_throughput.main(["--quick", "--engine", engine, "--skip-fixed", "--rates", "4", "--out", str(out)])
    report = json.loads((out / "batching_throughput.json").read_text())
    assert rc == 0, report
    return report


@pytest.mark.slow
def test_both_engines_serve_the_same_mixed_workload(tmp_path):
    ours = _run("rocketkv", tmp_path / "rocketkv")
    theirs = _run("transformers", tmp_path / "transformers")
    assert "fixed" not in ours["steps"] and "fixed" not in theirs["steps"]  # --skip-fixed
    for report in (ours, theirs):
        mixed = report["steps"]["mixed_rate_4"]
        assert mixed["requests"] == 4 and mixed["finished"] == {"length": 4}, mixed
        assert mixed["output_tokens"] == 4 * 6  # --quick: 6 new tokens each, every one streamed back
        assert mixed["tokens_per_s_per_gpu"] == pytest.approx(mixed["output_tokens"] / mixed["wall_s"])
        assert 0 < mixed["ttft_p50_s"] <= mixed["wall_s"]
        assert mixed["per_user_tokens_per_s_p50"] is not None
    assert ours["steps"]["mixed_rate_4"]["workload"] == theirs["steps"]["mixed_rate_4"]["workload"]
    assert theirs["setup"]["engine"] == "transformers" and "pool_pages" in ours["setup"]


@pytest.mark.slow
def test_engine_both_runs_the_same_arrivals_on_each_and_plots_both(tmp_path):
    """--engine both: our steps, then transformers' on the same mixed arrivals (same prompt lengths), one curve
    point per engine and rate, and the plot."""
    report = _run("both", tmp_path)
    ours, theirs = report["steps"]["mixed_rate_4"], report["transformers_steps"]["mixed_rate_4"]
    assert ours["workload"] == theirs["workload"]
    for mixed in (ours, theirs):
        assert mixed["finished"] == {"length": 4} and mixed["output_tokens"] == 4 * 6, mixed
        # every inter-token gap lies inside the step's wall time (p99 >= p50 holds by construction: not a check)
        assert 0 < mixed["itl_p50_s"] <= mixed["itl_p99_s"] <= mixed["wall_s"]
    assert [len(points) for points in report["curve"].values()] == [1, 1]
    assert report["args"]["engine"] == "both" and (tmp_path / "mixed_curve.png").stat().st_size > 0


@pytest.mark.slow
def test_fp8_pool_pages_serve_the_workload(tmp_path):
    """--kv-cache-dtype fp8: the engine serves the same workload on e4m3 pool pages (every request finished)."""
    out = tmp_path / "fp8"
    rc = batching_throughput.main(["--quick", "--skip-fixed", "--rates", "4", "--kv-cache-dtype", "fp8", "--out",
                                   str(out)])
    report = json.loads((out / "batching_throughput.json").read_text())
    assert rc == 0, report
    assert report["setup"]["pool_dtype"] == "float8_e4m3fn"
    mixed = report["steps"]["mixed_rate_4"]
    assert mixed["finished"] == {"length": 4} and mixed["output_tokens"] == 4 * 6, mixed


def test_summary_arithmetic_on_synthetic_token_times():
    """Recorder.summary from hand-made arrival times: tokens/s = every output token / wall time, TTFT = first token
    - submit, a user's rate = (tokens - 1) / (last - first token), percentiles by nearest rank."""
    from types import SimpleNamespace

    from hf_rocketkv.serving.outputs import FinishReason

    recorder = batching_throughput.Recorder()
    recorder.submitted = {"a": 0.0, "b": 1.0, "c": 2.0}
    recorder.token_times = {"a": [0.5, 1.5, 2.5, 3.5, 4.5],  # TTFT 0.5, 4 gaps in 4 s: 1 token/s
                            "b": [1.25, 1.75, 2.25],  # TTFT 0.25, 2 gaps in 1 s: 2 tokens/s
                            "c": [4.0]}  # TTFT 2.0, one token: no rate
    recorder.finals = {rid: SimpleNamespace(finish_reason=FinishReason.LENGTH, error=None) for rid in "ab"}
    recorder.finals["c"] = SimpleNamespace(finish_reason=FinishReason.ERROR, error="boom")
    got = recorder.summary(start=0.0, end=4.5)
    assert got["output_tokens"] == 9 and got["wall_s"] == 4.5
    assert got["tokens_per_s"] == pytest.approx(2.0)
    assert got["finished"] == {"length": 2, "error": 1} and got["errors"] == ["boom"]
    assert got["ttft_p50_s"] == 0.5 and got["ttft_p99_s"] == 2.0  # of 0.25, 0.5, 2.0
    assert got["per_user_tokens_per_s_p50"] == pytest.approx(1.0) and got["per_user_tokens_per_s_p10"] == 1.0
    # inter-token gaps pooled: a's 1, 1, 1, 1 and b's 0.5, 0.5 -> nearest rank 3 of 6 is 1.0, the 25th 0.5
    assert got["itl_p50_s"] == 1.0 and got["itl_p99_s"] == 1.0
    assert batching_throughput.percentile([1.0, 1.0, 1.0, 1.0, 0.5, 0.5], 25) == 0.5
    assert batching_throughput.percentile([4, 1, 3, 2], 50) == 2 and batching_throughput.percentile([4, 1, 3, 2], 75) == 3
    assert batching_throughput.percentile([], 50) is None
