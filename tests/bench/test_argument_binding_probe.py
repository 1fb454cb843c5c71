"""benchmarks.probes.argument_binding: both ways bind the same values, and the record has its fields."""

from __future__ import annotations

import json

from benchmarks.probes import argument_binding


def test_a_short_run_times_both_ways_and_writes_its_record(tmp_path):
    report = argument_binding.main(["--calls", "50", "--repeats", "2", "--out", str(tmp_path)])
    assert [row["forward"] for row in report["rows"]] == ["LlamaAttention.forward", "LlamaDecoderLayer.forward"]
    assert all(row["inspect_us"] > 0 and row["binder_us"] > 0 for row in report["rows"])
    assert report["command"] == "python -m benchmarks.probes.argument_binding --calls 50 --repeats 2 --out " + str(
        tmp_path)
    assert json.loads((tmp_path / "argument_binding.json").read_text())["rows"] == report["rows"]
