"""``hf-rocketkv bench --workload`` (hf_rocketkv/bench/workload.py): a quick run on a tiny CPU model (its numbers only
mean something on a GPU), the calls it plans, and the recompiles it counts per batch bucket."""

from __future__ import annotations

import json
import statistics

import pytest

from hf_rocketkv.bench import workload


def test_workload_bench_quick(tmp_path):
    report = workload.run(["--workload", "--quick", "--calls", "3", "--caches", "dynamic", "rocketkv-graphs",
                           "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "workload.json").read_text())
    assert set(saved["caches"]) == {"dynamic", "rocketkv-graphs"}
    for cache in ("dynamic", "rocketkv-graphs"):
        summary = saved["caches"][cache]["summary"]
        calls = saved["caches"][cache]["calls"]  # the summary's figure is the median of the calls after the first
        assert summary["calls_ok"] == 3
        assert summary["decode_ms_per_token"] == statistics.median(c["decode_ms_per_token"] for c in calls[1:])
        assert [c["context"] for c in saved["caches"][cache]["calls"]] == [c[1] for c in report["calls"]]
    assert "| rocketkv-graphs |" in report["markdown"]


def test_workload_plan_varies_lengths_and_batches():
    args = workload.build_parser().parse_args(["--calls", "6", "--batches", "1", "4", "--new-tokens", "64", "128"])
    calls = workload.plan_calls(args)
    assert [b for b, _, _ in calls] == [1, 4, 1, 4, 1, 4]
    assert len({length for _, length, _ in calls}) == 6 and all(1024 <= n <= 16384 for _, n, _ in calls)
    assert [n for _, _, n in calls] == [64, 64, 128, 128, 64, 64]


def test_workload_counts_recompiles_after_the_first_call_of_each_batch_bucket():
    from hf_rocketkv import RocketKVConfig

    rocket = RocketKVConfig()
    assert workload.batch_bucket("rocketkv-compile", rocket, 3) == 4  # torch_compile pads to its bucket
    assert workload.batch_bucket("rocketkv-graphs", rocket, 3) == 3 and workload.batch_bucket("dynamic", rocket, 3) == 3
    records = [dict(call=i, batch=b, batch_bucket=k, status="ok", wall_s=1.0, graphs_compiled=g)
               for i, (b, k, g) in enumerate([(1, 1, 1), (3, 4, 1), (1, 1, 0), (4, 4, 0), (1, 1, 2)])]
    assert [r["call"] for r in workload.after_warm_up(records)] == [2, 3, 4]
    summary = workload.summarise("rocketkv-compile", records)
    assert summary["recompiles_after_first"] == 3 and summary["recompiles_after_warm_up"] == 2


def test_workload_summary_times():
    """Medians over the calls after the first (wall time, ms/token), TTFT over every call that ran, the first call
    alone, failed calls left out."""
    calls = [(10.0, 1.0, 50.0, 2.0), (2.0, 0.2, 10.0, 3.0), (3.0, 0.4, 12.0, 2.5), None, (4.0, 0.3, 14.0, 1.0)]
    records = [{"call": i, "batch": 1, "status": "oom"} if c is None else
               {"call": i, "batch": 1, "status": "ok", "graphs_compiled": 0, "wall_s": c[0], "prefill_s": c[1],
                "decode_ms_per_token": c[2], "peak_gib": c[3]} for i, c in enumerate(calls)]
    got = workload.summarise("dynamic", records)
    assert got["calls_ok"] == 4 and got["first_call_s"] == 10.0
    assert got["warm_call_s"] == 3.0  # median of 2, 3, 4
    assert got["ttft_s"] == pytest.approx(0.35)  # median of 1.0, 0.2, 0.4, 0.3
    assert got["decode_ms_per_token"] == 12.0  # median of 10, 12, 14 (the first call's 50 left out)
    assert got["peak_gib"] == 3.0
    one = workload.summarise("dynamic", records[:1])
    assert one["warm_call_s"] is None and one["decode_ms_per_token"] == 50.0  # no later call: the first one's
