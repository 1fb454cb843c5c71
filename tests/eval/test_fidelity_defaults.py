"""benchmarks/fidelity_defaults.py: the configurations it measures (the library's defaults, and 1,024 tokens read),
its texts, and the summary's arithmetic on made-up records worked out by hand."""

from __future__ import annotations

import pytest

from benchmarks import fidelity_defaults as fd
from hf_rocketkv import RocketKVConfig


def test_it_measures_the_library_defaults_and_four_times_the_reads():
    defaults, more = (point.config for point in fd.configs())
    assert defaults == RocketKVConfig()
    assert (defaults.prompt_budget, defaults.topk * defaults.page_size) == (2048, 256)
    assert more == RocketKVConfig(topk=256) and more.topk * more.page_size == 1024
    assert [p.config.backend for p in fd.configs("torch")] == ["torch", "torch"]
    assert fd.CONTEXT + fd.POSITIONS <= 8192  # SmolLM2's positions


@pytest.mark.parametrize("kind", fd.KINDS)
def test_every_kind_of_text_is_long_enough_for_four_separate_windows(kind):
    text = fd.text_of(kind)
    assert len(text) > 4 * (fd.CONTEXT + fd.POSITIONS) * 2  # > 2 characters per token, generously
    with pytest.raises(ValueError, match="text kind must be one of"):
        fd.text_of("poetry")


def test_the_summary_is_each_metrics_spread_by_kind_and_over_all_windows():
    def record(kind, top1, kl):
        return {"name": "defaults", "kind": kind, "top1_agreement": top1, "mean_kl": kl, "next_token_accuracy": 0.5,
                "read_tokens_per_step": 100.0, "read_ratio": 8.0}

    records = [record("code", 0.9, 0.1), record("code", 0.8, 0.3), record("prose", 1.0, 0.2)]
    (row,) = fd.summarize(records)
    code = row["by_kind"]["code"]["top1_agreement"]
    assert code == pytest.approx({"mean": 0.85, "std": 0.0707107, "min": 0.8, "max": 0.9, "windows": 2})
    assert row["by_kind"]["prose"]["mean_kl"] == {"mean": 0.2, "std": 0.0, "min": 0.2, "max": 0.2, "windows": 1}
    assert row["all"]["top1_agreement"] == pytest.approx({"mean": 0.9, "std": 0.1, "min": 0.8, "max": 1.0,
                                                          "windows": 3})
    assert row["all"]["mean_kl"]["mean"] == pytest.approx(0.2) and row["read_ratio"] == 8.0
    table = fd.markdown([row], "about")
    assert "| defaults | code | 2 | 0.850 (0.071; 0.800-0.900) | 0.200 (0.141; 0.100-0.300) | 0.500 |" in table
