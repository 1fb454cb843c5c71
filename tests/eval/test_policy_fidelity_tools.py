"""benchmarks.kvpress_fidelity and benchmarks.plot_policy_fidelity without kvpress or a model run: the dumped
samples are the fidelity task's own token ids, a kvpress press's read per step is its kept tokens plus the mean of
the fed-back ones, and the plot is written from sweep and kvpress result files."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest



def load(name: str):
    return importlib.import_module(f"benchmarks.{name}")


def test_dump_writes_the_fidelity_tasks_token_ids(tmp_path, smollm2_tokenizer):
    from hf_rocketkv.eval.settings import EvalSettings
    from hf_rocketkv.eval.tasks.fidelity import FidelityTask

    out = tmp_path / "samples.json"
    load("kvpress_fidelity").main(["dump", "--samples", "2", "--context", "64", "--positions", "8", "--out", str(out)])
    dumped = json.loads(out.read_text())
    settings = EvalSettings(samples=2, fidelity_context=64, fidelity_positions=8)
    want = FidelityTask().build(smollm2_tokenizer, settings)
    assert [(d["context_ids"], d["continuation_ids"]) for d in dumped] == [
        (s.context_ids, s.continuation_ids) for s in want]
    assert all(len(d["context_ids"]) == 64 and len(d["continuation_ids"]) == 8 for d in dumped)


def _sweep(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({"rows": rows}))
    return folder


def test_plot_points_and_file(tmp_path):
    plot = load("plot_policy_fidelity")
    row = dict(family="evict:snapkv", read_tokens_mean=992.0, top1_agreement=0.94)
    sweep = _sweep(tmp_path / "A", [
        dict(row, method="full", family="full", read_tokens_mean=2112.0, top1_agreement=1.0),
        dict(row, method="evict:snapkv@prompt_budget=928"),
        dict(row, method="rocketkv@prompt_budget=928,topk=64,stage1=adakv", family="rocketkv x", read_tokens_mean=256.0),
    ])
    points, full_read = plot.sweep_points([sweep])
    assert full_read == 2112.0
    assert [p[0] for p in points] == ["evict:snapkv", "rocketkv, adakv stage 1"]
    press = tmp_path / "kvpress.json"
    press.write_text(json.dumps({"records": [
        {"method": "kvpress:snapkv@928", "kept_budget": 928, "top1_agreement": t} for t in (0.9, 1.0)]}))
    (family, read, top1, _), = plot.kvpress_points(press, positions=128)
    assert (family, read, top1) == ("kvpress:snapkv", 928 + 127 / 2, pytest.approx(0.95))
    pytest.importorskip("matplotlib")
    out = tmp_path / "img" / "policies.png"
    assert plot.main(["--sweeps", str(sweep), "--kvpress", str(press), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000


def test_plot_refuses_sweeps_without_the_full_cache(tmp_path):
    plot = load("plot_policy_fidelity")
    sweep = _sweep(tmp_path / "A", [dict(method="evict:snapkv@prompt_budget=928", family="evict:snapkv",
                                         read_tokens_mean=992.0, top1_agreement=0.9)])
    with pytest.raises(SystemExit, match="no 'full' row"):
        plot.sweep_points([sweep])
