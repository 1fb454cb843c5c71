"""Plot decode ms/token vs context from the bench logs of one GPU run (one line per cache, one panel per batch).

    python -m benchmarks.plot_results results/h100_2026-11-22_bench_b1.log \
        results/h100_2026-11-22_bench_b4.log --out docs/img/decode_h100.png
"""

import argparse
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hf_rocketkv.bench.decode import context_label  # noqa: E402

LINE = re.compile(r"^(\S+)\s+B=(\d+)\s+ctx=(\d+)\s+ok\s+decode ([\d.]+) ms/tok")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title", default="Llama-3.1-8B shapes, bf16, H100 (2026-11-22)")
    args = parser.parse_args()
    points = defaultdict(dict)  # (batch, cache) -> {context: ms}
    for path in args.logs:
        for line in open(path):
            match = LINE.match(line.strip())
            if match:
                cache, batch, context, ms = match.groups()
                points[(int(batch), cache)][int(context)] = float(ms)
    batches = sorted({b for b, _ in points})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for (b, cache), series in sorted(points.items()):
            if b != batch:
                continue
            xs = sorted(series)
            ax.plot(xs, [series[x] for x in xs], marker="o", label=cache)
        contexts = sorted({x for (b, _), series in points.items() if b == batch for x in series})
        ax.set_xscale("log")
        ax.set_xticks(contexts, [context_label(c) for c in contexts])  # the measured contexts, not powers of ten
        ax.minorticks_off()
        ax.set_xlabel("context (prompt tokens, log scale)")
        ax.set_ylabel("decode ms/token")
        ax.set_title(f"batch {batch}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
