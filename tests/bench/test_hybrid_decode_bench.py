"""benchmarks.hybrid_decode --quick on the CPU: the script's logic (rows, KV bytes by layer kind, ratios, the JSON)
on tiny gpt-oss / Gemma-3 shapes; the numbers come from the GPU run."""

from __future__ import annotations

import json

import pytest

from benchmarks.hybrid_decode import build_model, main


def test_quick_run_writes_every_row_and_the_ratios(tmp_path):
    report = main(["--quick", "--out", str(tmp_path), "--new-tokens", "8"])
    assert json.loads((tmp_path / "hybrid_decode.json").read_text()) == json.loads(json.dumps(report))
    for name in ("gpt-oss-20b", "gemma-3-12b"):
        model = report["models"][name]
        rows = {row["cache"]: row for row in model["rows"]}
        assert set(rows) == {"dynamic", "static-compile", "rocketkv", "rocketkv-eager"}
        assert rows["static-compile"]["status"] == "skipped" and "CUDA" in rows["static-compile"]["reason"]
        for kind in ("dynamic", "rocketkv", "rocketkv-eager"):
            row = rows[kind]
            assert row["status"] == "ok" and row["new_tokens"] == 8 and row["decode_ms_per_token"] > 0
            assert row["kv_bytes"] == row["kv_bytes_global"] + row["kv_bytes_sliding"] > 0
        # the prompt (96) is evicted to the budget (32) on the global layers only
        assert rows["rocketkv"]["kv_bytes_global"] < rows["dynamic"]["kv_bytes_global"]
        assert rows["rocketkv"]["kv_bytes_sliding"] > 0 and rows["dynamic"]["kv_bytes_sliding"] > 0
        assert rows["dynamic"].get("prefill_chunk") == (32 if name == "gpt-oss-20b" else None)
        assert "prefill_chunk" not in rows["rocketkv"]
        ratios = model["ratios"]
        assert ratios["kv_bytes_fraction_of_dynamic"] == rows["rocketkv"]["kv_bytes"] / rows["dynamic"]["kv_bytes"]
        assert ratios["decode_speedup_vs_dynamic"] == pytest.approx(rows["dynamic"]["decode_ms_per_token"]
                                                                    / rows["rocketkv"]["decode_ms_per_token"])
        assert "decode_speedup_vs_static-compile" not in ratios


def test_layers_flag_keeps_the_pattern_and_refuses_all_sliding():
    import torch

    model, attention = build_model("gemma-3-12b", True, 6, torch.float32, torch.device("cpu"))
    assert attention == "sdpa" and model.config.layer_types[-1] == "full_attention"
    with pytest.raises(ValueError, match="--layers 3: gemma-3-12b's first 3 layers are all sliding"):
        build_model("gemma-3-12b", True, 3, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="--layers must be in 1..4 for gpt-oss-20b"):
        build_model("gpt-oss-20b", True, 9, torch.float32, torch.device("cpu"))
