"""The speed line of ``hf-rocketkv generate`` (cli/runs.py ``TimedRun``, cli/report.py ``speed``) on synthetic step
times: prefill = first token - start, ms/token = mean of the decode steps after the first token."""

from __future__ import annotations

import pytest

from hf_rocketkv.cli.report import speed
from hf_rocketkv.cli.runs import TimedRun


def test_timed_run_arithmetic():
    run = TimedRun("rocketkv", new_ids=[5, 6, 7, 8], start=100.0, step_times=[100.75, 100.8, 100.9, 101.05])
    assert run.prefill_s == pytest.approx(0.75)
    assert run.decode_steps == 3
    assert run.ms_per_token == pytest.approx(100.0)  # (101.05 - 100.75) s over 3 steps
    assert speed(run) == "100.0 ms/token over 3 steps, prefill 0.75 s"


def test_timed_run_with_one_token():
    run = TimedRun("full", new_ids=[5], start=2.0, step_times=[2.5])
    assert run.decode_steps == 0 and run.ms_per_token is None
    assert speed(run) == "one token only, prefill 0.50 s"
    assert speed(None) == "-"
