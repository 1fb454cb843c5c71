"""benchmarks.bench_prefix_reuse --quick on CPU: step 8 (batch x shared prefix memory) runs with no earlier step's
pool alive, so its peak is the weights, its own pool and the generate() call only.

What it guards against: a loop that closes the earlier caches but keeps the last one in a local variable through the
new pool's allocation (a closed cache still holds its pool), or a pool in a reference cycle (freed only by a full
garbage collection), keeps an earlier step's pool alive; on an H100 that put step 4's 24 GiB pool into step 8's
70.0 GiB peak.
"""

from __future__ import annotations

import json
import sys
import weakref


def test_step_8_runs_without_the_earlier_steps_pools(tmp_path, monkeypatch):
    from benchmarks import bench_prefix_reuse as bench

    events: list = []  # ("pool", weakref) for each pool made, ("generate", None) after each request

    def stale_pools() -> list:
        """Pools made before the latest request that are still alive."""
        last = max((i for i, (kind, _) in enumerate(events) if kind == "generate"), default=-1)
        return [ref for kind, ref in events[:last + 1] if kind == "pool" and ref() is not None]

    stale_at = []  # (when, stale pools) at each pool's creation and at step 8's request

    class TrackedPool(bench.KVBlockPool):
        def __init__(self, *args, **kwargs):
            stale_at.append(("new pool", stale_pools()))
            super().__init__(*args, **kwargs)
            events.append(("pool", weakref.ref(self)))

    timed = bench.generate

    def generate(model, ids, cache, new_tokens, **kwargs):
        if cache.config.prefill_batch_size == 1:  # step 8
            stale_at.append(("step 8", [ref for ref in stale_pools() if ref() is not cache.pool]))
        result = timed(model, ids, cache, new_tokens, **kwargs)
        events.append(("generate", None))
        return result

    monkeypatch.setattr(bench, "KVBlockPool", TrackedPool)
    monkeypatch.setattr(bench, "generate", generate)
    monkeypatch.setattr(sys, "argv", ["bench_prefix_reuse.py", "--quick", "--out", str(tmp_path)])
    bench.main()

    report = json.loads((tmp_path / "bench_prefix_reuse.json").read_text())
    steps = report["steps"]
    assert all(step["status"] == "ok" for step in steps.values()), steps
    assert sum(kind == "pool" for kind, _ in events) >= 4  # warm-up, step 4 (used by 5 and 6), step 8's two
    assert [when for when, _ in stale_at].count("step 8") == 1
    # the earlier requests' pools are gone before step 8 allocates its own, and during its request
    assert [(when, len(stale)) for when, stale in stale_at if stale] == []
    # steps 5 and 6 time several hits, each on a suffix no request had, so each reuses exactly the shared prefix
    # (a repeat of the same prompt would reuse its suffix pages too and look faster); the ratio is the median's
    cold = steps["4_pool_cold_A"]["ttft_s"]
    for name in ("5_pool_prefix_on_device_B", "6_pool_prefix_from_host_C"):
        runs = steps[name]["ttft_s_runs"]
        assert len(runs) == 5
        assert steps[name]["repeats_reused_tokens"] == [256] * 4  # --quick: a 256-token prefix
        assert abs(steps[name]["ttft_s_median"] - sorted(runs)[2]) < 1e-4  # runs are rounded to 0.1 ms
        assert steps[name]["ttft_ratio_to_cold"] == steps[name]["ttft_s_median"] / cold
