"""Plot the mixed-workload curve of batching_throughput.py runs: output tokens/s per GPU against tokens/s per user
(median), one line per engine, each point labelled with its Poisson arrival rate, as TensorRT-LLM reports RocketKV.

    python -m benchmarks.plot_mixed_curve \
        "RocketKV BatchingEngine=results/h200_2026-11-26_s9_mixed_curve_rocketkv.json" \
        "transformers continuous batching=results/h200_2026-11-26_s9_mixed_curve_transformers_cb.json" \
        --title "..." --out docs/img/mixed_curve_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(path: Path) -> list[tuple[float, float, float]]:
    """``(rate, per-user tokens/s p50, tokens/s per GPU)`` of every ``mixed_rate_*`` step of a batching_throughput.json."""
    return points_of(json.loads(path.read_text())["steps"])


def points_of(steps: dict) -> list[tuple[float, float, float]]:
    """``(rate, per-user tokens/s p50, tokens/s per GPU)`` of every ``mixed_rate_*`` step of a report's steps."""
    points = []
    for name, step in steps.items():
        if name.startswith("mixed_rate_") and step.get("tokens_per_s") is not None:
            points.append((step["workload"]["rate_per_s"], step["per_user_tokens_per_s_p50"], step["tokens_per_s"]))
    return sorted(points)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH of a batching_throughput.json")
    parser.add_argument("--title", default="mixed workload")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    plot({label: curve(Path(path)) for label, _, path in (run.partition("=") for run in args.runs)}, args.title,
         Path(args.out))
    print(f"wrote {args.out}")
    return 0


def plot(curves: dict[str, list[tuple[float, float, float]]], title: str, out: Path) -> None:
    """One line per label, each point annotated with its arrival rate; log-log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        points = [p for p in points if p[1] is not None and p[2]]
        ax.plot([p[1] for p in points], [p[2] for p in points], marker="o", label=label)
        for rate, user, gpu in points:
            ax.annotate(f"{rate:g}/s", (user, gpu), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("output tokens/s per user (median)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
