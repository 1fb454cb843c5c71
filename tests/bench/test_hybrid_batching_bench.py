"""benchmarks.hybrid_batching --quick on the CPU: both calls run through generate_batch over a pool and the JSON
holds what was produced; the numbers come from the GPU run."""

from __future__ import annotations

import json

import pytest

from benchmarks.hybrid_batching import main
from tests.support.markers import slow_except


@pytest.mark.parametrize("model", slow_except(["gemma-3-12b", "gpt-oss-20b"], keep=["gemma-3-12b"]))
def test_quick_run_writes_both_calls(tmp_path, model):
    report = main(["--quick", "--model", model, "--out", str(tmp_path)])
    assert json.loads((tmp_path / "hybrid_batching.json").read_text()) == json.loads(json.dumps(report))
    assert [call["call"] for call in report["calls"]] == ["first", "second"]
    for call in report["calls"]:
        assert call["output_tokens"] == report["requests"] * report["new_tokens"] == 12
        assert call["output_tokens_per_s"] == pytest.approx(call["output_tokens"] / call["wall_s"])
    # other prompts on the second call: other first tokens (the model is random, the prompts differ)
    assert report["calls"][0]["first_tokens"] != report["calls"][1]["first_tokens"]
