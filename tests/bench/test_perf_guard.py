"""benchmarks/perf_guard.py: the verdict on fabricated measurements (a ratio below its floor fails, at or above it
passes, a case that could not be measured fails, a device without floors is not judged), the choice of the previous
result, the floor file's checks, the ``--judge`` dry run's exit status, and the ``--quick`` run on the CPU end to end.
The floors below are written out by hand: value of record 3.0 with a tolerance of 10% is a floor of 2.7."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import perf_guard

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {"devices": {"gpu-x": {
    "decode_bs1_32k": {"metric": "m", "value_of_record": 3.0, "tolerance": 0.1, "source": "results/a.json"},
    "engine_32x8k": {"metric": "m", "value_of_record": 1000.0, "tolerance": 0.2, "source": "results/b.json"},
}}}


def decode(rocket_ms: float, static_ms: float) -> dict:
    return {"rocketkv_ms": rocket_ms, "baseline_ms": static_ms, "ratio": static_ms / rocket_ms}


@pytest.mark.parametrize("rocket_ms, static_ms, status", [
    (6.0, 18.0, "ok"),       # 3.00x
    (6.0, 16.2, "ok"),       # 2.70x: exactly the floor
    (6.0, 16.1, "FAIL"),     # 2.68x
    (7.5, 17.6, "FAIL"),     # 2.35x: RocketKV 25% slower
    (6.0, 60.0, "ok"),       # a slow StaticCache kernel: a high ratio never fails
])
def test_the_decode_speedup_is_judged_against_its_floor(rocket_ms, static_ms, status):
    (verdict,) = perf_guard.judge({"decode_bs1_32k": decode(rocket_ms, static_ms)}, FLOORS, "gpu-x")
    assert verdict.status == status and verdict.floor == pytest.approx(2.7)
    assert verdict.line.startswith(f"{status} decode_bs1_32k: speed-up {static_ms / rocket_ms:.2f}x")
    assert "floor 2.70x (3.00x of record less 10%)" in verdict.line


@pytest.mark.parametrize("rocket_ms, static_ms, status", [
    (6.0, 18.0, "ok"),       # 3.00x, RocketKV at its record
    (6.6, 19.8, "ok"),       # RocketKV exactly at the ceiling (6.0 + 10%)
    (6.7, 60.0, "FAIL"),     # 8.96x beside a baseline that ran slow: RocketKV 12% slower than its record fails
    (5.0, 13.6, "ok"),       # faster than its record, 2.72x
])
def test_a_speedup_floor_with_an_ms_of_record_fails_a_slower_rocketkv_whatever_the_ratio(rocket_ms, static_ms,
                                                                                          status):
    floor = {**FLOORS["devices"]["gpu-x"]["decode_bs1_32k"], "rocketkv_ms_of_record": 6.0}
    floors = {"devices": {"gpu-x": {"decode_bs1_32k": floor}}}
    (verdict,) = perf_guard.judge({"decode_bs1_32k": decode(rocket_ms, static_ms)}, floors, "gpu-x")
    assert verdict.status == status
    assert verdict.line.endswith("ceiling 6.60 ms (6.00 ms of record plus 10%)")


@pytest.mark.parametrize("tokens_per_s, previous, status, ratio", [
    (900.0, {"tokens_per_s": 1000.0, "source": "results/perf_guard/gpu-x_old.json"}, "ok", 0.9),
    (800.0, {"tokens_per_s": 1000.0, "source": "results/perf_guard/gpu-x_old.json"}, "ok", 0.8),  # the floor
    (790.0, {"tokens_per_s": 1000.0, "source": "results/perf_guard/gpu-x_old.json"}, "FAIL", 0.79),
    (790.0, {"tokens_per_s": 900.0, "source": "results/perf_guard/gpu-x_old.json"}, "ok", 790 / 900),
    (790.0, None, "FAIL", 0.79),   # no previous result: the value of record (1000)
    (1500.0, None, "ok", 1.5),
])
def test_the_engine_is_judged_against_the_previous_result(tokens_per_s, previous, status, ratio):
    (verdict,) = perf_guard.judge({"engine_32x8k": {"tokens_per_s": tokens_per_s}}, FLOORS, "gpu-x", previous)
    assert (verdict.status, verdict.floor) == (status, pytest.approx(0.8))
    assert verdict.ratio == pytest.approx(ratio)
    source = previous["source"] if previous else "results/b.json"
    assert source in verdict.line and verdict.line.startswith(f"{status} engine_32x8k: {tokens_per_s:.1f}")


def test_a_case_not_measured_fails_and_a_device_without_floors_is_not_judged():
    failed = perf_guard.judge({"decode_bs1_32k": {"error": "OutOfMemoryError: x"}, "engine_32x8k": {}}, FLOORS,
                              "gpu-x")
    assert [v.status for v in failed] == ["FAIL", "FAIL"]
    assert failed[0].line == "FAIL decode_bs1_32k: OutOfMemoryError: x"
    assert failed[1].line == "FAIL engine_32x8k: no measurement"
    other = perf_guard.judge({"decode_bs1_32k": decode(6.0, 1.0), "engine_32x8k": {"tokens_per_s": 1.0}}, FLOORS,
                             "cpu")
    assert [v.status for v in other] == ["not judged", "not judged"]


def test_the_previous_result_is_the_newest_of_this_device_that_measured_the_engine(tmp_path):
    def write(name: str, engine) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"measurements": {"engine_32x8k": engine}}))
        return path

    write("gpu-x_2026-11-01_aaa.json", {"tokens_per_s": 100.0})
    newest = write("gpu-x_2026-12-01_bbb.json", {"tokens_per_s": 200.0})
    write("gpu-x_2026-12-02_ccc.json", {"error": "boom"})  # newer, but measured nothing
    write("gpu-y_2026-12-03_ddd.json", {"tokens_per_s": 300.0})  # another device
    (tmp_path / "gpu-x_2026-12-04_eee.json").write_text("{not json")
    current = write("gpu-x_2026-12-05_fff.json", {"tokens_per_s": 400.0})
    found = perf_guard.previous_engine(tmp_path, "gpu-x", exclude=current.resolve())
    assert found == {"tokens_per_s": 200.0, "source": str(newest)}
    assert perf_guard.previous_engine(tmp_path, "gpu-z") is None


def test_the_floor_file_is_checked(tmp_path):
    floors = perf_guard.load_floors()  # the checked-in file
    assert floors["devices"] and all(perf_guard.device_slug(name) == name for name in floors["devices"])
    assert perf_guard.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3" in floors["devices"]
    for broken, message in [({"tolerance": 1.0}, "tolerance in"), ({"value_of_record": 0}, "value_of_record > 0"),
                            ({"source": ""}, "must say its source"),
                            ({"rocketkv_ms_of_record": 0}, "rocketkv_ms_of_record must be > 0")]:
        floor = {**FLOORS["devices"]["gpu-x"]["decode_bs1_32k"], **broken}
        path = tmp_path / "floors.json"
        path.write_text(json.dumps({"devices": {"gpu-x": {"decode_bs1_32k": floor}}}))
        with pytest.raises(ValueError, match=message):
            perf_guard.load_floors(path)
    path.write_text(json.dumps({"devices": {"gpu-x": {"prefill": FLOORS["devices"]["gpu-x"]["decode_bs1_32k"]}}}))
    with pytest.raises(ValueError, match="unknown case 'prefill'"):
        perf_guard.load_floors(path)


@pytest.mark.parametrize("static_ms, code", [(18.0, 0), (15.0, 1)])
def test_the_judge_dry_run_exits_one_when_a_case_fails(tmp_path, capsys, static_ms, code):
    floors = tmp_path / "floors.json"
    floors.write_text(json.dumps(FLOORS))
    record = tmp_path / "gpu-x_2026-12-01_abc.json"
    record.write_text(json.dumps({"env": {"device_slug": "gpu-x"}, "previous_engine": None, "measurements": {
        "decode_bs1_32k": decode(6.0, static_ms), "engine_32x8k": {"tokens_per_s": 950.0}}}))
    assert perf_guard.main(["--judge", str(record), "--floors", str(floors)]) == code
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["ok" if code == 0 else "FAIL", "ok"]
    assert perf_guard.main(["--judge", str(record), "--floors", str(floors), "--device", "cpu"]) == 0


def test_the_hybrid_speedup_is_judged_against_its_own_floor():
    floors = {"devices": {"gpu-x": {"hybrid_gemma3_32k": {"metric": "m", "value_of_record": 1.2, "tolerance": 0.1,
                                                          "source": "results/b.json"}}}}
    for rocket_ms, status in ((10.0, "ok"), (15.0, "FAIL")):  # 16.2 / 10 = 1.62x; 16.2 / 15 = 1.08x < 1.08 - eps
        measured = {"rocketkv_ms": rocket_ms, "baseline_ms": 16.2, "ratio": 16.2 / rocket_ms - 0.001}
        (verdict,) = perf_guard.judge({"hybrid_gemma3_32k": measured}, floors, "gpu-x")
        assert verdict.status == status and verdict.floor == pytest.approx(1.08)
        assert verdict.line.startswith(f"{status} hybrid_gemma3_32k: speed-up ")
        assert "RocketKV on Gemma-3-12B" in verdict.line
    (missing,) = perf_guard.judge({"hybrid_gemma3_32k": {"error": "OutOfMemoryError: y"}}, floors, "gpu-x")
    assert missing.line == "FAIL hybrid_gemma3_32k: OutOfMemoryError: y"


def test_the_quick_run_measures_every_case_on_the_cpu_and_writes_its_result(tmp_path):
    """``--quick`` through scripts/perf_guard.sh: every case ran, the file is named like the GPU suite's, every
    verdict says "not judged" (no floors for the CPU) and the status is 0."""
    env = {**os.environ, "OUT": str(tmp_path), "COMMIT": "abc1234", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "perf_guard.sh"), "--quick"], capture_output=True,
                          text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("cpu_*_abc1234.json")
    record = json.loads(path.read_text())
    decode_row, engine = record["measurements"]["decode_bs1_32k"], record["measurements"]["engine_32x8k"]
    assert decode_row["ratio"] == pytest.approx(decode_row["baseline_ms"] / decode_row["rocketkv_ms"])
    assert engine["tokens_per_s"] == pytest.approx(4 * 8 / engine["seconds"][1])
    hybrid = record["measurements"]["hybrid_gemma3_32k"]
    assert hybrid["ratio"] == pytest.approx(hybrid["baseline_ms"] / hybrid["rocketkv_ms"])
    assert hybrid["baseline"] == "DynamicCache" and "--quick" in hybrid["command"]
    assert [v["status"] for v in record["verdicts"]] == ["not judged"] * 3
    assert record["env"]["commit"] == "abc1234" and record["env"]["quick"] is True
    assert "not judged decode_bs1_32k" in done.stdout and f"wrote {path}" in done.stdout
