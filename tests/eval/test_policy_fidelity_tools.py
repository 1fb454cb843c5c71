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


@pytest.mark.slow  # tokenizes the long texts: ~13 s
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


@pytest.mark.slow  # tokenizes the long texts: ~13 s
def test_dump_study_writes_the_studys_own_windows(tmp_path, smollm2_tokenizer):
    study = load("fidelity_study")
    out = tmp_path / "study.json"
    load("kvpress_fidelity").main(["dump-study", "--contexts", "256", "--kinds", "code,dialogue", "--windows", "2",
                                   "--positions", "8", "--out", str(out)])
    dumped = json.loads(out.read_text())
    want = [(kind, w, start, ctx, cont) for kind in ("code", "dialogue")
            for w, (start, ctx, cont) in enumerate(study.windows_of(
                smollm2_tokenizer(study.text_of(kind), add_special_tokens=False).input_ids, 256, 8, 2))]
    assert [(d["kind"], d["window"], d["start"], d["context_ids"], d["continuation_ids"]) for d in dumped] == want
    assert {d["context"] for d in dumped} == {256}


def test_press_reads_follow_the_studys_count():
    """An evicting layer reads what it keeps plus the fed-back tokens: the study's own count, 30 layers."""
    study, press = load("fidelity_study"), load("kvpress_fidelity")
    for kept, positions in ((256, 64), (1024, 64), (512, 128)):
        assert press.reads_per_step(kept, 30, positions) == study.reads_per_step(
            None, None, [float(kept)] * 30, positions - 1, 4096)
    assert press.reads_per_step(256, 30, 64) == 8640
    assert press.study_points(2048) == [("reads", 256), ("kept", 1024)]


def test_merge_adds_the_kvpress_rows(tmp_path):
    study = load("fidelity_study")
    base = dict(context=2048, window=0, start=0, top1_agreement=0.9, mean_kl=0.1, next_token_accuracy=0.5,
                read_tokens_per_step=8640.0, read_ratio=7.2, bytes_after_prefill=2**20, kept_tokens_mean=256.0)
    run = {"model": "m", "device": "cpu", "threads": 1, "date": "d", "commit": "c", "python": "3", "torch": "t",
           "kvpress": "not installed", "positions": 64, "command": "python -m benchmarks.fidelity_study",
           "wall_s": 1.0, "grid": {"2048": []},
           "records": [dict(base, kind=k, name="streaming @ reads", group="baselines") for k in ("code", "docs")]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    press = {"kvpress": "0.5.5", "transformers": "5.2.0", "torch": "t", "date": "d", "commit": "c", "threads": 1,
             "command": "python -m benchmarks.kvpress_fidelity run", "records": [
                 dict(base, kind=k, name=n, group="kvpress 0.5.5, equal reads", kept_budget=256, kept_stored=256.0,
                      top1_agreement=t, kv_bytes_after_prefill=1)
                 for k, t in (("code", 0.8), ("docs", 0.6)) for n in ("full", "kvpress SnapKV @ reads")]}
    (tmp_path / "press.json").write_text(json.dumps(press))
    out = tmp_path / "merged.json"
    study.main(["merge", str(tmp_path / "run.json"), "--kvpress", str(tmp_path / "press.json"), "--out", str(out)])
    merged = json.loads(out.read_text())
    rows = {s["name"]: s for s in merged["summary"]}
    assert set(rows) == {"streaming @ reads", "kvpress SnapKV @ reads"}  # the kvpress file's full cache stays out
    assert rows["kvpress SnapKV @ reads"]["top1_agreement"] == pytest.approx(0.7)
    assert rows["kvpress SnapKV @ reads"]["bytes_after_prefill"] is None
    assert merged["kvpress"]["kvpress"] == "0.5.5" and merged["commands"] == [run["command"]]
    assert "| kvpress SnapKV @ reads | 8640 | 7.2x | - |" in out.with_suffix(".md").read_text()
    again = tmp_path / "again.json"  # a merged file merges again (the records stay, the kvpress rows come once)
    study.main(["merge", str(out), "--kvpress", str(tmp_path / "press.json"), "--out", str(again)])
    assert len(json.loads(again.read_text())["summary"]) == 2
