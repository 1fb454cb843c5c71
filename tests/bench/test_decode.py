"""``hf-rocketkv bench`` (hf_rocketkv/bench/decode.py) on a tiny CPU model: the pool rows run beside the private-page
row (their numbers only mean something on a GPU); and the arithmetic from step times to the reported columns
(ms/token, tokens/s, GB/s, ratios, the workload summary) on synthetic timings."""

from __future__ import annotations

import pytest


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
        row = rows[cache]  # tokens/s: the batch (2) over the step time
        assert row["status"] == "ok" and row["tokens_per_s"] == pytest.approx(2e3 / row["decode_ms_per_token"]), row
        assert rows[cache]["new_tokens"] == 6
    assert rows["rocketkv-graphs"]["attn_ms"] is not None and rows["rocketkv-graphs-pool"]["attn_ms"] is None


def test_decode_bench_switch_off_rows_quick(tmp_path):
    """The ``-norm-off`` / ``-rope-off`` rows run with only their fused path off, beside the rows with it on."""
    from hf_rocketkv import RocketKVConfig
    from hf_rocketkv.bench import decode

    base = RocketKVConfig()
    for cache, runner in (("rocketkv-norm-off", base.decode_runner), ("rocketkv-graphs-norm-off", "cuda_graphs")):
        config = decode.rocket_for_row(base, cache)
        assert (config.fused_norm, config.fused_rope, config.decode_runner) == (False, True, runner)
    config = decode.rocket_for_row(base, "rocketkv-graphs-rope-off")
    assert (config.fused_norm, config.fused_rope) == (True, False)
    caches = ["rocketkv-norm-off", "rocketkv-graphs-norm-off"]
    report = decode.run(["--quick", "--batch", "1", "--context", "64", "--caches", *caches, "--no-plot",
                         "--out", str(tmp_path)])
    rows = {r["cache"]: r for r in report["rows"]}
    assert set(rows) == set(caches)
    assert all(row["status"] == "ok" and row["tokens_per_s"] == pytest.approx(1e3 / row["decode_ms_per_token"])
               for row in rows.values()), rows


# ------------------------------------------------------------------------------------------------ the arithmetic
# The numbers docs/benchmarks.md quotes come from these functions; synthetic timings with hand-computed results.
def test_step_timings_median_of_the_steady_gaps_in_ms():
    from hf_rocketkv.bench.decode import DROP_FIRST_STEPS, step_timings

    assert DROP_FIRST_STEPS == 3
    # first token at 0.5 s (TTFT); gaps 0.1 0.1 0.1 (warm-up, dropped) then 0.02 0.02 0.02 0.04 0.02: median 20 ms
    got = step_timings([0.5, 0.6, 0.7, 0.8, 0.82, 0.84, 0.86, 0.90, 0.92])
    assert got == {"prefill_s": 0.5, "decode_ms_per_token": pytest.approx(20.0), "new_tokens": 9}
    # 6 gaps (more than DROP_FIRST_STEPS + 2): the first 3 are dropped, median of 0.5 0.5 0.5 s
    assert step_timings([0, 1, 2, 3, 3.5, 4.0, 4.5])["decode_ms_per_token"] == pytest.approx(500.0)
    # 5 gaps: too few to drop any, median of 1 1 1 0.5 0.5 s
    assert step_timings([0, 1, 2, 3, 3.5, 4.0])["decode_ms_per_token"] == pytest.approx(1000.0)
    # 2 gaps (0.1, 0.2): the median of an even count is the mean of the middle two
    assert step_timings([1.0, 1.1, 1.3]) == {"prefill_s": 1.0, "decode_ms_per_token": pytest.approx(150.0),
                                             "new_tokens": 3}
    assert step_timings([0.3]) == {"prefill_s": 0.3, "decode_ms_per_token": None, "new_tokens": 1}
    assert step_timings([]) == {"prefill_s": None, "decode_ms_per_token": None, "new_tokens": 0}


def test_step_clock_times_tokens_from_the_start():
    import torch

    from hf_rocketkv.bench.decode import StepClock

    clock = StepClock(torch.device("cpu"))
    clock.t0, clock.times = 10.0, [10.5, 10.75]
    assert clock.seconds() == [0.5, 0.75]


def test_rates_tokens_per_s_and_bandwidth():
    from hf_rocketkv.bench.decode import Row

    # batch 4 at 20 ms per step: 4 tokens every 20 ms = 200 tokens/s; 1e9 bytes in 0.5 ms = 2000 GB/s
    row = Row("rocketkv", batch=4, context=8, decode_ms_per_token=20.0, attn_ms=0.5, attn_graph_ms=0.25,
              attn_bytes=10**9)
    row.fill_rates()
    assert row.tokens_per_s == pytest.approx(200.0)
    assert row.attn_GBps == pytest.approx(2000.0) and row.attn_graph_GBps == pytest.approx(4000.0)
    untimed = Row("rocketkv-graphs-pool", batch=2, context=8, attn_bytes=10**9)
    untimed.fill_rates()
    assert untimed.tokens_per_s is None and untimed.attn_GBps is None and untimed.attn_graph_GBps is None


def test_ratio_vs_dynamic_and_the_markdown_row():
    from hf_rocketkv.bench.decode import Row, _ratios, markdown

    rows = [Row("dynamic", 1, 8, decode_ms_per_token=40.0), Row("rocketkv", 1, 8, decode_ms_per_token=10.0),
            Row("rocketkv", 2, 8, decode_ms_per_token=12.0), Row("dynamic", 1, 16, status="out of memory"),
            Row("rocketkv", 1, 16, decode_ms_per_token=11.0)]
    _ratios(rows)
    assert [r.ratio_vs_dynamic for r in rows] == [1.0, 0.25, None, None, None]  # only against the same batch, context
    rows[1].tokens_per_s, rows[1].prefill_s = 100.0, 1.234
    table = markdown(rows).splitlines()
    assert table[3] == ("| rocketkv | 1 | 8 | ok | 10.00 | 100.0 | 1.23 | - | - / - | - / - | 0.25 |")



def test_a_row_records_a_run_skips_by_its_estimate_and_refuses_unknown_columns():
    from hf_rocketkv.bench.decode import Row

    row = Row("rocketkv", batch=2, context=8)
    row.record(dict(decode_ms_per_token=10.0, peak_gib=1.5, prefill_rows=None), ((0.5, None), 10**9))
    assert (row.tokens_per_s, row.attn_ms, row.attn_graph_ms, row.attn_GBps) == (200.0, 0.5, None, 2000.0)
    assert row.peak_gib == 1.5 and row.status == "ok"
    with pytest.raises(ValueError, match=r"Row.record: no column named \['speed'\]"):
        Row("rocketkv", 1, 8).record(dict(speed=1.0), ((0.1, 0.1), 1))
    skipped = Row("dynamic", 64, 32768)
    skipped.skip(300 * 2**30, 128.6 * 2**30)
    assert skipped.status == "skipped: needs ~300 GiB > 129 GiB" and skipped.estimate_gib == 300.0
