"""The eval report (eval/report.py, eval/plot.py) from a hand-made results dict: the summary's scores, the markdown
tables, the heat map and the compression plot (PNG files)."""

from __future__ import annotations

import pytest

from hf_rocketkv.eval.plot import compression_plot, fidelity_points
from hf_rocketkv.eval.report import heatmap, markdown, summarize, write_report


def test_compression_plot(tmp_path):
    runs = []
    for read, top1 in ((64, 0.8), (128, 0.9)):
        results = _fake_results()
        results["fidelity"] = [dict(results["fidelity"][0], read_tokens_mean=float(read), top1_agreement=top1),
                               dict(results["fidelity"][0], method="full", read_tokens_mean=2100.0, top1_agreement=1.0)]
        runs.append(results)
    assert fidelity_points(runs)["rocketkv"] == [(64.0, pytest.approx(0.8)), (128.0, pytest.approx(0.9))]
    png = compression_plot(runs, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_results():
    methods = [
        {"name": n, "kept_budget": k, "read_budget": r, "attn_implementation": "x", "config": None}
        for n, k, r in (("full", None, None), ("rocketkv", 256, 64))
    ]
    records = []
    for method, base in (("full", 1.0), ("rocketkv", 0.5)):
        for length in (1024, 2048):
            for depth in (0.1, 0.9):
                records.append(
                    {
                        "task": "passkey",
                        "method": method,
                        "length": length,
                        "depth": depth,
                        "score": base if depth == 0.9 else 1.0,
                        "kept_tokens_mean": 256.0,
                        "method_prefill_s": 0.1,
                        "decode_s_per_token": 0.01,
                    }
                )
    fidelity = [
        {
            "method": "rocketkv",
            "top1_agreement": 0.9,
            "mean_kl": 0.1,
            "next_token_accuracy": 0.4,
            "positions": 10,
            "kept_tokens_mean": 256.0,
            "read_tokens_mean": 64.0,
        }
    ]
    return {
        "model": "m",
        "config": {"prompt_budget": 256},
        "methods": methods,
        "records": records,
        "fidelity": fidelity,
    }


def test_summary_markdown_and_heatmap(tmp_path):
    results = _fake_results()
    s = summarize(results)
    assert s["tasks"]["passkey"]["rocketkv"] == {"score": 0.75, "n": 4}
    assert s["grid"]["passkey"]["rocketkv"]["2048|0.9"] == 0.5
    text = markdown(results)
    assert "| rocketkv | 256 | 64 | 75.0 (n=4) |" in text
    assert "| rocketkv | 256 | 64 | 64 | 90.0 | 0.1000 | 40.0 | 10 |" in text
    png = heatmap(results, "passkey", tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = write_report(results, tmp_path)
    assert {p.name for p in written} == {"results.md", "heatmap_passkey.png"}
