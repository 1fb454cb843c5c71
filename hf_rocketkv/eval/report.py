"""Aggregation of eval records into tables (markdown) and needle heat maps (PNG)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _method_order(results: dict) -> list[str]:
    return [m["name"] for m in results.get("methods", [])]


def summarize(results: dict) -> dict:
    """Means per task x method, per task x method x length, per grid cell, and the fidelity metrics."""
    by_task: dict = defaultdict(lambda: defaultdict(list))
    by_length: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    grid: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    kept: dict = defaultdict(list)
    prefill_s: dict = defaultdict(list)
    per_token_s: dict = defaultdict(list)
    cache_bytes: dict = defaultdict(list)
    for r in results.get("records", []):
        task, method = r["task"], r["method"]
        by_task[task][method].append(r["score"])
        by_length[task][method][str(r["length"])].append(r["score"])
        if r.get("depth") is not None:
            grid[task][method][f"{r['length']}|{r['depth']}"].append(r["score"])
        kept[method].append(r["kept_tokens_mean"])
        prefill_s[method].append(r["method_prefill_s"])
        cache_bytes[method].append(r.get("cache_bytes_after_prefill", float("nan")))
        per_token_s[method].append(r["decode_s_per_token"])
    retention: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in results.get("records", []):
        for name in ("needle", "key"):
            if f"{name}_retention" in r:
                for stat, value in r[f"{name}_retention"].items():
                    retention[r["task"]][r["method"]][f"{name}_{stat}"].append(value)
    # the same samples, restricted to those the full cache answers perfectly: what compression loses
    full_scores = {_sample_key(r): r["score"] for r in results.get("records", []) if r["method"] == "full"}
    on_full_correct: dict = defaultdict(lambda: defaultdict(list))
    for r in results.get("records", []):
        if full_scores.get(_sample_key(r)) == 1.0:
            on_full_correct[r["task"]][r["method"]].append(r["score"])
    fidelity: dict = defaultdict(lambda: defaultdict(list))
    for r in results.get("fidelity", []):
        for key in ("top1_agreement", "mean_kl", "next_token_accuracy"):
            fidelity[r["method"]][key] += [r[key]] * r["positions"]  # position-weighted over samples
        fidelity[r["method"]]["positions"].append(r["positions"])
        fidelity[r["method"]]["kept"].append(r["kept_tokens_mean"])
        if "read_tokens_mean" in r:
            fidelity[r["method"]]["read"].append(r["read_tokens_mean"])
    return {
        "tasks": {t: {m: {"score": _mean(v), "n": len(v)} for m, v in ms.items()} for t, ms in by_task.items()},
        "by_length": {
            t: {m: {L: _mean(v) for L, v in ls.items()} for m, ls in ms.items()} for t, ms in by_length.items()
        },
        "on_full_correct": {
            t: {m: {"score": _mean(v), "n": len(v)} for m, v in ms.items()} for t, ms in on_full_correct.items()
        },
        "retention": {
            t: {m: {k: _mean(v) for k, v in stats.items()} for m, stats in ms.items()} for t, ms in retention.items()
        },
        "grid": {t: {m: {c: _mean(v) for c, v in cs.items()} for m, cs in ms.items()} for t, ms in grid.items()},
        "kept_tokens_after_prefill": {m: _mean(v) for m, v in kept.items()},
        "method_prefill_s": {m: _mean(v) for m, v in prefill_s.items()},
        "cache_bytes_after_prefill": {m: _mean(v) for m, v in cache_bytes.items()},
        "decode_s_per_token": {m: _mean(v) for m, v in per_token_s.items()},
        "fidelity": {
            m: {
                "top1_agreement": _mean(d["top1_agreement"]),
                "mean_kl": _mean(d["mean_kl"]),
                "next_token_accuracy": _mean(d["next_token_accuracy"]),
                "positions": sum(d["positions"]),
                "kept_tokens_after_prefill": _mean(d["kept"]),
                "read_tokens_mean": _mean(d["read"]),
            }
            for m, d in fidelity.items()
        },
    }


def _sample_key(record: dict) -> tuple:
    return (record["task"], record.get("index"), record.get("length"), record.get("depth"))


def _budget(method: dict) -> tuple[str, str]:
    kept = "all" if method["kept_budget"] is None else str(method["kept_budget"])
    read = "all kept" if method["read_budget"] is None else str(method["read_budget"])
    return kept, read


def markdown(results: dict) -> str:
    s = results.get("summary") or summarize(results)
    methods = results.get("methods", [])
    order = _method_order(results)
    lines = [f"# hf-rocketkv eval: {results.get('model', '')}", ""]
    if results.get("command"):
        lines += ["```", results["command"], "```", ""]
    cfg = results.get("config", {})
    lines += [
        "RocketKV config: "
        + ", ".join(
            f"{k}={cfg[k]}"
            for k in (
                "prompt_budget", "topk", "page_size", "topr", "window_size", "kernel_size", "kt_cache_dtype",
                "stage2", "stage2_sink_tokens", "stage2_recent_tokens",
            )
            if k in cfg
        ),
        "",
    ]
    tasks = list(s["tasks"])
    if tasks:
        lines += ["## Score per task (mean over samples, %)", ""]
        lines += ["| method | kept / KV head | read / step | " + " | ".join(tasks) + " |"]
        lines += ["|---|---|---|" + "---|" * len(tasks)]
        for m in methods:
            kept, read = _budget(m)
            cells = []
            for t in tasks:
                entry = s["tasks"][t].get(m["name"])
                cells.append(f"{100 * entry['score']:.1f} (n={entry['n']})" if entry else "")
            lines.append(f"| {m['name']} | {kept} | {read} | " + " | ".join(cells) + " |")
        lines.append("")
        if "full" in order and s.get("on_full_correct"):
            lines += ["## Score on the samples the full cache answers perfectly (%)", ""]
            lines += ["| method | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
            for name in order:
                cells = []
                for t in tasks:
                    entry = s["on_full_correct"].get(t, {}).get(name)
                    cells.append(f"{100 * entry['score']:.1f} (n={entry['n']})" if entry else "-")
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
            lines.append("")
        for t in tasks:
            lengths = sorted({L for ms in s["by_length"][t].values() for L in ms}, key=_length_key)
            if len(lengths) < 2:
                continue
            lines += [f"### {t} by context length (target prompt tokens), %", ""]
            lines += ["| method | " + " | ".join(lengths) + " |", "|---|" + "---|" * len(lengths)]
            for name in order:
                row = s["by_length"][t].get(name)
                if row:
                    lines.append(
                        f"| {name} | " + " | ".join(f"{100 * row[L]:.0f}" if L in row else "" for L in lengths) + " |"
                    )
            lines.append("")
        for t, ms in s.get("retention", {}).items():
            lines += [
                f"### {t}: needle tokens kept by stage 1 (mean over samples, layers and KV heads, %)",
                "",
                "| method | needle sentence tokens kept | answer tokens kept | layer-heads keeping the whole answer |",
                "|---|---|---|---|",
            ]
            for name in order:
                st = ms.get(name)
                if st:
                    cell = lambda k: f"{100 * st[k]:.1f}" if k in st else "-"  # noqa: E731
                    lines.append(f"| {name} | {cell('needle_kept')} | {cell('key_kept')} | {cell('key_whole')} |")
            lines.append("")
        lines += ["## Cache after prefill and CPU timing (mean over samples)", ""]
        lines += [
            "| method | stored tokens / layer / KV head | cache MiB | method's prefill part (s) | decode s / token |",
            "|---|---|---|---|---|",
        ]
        for name in order:
            if name in s["kept_tokens_after_prefill"]:
                mib = s.get("cache_bytes_after_prefill", {}).get(name, float("nan")) / 2**20
                lines.append(
                    f"| {name} | {s['kept_tokens_after_prefill'][name]:.0f} | {mib:.1f} | "
                    f"{s['method_prefill_s'][name]:.2f} | {s['decode_s_per_token'][name]:.3f} |"
                )
        lines += [
            "",
            "The prompt minus its last tokens is prefilled once and shared (eval/decode.py); the prefill column is "
            "each method's own tail forward, stage 1 included. Cache MiB: RocketKVCache.memory_bytes() (K/V buffers "
            "at capacity, KT, positions) or the DynamicCache's K/V tensors.",
            "",
        ]
    if s["fidelity"]:
        lines += ["## Fidelity vs the full cache (teacher-forced)", ""]
        lines += [
            "| method | kept / KV head | read / step | read / step, mean | top-1 agreement % | mean KL (nats) | "
            "next-token acc. % | positions |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m in methods:
            f = s["fidelity"].get(m["name"])
            if f:
                kept, read = _budget(m)
                mean_read = f.get("read_tokens_mean", float("nan"))
                lines.append(
                    f"| {m['name']} | {kept} | {read} | {mean_read:.0f} | {100 * f['top1_agreement']:.1f} | "
                    f"{f['mean_kl']:.4f} | {100 * f['next_token_accuracy']:.1f} | {f['positions']} |"
                )
        lines.append("")
    return "\n".join(lines)


def _length_key(value: str):
    try:
        return (0, int(value))
    except ValueError:
        return (1, value)


def heatmap(results: dict, task: str, path: str | Path) -> Path:
    """Accuracy per method (one panel each): x = context length, y = needle depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = (results.get("summary") or summarize(results))["grid"][task]
    methods = [m for m in _method_order(results) if m in grid]
    cells = {c for cs in grid.values() for c in cs}
    lengths = sorted({int(c.split("|")[0]) for c in cells})
    depths = sorted({float(c.split("|")[1]) for c in cells})
    fig, axes = plt.subplots(1, len(methods), figsize=(1.2 + 1.6 * len(methods), 2.4), squeeze=False, sharey=True)
    for k, (ax, method) in enumerate(zip(axes[0], methods)):
        # scores are fractions in [0, 1]; cells, colour bar and title all show them in %
        data = [[100 * grid[method].get(f"{L}|{d}", float("nan")) for L in lengths] for d in depths]
        image = ax.imshow(data, vmin=0.0, vmax=100.0, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(data):
            for j, value in enumerate(row):
                if value == value:
                    ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7)
        ax.set_title(method, fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{L // 1000}k" if L % 1000 == 0 else str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.tick_params(labelleft=k == 0)
        ax.set_xlabel("context tokens", fontsize=7)
    axes[0][0].set_ylabel("needle depth", fontsize=7)
    bar = fig.colorbar(image, ax=axes[0].tolist(), fraction=0.02, pad=0.01)
    bar.ax.tick_params(labelsize=6)
    bar.set_label("accuracy (%)", fontsize=6)
    fig.suptitle(f"{task}: accuracy (%) per method", fontsize=9, y=1.04)
    path = Path(path)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(results: dict, output: str | Path, depth_tasks: set[str] | None = None) -> list[Path]:
    output = Path(output)
    written = [output / "results.md"]
    (output / "results.md").write_text(markdown(results))
    grid = (results.get("summary") or summarize(results))["grid"]
    for task in grid:
        if depth_tasks is None or task in depth_tasks:
            written.append(heatmap(results, task, output / f"heatmap_{task.replace(':', '_')}.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    """Re-render results.md and the heat maps of an output folder: ``python -m hf_rocketkv.eval.report DIR``."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m hf_rocketkv.eval.report", description=main.__doc__)
    parser.add_argument("output", help="folder holding results.json")
    args = parser.parse_args(argv)
    results = json.loads((Path(args.output) / "results.json").read_text())
    results["summary"] = summarize(results)
    for path in write_report(results, args.output, depth_tasks=None):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
