"""scripts/gpu_test_summary.py, the results file of scripts/gpu_tests.sh, on hand-written JUnit XML whose counts are
worked out by hand below, and scripts/gpu_tests.sh itself on this machine (no GPU: every selected test skips)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("gpu_test_summary", ROOT / "scripts" / "gpu_test_summary.py")
summary = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(summary)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="1" skipped="1" tests="6">
  <testcase classname="tests.gpu.test_a" name="test_ok" time="1.0"/>
  <testcase classname="tests.gpu.test_a" name="test_ok_too[2]" time="1.0"/>
  <testcase classname="tests.gpu.test_a" name="test_bad[cuda]" time="2.0">
    <failure message="AssertionError: tokens differ&#10;second line">trace</failure></testcase>
  <testcase classname="tests.gpu.test_a.TestGroup" name="test_skipped" time="0.0">
    <skipped type="pytest.skip" message="needs two CUDA GPUs">skip</skipped></testcase>
  <testcase classname="tests.gpu.test_b" name="test_teardown" time="1.0">
    <error message="failed on teardown with &quot;RuntimeError: CUDA error&quot;">trace</error></testcase>
  <testcase classname="" name="tests.gpu.test_c" time="0.0">
    <error message="collection failure">ImportError</error></testcase>
</testsuite></testsuites>
"""


def test_counts_and_failing_ids(tmp_path):
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    for name in ("test_a", "test_b"):
        (tmp_path / "tests" / "gpu" / f"{name}.py").write_text("")
    got = summary.summarize_junit(JUNIT, root=tmp_path)
    assert (got["passed"], got["failed"], got["skipped"], got["error"], got["total"]) == (2, 1, 1, 2, 6)
    assert got["failing_tests"] == ["tests.gpu.test_c", "tests/gpu/test_a.py::test_bad[cuda]",
                                    "tests/gpu/test_b.py::test_teardown"]
    assert got["failure_messages"]["tests/gpu/test_a.py::test_bad[cuda]"] == "AssertionError: tokens differ"


def test_ids_name_classes_after_the_file_and_fall_back_without_one(tmp_path):
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_a.py").write_text("")
    assert summary.test_id("tests.gpu.test_a.TestGroup", "test_x", tmp_path) == "tests/gpu/test_a.py::TestGroup::test_x"
    assert summary.test_id("tests.gpu.test_missing", "test_x", tmp_path) == "tests.gpu.test_missing::test_x"
    assert summary.test_id("tests.gpu.test_a", "test_x") == "tests.gpu.test_a::test_x"


def test_the_file_name_is_device_date_commit(tmp_path):
    when = datetime.datetime(2026, 11, 27, 23, 59, tzinfo=datetime.timezone.utc)
    path = summary.result_path(tmp_path, "NVIDIA H100 80GB HBM3", when, "0386f3e")
    assert path == tmp_path / "nvidia-h100-80gb-hbm3_2026-11-27_0386f3e.json"


def test_a_missing_junit_file_is_recorded_not_counted_as_a_pass(tmp_path, capsys):
    summary.main(["--junit", str(tmp_path / "absent.xml"), "--out-dir", str(tmp_path / "out"), "--commit", "abc",
                  "--exit-status", "2"])
    (written,) = (tmp_path / "out").iterdir()
    record = json.loads(written.read_text())
    assert record["junit_missing"] and record["total"] == 0 and record["exit_status"] == 2


@pytest.mark.slow
def test_the_gpu_script_writes_a_results_file_here(tmp_path):
    """On this machine (no CUDA) the selected GPU tests skip: the script still writes its record."""
    env = {**os.environ, "OUT": str(tmp_path), "COMMIT": "test123", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_tests.sh"), "tests/gpu/test_pool_offload_gpu.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (written,) = tmp_path.glob("*_test123.json")
    record = json.loads(written.read_text())
    assert written.name.startswith("cpu_")
    assert (record["skipped"], record["passed"], record["failed"], record["error"]) == (2, 0, 0, 0)
    assert record["gpu_count"] == 0 and record["commit"] == "test123" and "-m gpu" in record["command"]
    for key in ("date", "torch", "transformers", "python"):
        assert record[key], key
