"""benchmarks.probes.window_prefill_ab on the CPU (``--quick``: tiny shapes; the band route needs a GPU, so both
rows run the previous path there): the rows alternate off / on per round, and the record has its fields."""

from __future__ import annotations

import json

from benchmarks.probes import window_prefill_ab
from hf_rocketkv.integration import window_prefill


def test_quick_run_alternates_the_rows_and_writes_its_record(tmp_path, capsys):
    before = window_prefill._TAKES_WINDOW
    report = window_prefill_ab.main(["--model", "gemma-3-12b", "--quick", "--prompt-len", "40", "--repeats", "1",
                                     "--rounds", "2", "--out", str(tmp_path)])
    assert window_prefill._TAKES_WINDOW is before  # the switch is put back
    assert [(r["row"], r["round"]) for r in report["rows"]] == [
        ("band off", 0), ("band on", 0), ("band off", 1), ("band on", 1)]
    assert report["first_token_equal"] and report["flash_calls_per_prefill"] == 0  # the CPU: never the band
    assert report["command"].startswith("python -m benchmarks.probes.window_prefill_ab --model gemma-3-12b --quick")
    for key in ("device", "date", "commit", "torch", "transformers", "median_ms", "on_over_off"):
        assert key in report
    assert json.loads((tmp_path / "window_prefill_ab.json").read_text())["rows"] == report["rows"]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["row"] for line in lines[:4]] == ["band off", "band on", "band off", "band on"]
    assert all({"model", "row", "prefill_ms"} <= set(line) for line in lines[:4])
