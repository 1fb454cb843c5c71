"""Fidelity against compression across eval runs: one line per method, one point per run (budget).

    python -m hf_rocketkv.eval.plot out/fid_r64 out/fid_r128 out/fid_r256 --output docs/img/fidelity_vs_read.png

Each folder holds the ``results.json`` of one ``hf-rocketkv eval --task fidelity`` run (usually the same methods at a
different budget). x: tokens read per decode step (mean over the scored positions, per layer and KV head; the full
cache's read is drawn as a vertical line), log scale; y: top-1 agreement with the full cache (or mean KL).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from .report import summarize


def fidelity_points(results_list: list[dict], metric: str = "top1_agreement") -> dict[str, list[tuple[float, float]]]:
    """``{method: [(mean tokens read per step, metric), ...]}`` sorted by read, from several runs' results."""
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for results in results_list:
        fidelity = (results.get("summary") or summarize(results))["fidelity"]
        for method, values in fidelity.items():
            read = values.get("read_tokens_mean")
            if read is not None and read == read:  # NaN: a run from before read tokens were recorded
                points[method].append((read, values[metric]))
    return {m: sorted(set(p)) for m, p in points.items()}


def compression_plot(
    results_list: list[dict], path: str | Path, metric: str = "top1_agreement", methods: list[str] | None = None,
    title: str = "",
) -> Path:
    """Write the plot (PNG) of ``metric`` against tokens read per step, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = fidelity_points(results_list, metric)
    full = points.pop("full", [])
    names = [m for m in (methods or sorted(points)) if m in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name in names:
        xs, ys = zip(*points[name])
        ys = [100 * y for y in ys] if metric != "mean_kl" else ys
        ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.2, label=name)
    if full:
        ax.axvline(full[0][0], color="grey", linestyle=":", linewidth=1)
        ax.text(full[0][0], ax.get_ylim()[0], " full cache", rotation=90, va="bottom", fontsize=7, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens read per decode step (per layer and KV head, mean)", fontsize=8)
    ax.set_ylabel("top-1 agreement with the full cache (%)" if metric == "top1_agreement" else metric, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6.5, loc="lower right", ncol=2)
    if title:
        ax.set_title(title, fontsize=9)
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_rocketkv.eval.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="eval output folders (each with results.json)")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--metric", default="top1_agreement", choices=["top1_agreement", "mean_kl"])
    parser.add_argument("--methods", nargs="+", default=None, help="methods to draw (default: all but full)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    results = [json.loads((Path(run) / "results.json").read_text()) for run in args.runs]
    print(compression_plot(results, args.output, args.metric, args.methods, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
