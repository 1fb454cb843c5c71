"""benchmarks.accuracy_sweep without a model: every method of the sweep is a valid eval method whose budgets are
what the sweep's tables say (the sweep itself runs the embedded SmolLM2: minutes, not a unit test)."""

from __future__ import annotations

import pytest

from hf_rocketkv.eval.methods import build_method


@pytest.fixture(scope="module")
def sweep():
    from benchmarks import accuracy_sweep

    return accuracy_sweep


@pytest.mark.parametrize("quick", [False, True])
def test_every_method_builds_with_the_budgets_of_its_row(sweep, quick):
    base = sweep.base_config()
    specs = sweep.sweep_specs(quick)
    assert specs[0].method == "full" and len({s.method for s in specs}) == len(specs)
    for spec in specs:
        method = build_method(spec.method, base)
        assert method.kept_budget == spec.kept and method.read_budget == spec.read, spec
    subset = sweep.cpu_subset(sweep.sweep_specs(False))
    assert 10 <= len(subset) < len(sweep.sweep_specs(False))


def test_read_grid_and_targets(sweep):
    specs = sweep.sweep_specs(False)
    reads = {s.read for s in specs if s.family.startswith("rocketkv")}
    assert reads == {64, 128, 256}
    assert not sweep.forced_pages_fit(16, 4, 64) and sweep.forced_pages_fit(64, 8, 128)
    rows = [
        {"family": "full", "method": "full", "read_tokens_mean": 2100.0, "top1_agreement": 1.0, "mean_kl": 0.0,
         "needle_found": 3},
        {"family": "rocketkv 0/0", "method": sweep.rocket_spec(256, 16, 0, 0).method, "read_tokens_mean": 64.0,
         "top1_agreement": 0.96, "mean_kl": 0.04, "needle_found": 3},
    ]
    targets = sweep.targets(rows)
    assert targets["8x_fewer_read"]["met"] and targets["needle_b256_k16"]["met"]
    assert "| rocketkv 0/0 |" in sweep.markdown_tables(
        [{**rows[1], "kept": 256, "next_token_accuracy": 0.5, "needle_n": 5}], "header")
