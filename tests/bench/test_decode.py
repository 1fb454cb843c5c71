"""``hf-rocketkv bench`` (hf_rocketkv/bench/decode.py) on a tiny CPU model: the pool rows run beside the private-page
row (their numbers only mean something on a GPU)."""

from __future__ import annotations


def test_decode_bench_pool_rows_quick(tmp_path):
    """The pool rows (model-dtype and fp8 pool pages) beside the private-page row: each ran, each pool sized for
    its run's prefill peak and every page back in it after the row (the next row's pool would not fit otherwise)."""
    from hf_rocketkv.bench import decode

    caches = ["rocketkv-graphs", "rocketkv-graphs-pool", "rocketkv-graphs-pool-fp8"]
    report = decode.run(["--quick", "--batch", "2", "--context", "96", "--caches", *caches, "--no-plot",
                         "--out", str(tmp_path)])
    rows = {r["cache"]: r for r in report["rows"]}
    assert set(rows) == set(caches)
    for cache in caches:
        assert rows[cache]["status"] == "ok" and rows[cache]["decode_ms_per_token"] > 0, rows[cache]
        assert rows[cache]["new_tokens"] == 6
    assert rows["rocketkv-graphs"]["attn_ms"] is not None and rows["rocketkv-graphs-pool"]["attn_ms"] is None
