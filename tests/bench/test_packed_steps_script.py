"""benchmarks.packed_steps --quick on the CPU: the script's logic (workloads parsed, both modes timed in alternation,
packed forwards counted per mode, the report's fields), not its timings."""

from __future__ import annotations

import json

import pytest

from benchmarks import packed_steps


def test_quick_run_times_both_modes_and_counts_packed_forwards(tmp_path):
    report = packed_steps.main(["--quick", "--workloads", "3x64/4", "--rounds", "1", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "packed_steps.json").read_text()) == json.loads(json.dumps(report))
    for field in ("device", "date", "commit", "command", "prefill_chunk_tokens"):
        assert report[field], field
    (row,) = report["workloads"]
    assert row["workload"] == "3x64/4"
    assert [len(row["tokens_per_s"][mode]) for mode in ("alternating", "packed")] == [1, 1]
    assert row["packed_forwards"]["alternating"] == [0]
    assert row["packed_forwards"]["packed"][0] >= 1  # prompts arrive at once: the later ones ride on decode steps
    medians = row["median_tokens_per_s"]
    assert row["packed_vs_alternating"] == pytest.approx(medians["packed"] / medians["alternating"])


@pytest.mark.parametrize("text, parsed", [("32x8192/512", (32, 8192, None, 512)),
                                          ("64x512-16384/256", (64, 16384, 512, 256))])
def test_workloads_are_parsed(text, parsed):
    assert packed_steps.parse_workload(text) == parsed
