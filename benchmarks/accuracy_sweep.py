"""Accuracy sweep: RocketKV against kvpress-style eviction baselines at equal kept and equal read
tokens, on the eval harness's fidelity task and multi-key needle, with a small grid of stage-2 options.

    python -m benchmarks.accuracy_sweep --out out/sweep                 # CPU, embedded SmolLM2
    python -m benchmarks.accuracy_sweep --quick --out out/sweep_quick   # smoke run (~80 s of CPU)
    python -m benchmarks.accuracy_sweep --preset cpu --samples 2 --out out/sweep_cpu   # ~30 min
    python -m benchmarks.accuracy_sweep --device cuda --threads 0 --out $OUT/sweep   # a GPU

Tasks (``hf_rocketkv.eval``, the same code as ``hf-rocketkv eval``):
    fidelity       ``--samples`` (4) passages of real English prose, ``--context`` (2048) tokens prefilled, then
                   ``--positions`` (128) teacher-forced tokens; per method: top-1 agreement with the full cache,
                   mean KL(full || method), next-token accuracy, tokens read per step, tokens kept
    niah_multikey  RULER-style multi-key needle, ``--needle-length`` (2048) tokens, 3 distractor keys, 5 depths
                   (0.1 .. 0.9), one sample per depth; keys found (string match)

Methods (per layer and KV head; ``hf_rocketkv.eval.methods``; base config: SmolLM2's CPU config, page 4, topr 64):
    full                                    sdpa + DynamicCache
    evict:{streaming,snapkv,knorm}@N        stage 1 only (kvpress-style presses, our own implementations) keeping N
                                            prompt tokens, every kept token read (N + generated per step)
    rocketkv read R, stage-2 option s/r     RocketKV reading R = topk * 4 tokens per step (R 64: budget 256; R 128:
                                            budget 512; R 256: budget 1024), with stage2_sink_tokens s and
                                            stage2_recent_tokens r from a small grid (forced pages <= topk)
    rocketkv kept N                         RocketKV keeping N = 928 prompt tokens (256 and 512 are already in the
                                            read grid) reading 256 per step

Writes under ``--out``: ``fidelity/results.json``, ``niah/results.json`` (every record, from the eval runner),
``sweep.json`` (the table rows), ``sweep.md`` (markdown tables) and ``sweep.png`` (fidelity against tokens read).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

BASELINES = ("streaming", "snapkv", "knorm")
KEPT = (64, 128, 256, 512, 928)
READ_BUDGETS = {64: (256, 16), 128: (512, 32), 256: (1024, 64)}  # tokens read per step -> (prompt_budget, topk)
STAGE2_GRID = ((0, 0), (4, 16), (4, 32), (4, 64), (8, 128))  # (stage2_sink_tokens, stage2_recent_tokens)
EQUAL_KEPT = ((928, 64),)  # extra (prompt_budget, topk) points; 256 / 512 kept are in the read grid
PAGE = 4
NEEDLE_DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]


@dataclass(frozen=True)
class Spec:
    """One method of the sweep: its eval method string and how to label it."""

    method: str  # hf_rocketkv.eval.methods name, NAME@FIELD=VALUE,...
    family: str  # "full", "evict:<policy>" or "rocketkv s/r"
    kept: int | None  # prompt tokens kept per KV head (None: all)
    read: int | None  # tokens read per step at the start of decode (None: every stored token)


def rocket_spec(budget: int, topk: int, sink: int, recent: int, family: str = "rocketkv", page: int = PAGE,
                **fields) -> Spec:
    """RocketKV keeping ``budget`` prompt tokens and reading ``topk`` pages of ``page``, stage-2 options
    ``sink/recent``; ``fields``: other RocketKVConfig overrides (named in the family label)."""
    method = (f"rocketkv@prompt_budget={budget},topk={topk},page_size={page},stage2_sink_tokens={sink},"
              f"stage2_recent_tokens={recent}")
    method += "".join(f",{name}={value}" for name, value in fields.items())
    label = f"{family} {sink}/{recent}" + "".join(f" {value}" for name, value in fields.items() if name != "backend")
    return Spec(method, label, budget, topk * page)


def custom_spec(method: str) -> Spec:
    """A ``--methods`` string outside the preset: labelled by its overrides, kept / read from its fields."""
    from hf_rocketkv.eval.methods import parse_overrides

    name, _, overrides = method.partition("@")
    fields = parse_overrides(name, overrides) if overrides else {}
    budget = fields.get("prompt_budget")
    read = fields["topk"] * fields.get("page_size", PAGE) if name == "rocketkv" and "topk" in fields else None
    label = " ".join(f"{k}={v}" for k, v in fields.items() if k != "prompt_budget")
    return Spec(method, f"{name} {label}".strip(), budget, read)


def stage2_specs() -> list[Spec]:
    """``--preset stage2``: what stage 2 can do at 8x fewer tokens read (256 of ~2,100) on the fidelity task: the
    stage-1 budget (1024, or 2048 = the whole 2k context), forced sinks / recent pages, the page score rule
    (``stage2_score``), the KT dtype and the page size, beside SnapKV eviction keeping 928 (every kept token read)."""
    specs = [Spec("full", "full", None, None), Spec("evict:snapkv@prompt_budget=928", "evict:snapkv", 928, None)]
    for score in ("group_sign", "head_bound"):
        for budget in (1024, 2048):
            for sink, recent in ((0, 0), (4, 32), (4, 64), (16, 64)):
                specs.append(rocket_spec(budget, 64, sink, recent, f"rocketkv b{budget}", stage2_score=score))
        specs.append(rocket_spec(2048, 64, 4, 32, "rocketkv b2048", stage2_score=score, kt_cache_dtype="bfloat16"))
        specs.append(rocket_spec(2048, 128, 4, 32, "rocketkv b2048 page2", page=2, stage2_score=score))
        specs.append(rocket_spec(2048, 32, 8, 32, "rocketkv b2048 page8", page=8, stage2_score=score))
    # the ceiling of 256 tokens read: exact per-token scores (page 1, fp32 KT), which no real deployment would use
    specs.append(rocket_spec(2048, 256, 4, 32, "exact top-256 tokens", page=1, stage2_score="head_bound",
                             kt_cache_dtype="float32"))
    return specs


def forced_pages_fit(topk: int, sink: int, recent: int) -> bool:
    """The config's own rule: sink pages + (newest page + recent pages) <= topk."""
    return -(-sink // PAGE) + 1 + -(-recent // PAGE) <= topk


def sweep_specs(quick: bool) -> list[Spec]:
    """Every method of the sweep (``--quick``: one per family at the smallest budget)."""
    if quick:
        return [Spec("full", "full", None, None),
                Spec("evict:snapkv@prompt_budget=64", "evict:snapkv", 64, None),
                rocket_spec(256, 16, 0, 0), rocket_spec(256, 16, 4, 32)]
    specs = [Spec("full", "full", None, None)]
    for policy in BASELINES:
        specs += [Spec(f"evict:{policy}@prompt_budget={n}", f"evict:{policy}", n, None) for n in KEPT]
    for _, (budget, topk) in READ_BUDGETS.items():
        specs += [rocket_spec(budget, topk, s, r) for s, r in STAGE2_GRID if forced_pages_fit(topk, s, r)]
    for budget, topk in EQUAL_KEPT:
        specs += [rocket_spec(budget, topk, s, r, f"rocketkv kept {budget}") for s, r in ((0, 0), (4, 32))]
    return specs


def cpu_subset(specs: list[Spec]) -> list[Spec]:
    """``--preset cpu``: what fits ~30 minutes of one shared CPU core: the baselines at 256 and 928 kept, RocketKV at
    64 and 256 read with the stage-2 options 0/0, 4/32 (and 8/128 at 256 read), and at 928 kept with 0/0."""
    keep = {"full"}
    keep |= {f"evict:{p}@prompt_budget={n}" for p in BASELINES for n in (256, 928)}
    keep |= {rocket_spec(256, 16, s, r).method for s, r in ((0, 0), (4, 32))}
    keep |= {rocket_spec(1024, 64, s, r).method for s, r in ((0, 0), (4, 32), (8, 128))}
    keep.add(rocket_spec(928, 64, 0, 0).method)
    return [s for s in specs if s.method in keep]


def base_config():
    """SmolLM2's CPU config (window 32, kernel 63, topr 64 = head_dim, fp8 KT); the sweep overrides the budgets."""
    from hf_rocketkv.eval.settings import load_run_config

    return load_run_config(Path(__file__).resolve().parents[1] / "hf_rocketkv/configs/smollm2-cpu.yaml").rocket


def run_tasks(model, tokenizer, specs: list[Spec], args, out: Path) -> dict:
    """The fidelity task and the multi-key needle through the eval runner; returns their results."""
    from hf_rocketkv.eval.runner import run_eval
    from hf_rocketkv.eval.settings import EvalSettings

    methods = [s.method for s in specs]
    config = base_config()
    results = {}
    if "fidelity" in args.tasks:
        settings = EvalSettings(tasks=["fidelity"], methods=methods, samples=args.samples, seed=0,
                                fidelity_context=args.context, fidelity_positions=args.positions)
        results["fidelity"] = run_eval(model, tokenizer, config, settings, out / "fidelity", model_name=args.model,
                                       command="python -m benchmarks.accuracy_sweep", progress=args.progress)
    if "niah" in args.tasks:
        settings = EvalSettings(tasks=["niah_multikey"], methods=methods, lengths=[args.needle_length],
                                depths=args.depths, samples=1, seed=0)
        results["niah"] = run_eval(model, tokenizer, config, settings, out / "niah", model_name=args.model,
                                   command="python -m benchmarks.accuracy_sweep", progress=args.progress)
    return results


def load_results(out: Path) -> dict:
    """The results.json of each task under ``out`` (an interrupted run keeps what it measured), summarised."""
    from hf_rocketkv.eval.report import summarize

    results = {}
    for task in ("fidelity", "niah"):
        path = out / task / "results.json"
        if path.is_file():
            results[task] = json.loads(path.read_text())
            results[task]["summary"] = summarize(results[task])
    return results


def table_rows(specs: list[Spec], results: dict) -> list[dict]:
    """One row per method: fidelity metrics, tokens read / kept, needle keys found."""
    fidelity = results.get("fidelity", {}).get("summary", {}).get("fidelity", {})
    needle = results.get("niah", {}).get("summary", {}).get("tasks", {}).get("niah_multikey", {})
    rows = []
    for spec in specs:
        fid = fidelity.get(spec.method, {})
        found = needle.get(spec.method)
        rows.append({
            "method": spec.method, "family": spec.family, "kept": spec.kept, "read_budget": spec.read,
            "top1_agreement": fid.get("top1_agreement"), "mean_kl": fid.get("mean_kl"),
            "next_token_accuracy": fid.get("next_token_accuracy"),
            "read_tokens_mean": fid.get("read_tokens_mean"), "kept_tokens": fid.get("kept_tokens_after_prefill"),
            "needle_found": None if found is None else round(found["score"] * found["n"]),
            "needle_n": None if found is None else found["n"],
        })
    return rows


def _fmt(value, digits: int = 3) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown_tables(rows: list[dict], header: str) -> str:
    """Three tables: every method; RocketKV's best stage-2 option per read budget; the targets."""
    lines = [header, "", "| method | kept | read / step (mean) | top-1 | mean KL | next-token acc. | needle keys |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        kept = "all" if r["kept"] is None else r["kept"]
        needle = "-" if r["needle_found"] is None else f"{r['needle_found']}/{r['needle_n']}"
        lines.append(f"| {r['family']} | {kept} | {_fmt(r['read_tokens_mean'], 0)} | {_fmt(r['top1_agreement'])} | "
                     f"{_fmt(r['mean_kl'])} | {_fmt(r['next_token_accuracy'])} | {needle} |")
    return "\n".join(lines) + "\n"


def targets(rows: list[dict]) -> dict:
    """The sweep's accuracy targets, checked on the measured rows (None where the sweep lacks the data)."""
    full = next((r for r in rows if r["family"] == "full"), None)
    rocket = [r for r in rows if r["family"].startswith("rocketkv") and r["top1_agreement"] is not None]
    out = {}
    if full and full["read_tokens_mean"] and rocket:
        eighth = [r for r in rocket if r["read_tokens_mean"] <= full["read_tokens_mean"] / 8]
        best = max(eighth, key=lambda r: r["top1_agreement"], default=None)
        out["8x_fewer_read"] = None if best is None else {
            "method": best["method"], "read": best["read_tokens_mean"], "full_read": full["read_tokens_mean"],
            "top1": best["top1_agreement"], "mean_kl": best["mean_kl"],
            "met": best["top1_agreement"] >= 0.95 and best["mean_kl"] <= 0.05}
    needle_full = full["needle_found"] if full else None
    small = next((r for r in rows if r["method"] == rocket_spec(256, 16, 0, 0).method), None)
    if needle_full is not None and small is not None and small["needle_found"] is not None:
        out["needle_b256_k16"] = {"full": needle_full, "rocketkv": small["needle_found"],
                                  "met": small["needle_found"] >= needle_full}
    return out


def plot(rows: list[dict], path: Path) -> Path | None:
    """Top-1 agreement and mean KL against mean tokens read per step: one line per family."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    families = sorted({r["family"] for r in rows if r["family"] != "full" and r["top1_agreement"] is not None})
    for ax, metric in zip(axes, ("top1_agreement", "mean_kl")):
        for family in families:
            points = sorted((r["read_tokens_mean"], r[metric]) for r in rows
                            if r["family"] == family and r[metric] is not None)
            style = "o-" if family.startswith("rocketkv") else "s--"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=family)
        full = next((r for r in rows if r["family"] == "full"), None)
        if full and full["read_tokens_mean"]:
            ax.axvline(full["read_tokens_mean"], color="grey", lw=1, ls=":", label="full cache read")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens read per decode step (mean, per layer and KV head)")
        ax.set_ylabel({"top1_agreement": "top-1 agreement with the full cache", "mean_kl": "mean KL (nats)"}[metric])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("fidelity on real text (SmolLM2-135M): RocketKV vs eviction baselines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/accuracy_sweep")
    parser.add_argument("--model", default=None, help="model path or hub id (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--quick", action="store_true", help="a < 60 s smoke run: 4 methods, 1 short sample")
    parser.add_argument("--tasks", nargs="+", default=["fidelity", "niah"], choices=["fidelity", "niah"])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--needle-length", type=int, default=2048)
    parser.add_argument("--depths", type=float, nargs="+", default=NEEDLE_DEPTHS)
    parser.add_argument("--methods", nargs="+", default=None, help="only these method strings (default: the sweep)")
    parser.add_argument("--preset", choices=["all", "cpu", "stage2"], default="all",
                        help="all: every method of the sweep; cpu: the subset that fits ~30 min of one CPU core; "
                             "stage2: stage-2 options at 256 tokens read (stage2_specs)")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="no model run: rebuild sweep.json/md/png from the results.json files under --out")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.context, args.positions = 1, 512, 16
        args.needle_length, args.depths = 512, [0.5]
    return args


def main(argv=None) -> int:
    from hf_rocketkv.models import load_model_and_tokenizer

    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = stage2_specs() if args.preset == "stage2" else sweep_specs(args.quick)
    if args.preset == "cpu" and not args.quick:
        specs = cpu_subset(specs)
    if args.methods:  # the sweep's own specs where they match, any other method string as given
        known = {s.method: s for s in specs}
        specs = [known.get("full", Spec("full", "full", None, None))]
        specs += [known.get(m) or custom_spec(m) for m in args.methods if m != "full"]
    start = time.perf_counter()
    if args.report_only:
        results = load_results(out)
    else:
        model, tokenizer = load_model_and_tokenizer(args.model, device=args.device)
        results = run_tasks(model, tokenizer, specs, args, out)
    rows = table_rows(specs, results)
    seconds = time.perf_counter() - start
    if args.report_only and (out / "sweep.json").is_file():  # keep the measured run's wall time
        seconds = json.loads((out / "sweep.json").read_text()).get("seconds", seconds)
    header = (f"Accuracy sweep, {datetime.date.today()}, device {args.device}, {torch.get_num_threads()} thread(s), "
              f"{seconds:.0f} s; fidelity: {args.samples} x {args.positions} positions after {args.context} tokens; "
              f"needle: {args.needle_length} tokens, depths {args.depths}")
    summary = {"header": header, "seconds": seconds, "rows": rows, "targets": targets(rows),
               "args": {k: v for k, v in vars(args).items()}, "torch": torch.__version__}
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    (out / "sweep.md").write_text(markdown_tables(rows, header) + "\n" + json.dumps(summary["targets"], indent=1))
    plot(rows, out / "sweep.png")
    print(markdown_tables(rows, header))
    print(json.dumps(summary["targets"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
