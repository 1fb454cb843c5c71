"""Plot the decode targets against the measured points: decode ms/token per cache, and peak GiB at batch 4 x 32k.

    python -m benchmarks.plot_targets --results results --prefix h200_2026-11-22 \
        --out docs/img/targets_h200.png

Reads the ``decode_bench.json`` files of one run (``<prefix>_decode_*.json``); each point is (batch, context).
The peak-memory panel also takes the settings only measured in ``<prefix>_<--peak-also>_*.json``.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DECODE_TARGETS = {(1, 32768): 6.0, (1, 100000): 6.5, (4, 32768): 8.0}
PEAK_TARGET = 26.0


def load(results: Path, pattern: str) -> list[dict]:
    rows = []
    for path in sorted(results.glob(pattern)):
        report = json.loads(path.read_text())
        rows_per_pass = report["env"]["rocketkv"].get("prefill_batch_size")
        for row in report["rows"]:
            if row["status"] != "ok":
                continue
            label = row["cache"]
            if label.startswith("rocketkv") and row["batch"] > 1:
                label += f" (prefill rows {rows_per_pass})" if rows_per_pass else " (one prefill forward)"
            rows.append(dict(row, label=label, file=path.name))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", default="results")
    parser.add_argument("--prefix", default="h200_2026-11-22")
    parser.add_argument("--peak-also", default="before_deferred",
                        help="files <prefix>_<this>_*.json add peak-memory bars for settings the decode runs lack "
                             "(peak memory is set by prefill, not by how decode steps are scheduled)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = Path(args.results)
    rows = [r for r in load(results, f"{args.prefix}_decode_*.json") if (r["batch"], r["context"]) in DECODE_TARGETS]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw=dict(width_ratios=[2, 1]))
    points = list(DECODE_TARGETS)
    labels = sorted({r["label"] for r in rows}, key=lambda s: (not s.startswith("dynamic"), s))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs, ys = [], []
        for p, point in enumerate(points):
            found = [r["decode_ms_per_token"] for r in rows if r["label"] == label and (r["batch"], r["context"]) == point]
            if found:  # one run per point and cache in a prefix's files; several would be averaged, never picked
                xs.append(p + i * width)
                ys.append(sum(found) / len(found))
        bars = left.bar(xs, ys, width, label=label)
        left.bar_label(bars, fmt="%.2f", fontsize=7)
    for p, point in enumerate(points):
        left.hlines(DECODE_TARGETS[point], p - width / 2, p + 0.8 - width / 2, colors="k", linestyles="--")
    left.set_xticks([p + 0.4 - width / 2 for p in range(len(points))])
    left.set_xticklabels([f"batch {b} x {c // 1000}k" for b, c in points])
    left.set_ylabel("decode ms / token (generate, lower is better)")
    left.set_yscale("log")
    left.set_title("decode, dashed = target")
    left.legend(fontsize=7, loc="upper center", ncol=2)
    left.set_ylim(top=60)
    peak = {r["label"]: r for r in load(results, f"{args.prefix}_{args.peak_also}_*.json")}
    peak.update({r["label"]: r for r in rows})
    peak = sorted((r for r in peak.values() if (r["batch"], r["context"]) == (4, 32768) and r["peak_gib"]),
                  key=lambda r: -r["peak_gib"])
    bars = right.bar([r["label"].replace(" (", "\n(") for r in peak], [r["peak_gib"] for r in peak], color="tab:gray")
    right.bar_label(bars, fmt="%.1f", fontsize=7)
    right.axhline(PEAK_TARGET, color="k", linestyle="--")
    right.set_ylabel("peak GiB (max_memory_allocated)")
    right.set_title("batch 4 x 32k peak memory, dashed = target")
    right.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"Llama-3.1-8B shapes, random bf16 weights, RocketKV 2048/64/4 - {args.prefix.replace('_', ' ')}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
