"""The chunked-prefill benchmarks' --quick runs on the CPU: their logic and their reports' fields, not their timings.

- benchmarks.probes.profile_chunked_prefill: every chunk of the prompt timed for RocketKV's ChunkedPrefill and for
  transformers' DynamicCache over the same chunks, the profiled chunks reported;
- benchmarks.probes.decode_beside_prefill: the running requests decode alone and while a second thread prefills a long
  prompt; every page comes back to both pools.
"""

from __future__ import annotations

import json
import math

from benchmarks.probes import decode_beside_prefill
from benchmarks.token_sink import TokenRecorder
from benchmarks.probes.profile_chunked_prefill import main as profile_main


def test_profile_chunked_prefill_times_every_chunk_both_ways(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["profile_chunked_prefill", "--quick", "--profile", "--chunks", "64,128",
                                     "--out", str(tmp_path)])
    profile_main()
    report = json.loads((tmp_path / "profile_chunked_prefill.json").read_text())
    assert report["prompt_len"] == 256 and set(report["chunks"]) == {"64", "128"}
    for chunk, entry in report["chunks"].items():
        expected = math.ceil(256 / int(chunk))
        assert entry["rocketkv"]["chunks"] == entry["dynamic"]["chunks"] == expected, chunk
        assert entry["median_ratio"] == entry["rocketkv"]["median_ms"] / entry["dynamic"]["median_ms"]
        assert {"profile_last_chunk"} <= set(entry), chunk


def test_decode_beside_prefill_measures_both_windows(tmp_path):
    rc = decode_beside_prefill.main(["--quick", "--decode-priority", "default", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "decode_beside_prefill.json").read_text())
    assert rc == 0, report
    assert report["command"].startswith("python -m benchmarks.probes.decode_beside_prefill --quick")
    (label, result), = report["settings"].items()
    assert label == "chunk128_default" and "error" not in result, result
    assert result["pages_back"]
    for window in ("alone", "beside"):
        assert 0 < result[window]["itl_p50_s"] <= result[window]["itl_p99_s"], window
    assert result["itl_p99_over_alone_p50"] == result["beside"]["itl_p99_s"] / result["alone"]["itl_p50_s"]
    assert len(result["beside"]["prefill_s"]) == report["args"]["arrivals"] == 1
    assert result["rate_ratio"] >= 0  # 0 would be a measured stall, not a missing value


def test_the_gap_that_spans_a_short_window_counts():
    """A window shorter than one decode step holds no two tokens of a request; the gap across it is what the user
    waited (hand-made arrival times: the oracle is the arithmetic)."""
    times = TokenRecorder()
    times.token_times = {"a": [0.0, 1.0, 3.0, 3.5], "b": [0.5, 2.5]}
    got = decode_beside_prefill.gap_quantiles(times, ["a", "b"], start=1.5, end=2.0)
    assert got == {"itl_p50_s": 2.0, "itl_p99_s": 2.0}  # a: 1.0 -> 3.0, b: 0.5 -> 2.5
    got = decode_beside_prefill.gap_quantiles(times, ["a"], start=0.9, end=3.2)  # every gap of a touches the window
    assert got == {"itl_p50_s": 1.0, "itl_p99_s": 2.0}  # gaps 1.0, 2.0, 0.5
    assert decode_beside_prefill.gap_quantiles(times, ["a"], start=4.0, end=5.0) == {"itl_p50_s": None,
                                                                                     "itl_p99_s": None}
