"""``hf-rocketkv bench --workload`` (hf_rocketkv/bench/workload.py): a quick run on a tiny CPU model (its numbers only
mean something on a GPU), the calls it plans, and the recompiles it counts per batch bucket."""

from __future__ import annotations

import json

from hf_rocketkv.bench import workload


def test_workload_bench_quick(tmp_path):
    report = workload.run(["--workload", "--quick", "--calls", "3", "--caches", "dynamic", "rocketkv-graphs",
                           "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "workload.json").read_text())
    assert set(saved["caches"]) == {"dynamic", "rocketkv-graphs"}
    for cache in ("dynamic", "rocketkv-graphs"):
        summary = saved["caches"][cache]["summary"]
        assert summary["calls_ok"] == 3 and summary["decode_ms_per_token"] > 0
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
