"""The README's picture: decode ms/token against context for RocketKV and transformers' caches (batch 1), and
tokens/s per GPU of RocketKV's batched decode against the batch a dense cache could hold.

    python -m benchmarks.plot_headline results/h200_2026-11-22_decode_b1_32k.json \
        results/h200_2026-11-22_decode_b1_100k.json results/h200_2026-11-27_decode_b1_32k_final.json \
        results/h200_2026-11-27_decode_b64_32k_final.json results/h200_2026-12-05_decode_b1_32k_eager_graphs.json \
        --out docs/img/headline_h200.png

Reads ``decode_bench.json`` files of ``hf_rocketkv.bench.decode`` (``hf-rocketkv bench``). Left panel: every batch-1
row, one line per cache kind (``rocketkv-graphs`` and ``rocketkv-compile`` are drawn as RocketKV; where several files
have the same point, the newest run's is drawn), the file of each point printed. Right panel: RocketKV's tokens/s per GPU at the largest context of the
batched rows, one bar per batch size, with the peak GiB on each bar. The title names the device and the dates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABELS = {"rocketkv-graphs": "RocketKV", "rocketkv-compile": "RocketKV",
          "static-compile": "StaticCache + torch.compile", "dynamic": "DynamicCache"}
COLOURS = {"RocketKV": "tab:orange", "StaticCache + torch.compile": "tab:red", "DynamicCache": "tab:blue"}


def points(paths: list[Path]) -> list[dict]:
    """Every finished row of the files: cache label, batch, context, ms/token, tokens/s, peak GiB, file, device."""
    found = []
    for path in paths:
        report = json.loads(path.read_text())
        for row in report["rows"]:
            label = LABELS.get(row["cache"])
            if row["status"] != "ok" or label is None or row.get("decode_ms_per_token") is None:
                continue
            found.append(dict(label=label, batch=row["batch"], context=row["context"],
                              ms=row["decode_ms_per_token"], tokens_per_s=row["batch"] * 1e3 / row["decode_ms_per_token"],
                              peak_gib=row.get("peak_gib"), file=path.name, device=report["env"]["device"],
                              total_gib=report["env"].get("total_gib"),
                              date=report["env"]["date"][:10]))
    newest: dict = {}
    for row in sorted(found, key=lambda r: r["date"]):
        newest[(row["label"], row["batch"], row["context"])] = row
    return list(newest.values())


def context_label(tokens: int) -> str:
    return f"{round(tokens / 1024)}k" if tokens % 1024 == 0 else f"{round(tokens / 1000)}k"


def dense_requests(context: int | None, total_gib: float) -> tuple[int, float] | None:
    """(requests, GiB each) a dense bf16 K/V cache of ``context`` tokens fits beside the bf16 weights of Llama-3.1-8B
    shapes in ``total_gib`` (arithmetic on the shapes, bench/fit.py)."""
    from hf_rocketkv.bench.fit import LLAMA_31_8B, Shapes

    if not context or not total_gib:
        return None
    shapes = Shapes.of(LLAMA_31_8B)
    per_request = shapes.layers * 2 * shapes.kv_heads * shapes.head_dim * 2 * context / 2**30
    return int((total_gib - shapes.parameters() * 2 / 2**30) // per_request), per_request


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    single = [r for r in rows if r["batch"] == 1]
    contexts = sorted({r["context"] for r in single})
    for label, colour in COLOURS.items():
        line = sorted((r["context"], r["ms"]) for r in single if r["label"] == label)
        if line:
            left.plot([c for c, _ in line], [m for _, m in line], marker="o", color=colour, label=label)
            for c, m in line:
                left.annotate(f"{m:.1f}", (c, m), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    left.set_xscale("log")
    left.set_xticks(contexts, [context_label(c) for c in contexts])
    left.minorticks_off()
    left.set_ylim(bottom=0)
    left.set_xlabel("prompt tokens (batch 1)")
    left.set_ylabel("decode ms / token (lower is better)")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    batched = [r for r in rows if r["label"] == "RocketKV"]
    context = max((r["context"] for r in batched if r["batch"] > 1), default=None)
    bars = sorted((r["batch"], r["tokens_per_s"], r["peak_gib"]) for r in batched if r["context"] == context)
    right.bar([str(b) for b, _, _ in bars], [t for _, t, _ in bars], color="tab:orange")
    for i, (_, tokens, peak) in enumerate(bars):
        right.annotate(f"{tokens:,.0f} tok/s\n{peak:.0f} GiB peak", (i, tokens), textcoords="offset points",
                       xytext=(0, 3), ha="center", fontsize=8)
    dense = dense_requests(bars and context, max((r["total_gib"] or 0) for r in batched))
    if dense is not None:
        right.text(0.02, 0.97, f"a dense bf16 cache: {dense[1]:.0f} GiB per request,\nat most {dense[0]} requests beside "
                   f"the weights", transform=right.transAxes, va="top", fontsize=8)
    right.set_xlabel(f"batch (x {context_label(context)} prompt tokens each)" if context else "batch")
    right.set_ylabel("RocketKV decode tokens/s per GPU")
    right.set_ylim(top=max((t for _, t, _ in bars), default=1) * 1.3)
    dates = sorted({r["date"] for r in rows})
    devices = sorted({r["device"] for r in rows})
    fig.suptitle(f"Llama-3.1-8B shapes, random bf16 weights, {', '.join(devices)}, steady decode ({', '.join(dates)})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="decode_bench.json files (results/...)")
    parser.add_argument("--out", type=Path, default=Path("docs/img/headline.png"))
    args = parser.parse_args(argv)
    rows = points(args.files)
    plot(rows, args.out)
    for row in rows:
        print(f"{row['label']:28s} batch {row['batch']:<3d} {context_label(row['context']):>5s} {row['ms']:7.2f} ms "
              f"{row['tokens_per_s']:9,.1f} tok/s  {row['file']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
