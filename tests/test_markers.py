"""The slow marks of tests/support/markers.py: the helper marks what it is told, and every node id marked by name
still names a test (a renamed test would otherwise drop back into the default command silently)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.markers import SLOW, SLOW_FIXTURE_CASES, SLOW_MEASURED_CASES, slow_except

ROOT = Path(__file__).resolve().parents[1]


def test_slow_except_marks_all_but_the_kept_values():
    params = slow_except([1, 2, 3], keep=[2])
    assert params[1] == 2
    assert [p.values for p in (params[0], params[2])] == [(1,), (3,)]
    assert all(mark.name == "slow" for p in (params[0], params[2]) for mark in p.marks)


def test_every_slow_fixture_case_names_a_test():
    for node in SLOW_FIXTURE_CASES:
        path, name = re.fullmatch(r"(.+)::(\w+)\[.+\]", node).groups()
        assert f"def {name}(" in (ROOT / path).read_text(), node


def test_every_case_marked_by_its_measured_time_names_a_test():
    for node in SLOW_MEASURED_CASES:
        path, name = re.fullmatch(r"(.+?)::(\w+)(?:::\w+)?(?:\[.+\])?", node).groups()
        assert f"def {name}(" in (ROOT / path).read_text() or f"{name} = " in (ROOT / path).read_text(), node


@SLOW
def test_every_case_marked_by_its_measured_time_is_collected_under_that_id():
    """A renamed parameter would leave an id that names no case (and the case back in the default command): collect
    the files the list names and find every id."""
    import subprocess
    import sys

    files = sorted({node.split("::")[0] for node in SLOW_MEASURED_CASES})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=240).stdout
    collected = set(out.splitlines())
    missing = [node for node in SLOW_MEASURED_CASES if node not in collected]
    assert not missing, missing
