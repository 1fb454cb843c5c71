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
        assert mixed["tokens_per_s_per_gpu"] > 0 and mixed["ttft_p50_s"] is not None
        assert mixed["per_user_tokens_per_s_p50"] is not None
    assert ours["steps"]["mixed_rate_4"]["workload"] == theirs["steps"]["mixed_rate_4"]["workload"]
    assert theirs["setup"]["engine"] == "transformers" and "pool_pages" in ours["setup"]


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
