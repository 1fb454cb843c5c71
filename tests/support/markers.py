"""Markers shared by the test folders: ``slow`` for the cases left out of the default command (``-m "not slow"``;
CI runs them all), chosen by their measured durations (docs/testing.md, "Markers")."""

from __future__ import annotations

import pytest

SLOW = pytest.mark.slow


def slow_except(values, keep) -> list:
    """``values`` for ``parametrize``, every one but those in ``keep`` marked ``slow``: the default command runs the
    kept cases, CI all of them."""
    return [value if value in keep else pytest.param(value, marks=SLOW) for value in values]


# Cases of tests parametrized through a module fixture, too slow for the default command: a fixture's parameter
# cannot carry a mark for one test only, so tests/conftest.py marks these by node id (tests/test_markers.py checks
# that each still names a test).
SLOW_FIXTURE_CASES = (
    "tests/integration/test_hybrid_pool.py::test_graphed_decode_on_the_pool_equals_eager_and_reads_nothing_back[gpt_oss]",
    "tests/serving/test_hybrid_batching.py::test_a_replayed_batched_step_reads_nothing_back_from_the_device[gpt_oss]",
)
