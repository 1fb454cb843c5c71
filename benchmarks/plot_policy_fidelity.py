"""Top-1 agreement against compression, per policy: accuracy_sweep.py runs and kvpress_fidelity.py runs in one plot.

    python -m benchmarks.plot_policy_fidelity --sweeps results/eval/sweep_adakv/* \
        --kvpress results/eval/kvpress_0.5.5/kvpress_results.json --out docs/img/accuracy_policies.png

x: compression of the tokens read per decode step (full cache's read / the method's read, log scale); y: top-1
agreement with the full cache. One marker per policy family: our eviction-only policies (every kept token read),
RocketKV with SnapKV or AdaKV stage 1, and each kvpress press (every kept token read). Every run must be on the same
fidelity samples (same seed, context and positions); the full cache's read comes from the sweeps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def sweep_points(paths: list[Path]) -> tuple[list[tuple[str, float, float, str]], float]:
    """(family, read per step, top-1, method) of every non-full row, and the full cache's read per step."""
    points, full_read = [], None
    for path in paths:
        rows = json.loads((path / "sweep.json").read_text())["rows"]
        for row in rows:
            if row["method"] == "full":
                full_read = row["read_tokens_mean"]
                continue
            family = row["family"]
            if family.startswith("rocketkv"):
                family = "rocketkv, " + ("adakv" if "stage1=adakv" in row["method"] else "snapkv") + " stage 1"
            points.append((family, row["read_tokens_mean"], row["top1_agreement"], row["method"]))
    if full_read is None:
        raise SystemExit("no 'full' row in the sweeps: the compression needs the full cache's read")
    return points, full_read


def kvpress_points(path: Path, positions: int) -> list[tuple[str, float, float, str]]:
    """kvpress presses read every kept token plus the fed-back ones: kept + (positions - 1) / 2 on average."""
    records = json.loads(path.read_text())["records"]
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    points = []
    for method, rs in by_method.items():
        family = method.split("@")[0]
        read = rs[0]["kept_budget"] + (positions - 1) / 2
        points.append((family, read, sum(r["top1_agreement"] for r in rs) / len(rs), method))
    return points


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweeps", nargs="+", type=Path, required=True)
    parser.add_argument("--kvpress", type=Path, default=None)
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, full_read = sweep_points(args.sweeps)
    if args.kvpress is not None:
        points += kvpress_points(args.kvpress, args.positions)
    families = sorted({p[0] for p in points})
    markers = "osD^vP*Xh<>p"
    fig, ax = plt.subplots(figsize=(10.5, 5))
    for i, family in enumerate(families):
        pts = sorted((full_read / read, top1) for fam, read, top1, _ in points if fam == family)
        color = plt.cm.tab20(i % 20)
        hollow = family.startswith("kvpress")  # kvpress presses: hollow markers
        ax.scatter([x for x, _ in pts], [y for _, y in pts], marker=markers[i % len(markers)], s=45, label=family,
                   facecolors="none" if hollow else [color], edgecolors=[color])
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compression of tokens read per decode step (full cache / method)")
    ax.set_ylabel("top-1 agreement with the full cache")
    ax.set_title("SmolLM2-135M, fidelity task: 4 x 128 positions after 2048 tokens")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(points)} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
