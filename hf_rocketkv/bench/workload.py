"""``hf-rocketkv bench --workload``: what a user lives with over a workload of varied requests, not one warm call.

Real users change the prompt length on every call and the batch size often. For each cache type, in one process and
on one model, this runs the same sequence of generate() calls (prompt lengths drawn between --min-context and
--max-context, the batch sizes of --batches in turn) and reports per call: wall time (compilation included), TTFT,
decode ms/token, and how many torch.compile graphs were built. The summary gives, side by side: the first call's
time, the median time of the later calls, compiled graphs after the first call (recompilations), the graphs compiled
after warm-up (any call but the first of its batch bucket: ``RocketKVConfig.batch_buckets`` for rocketkv-compile, the
batch size itself elsewhere; 0 means no prompt length or max_new_tokens ever recompiled), and the medians of TTFT and
ms/token.

    hf-rocketkv bench --workload --calls 8 --batches 1 4 --min-context 1024 --max-context 16384 --out out/workload
    hf-rocketkv bench --workload --quick          # tiny model on CPU: a smoke run

Rows: ``dynamic`` (DynamicCache, eager), ``static-compile`` (StaticCache + transformers' auto-compile),
``rocketkv-graphs`` (RocketKV, decode_runner="cuda_graphs"), ``rocketkv-compile`` (RocketKV, decode_runner=
"torch_compile"). Random weights with Llama-3.1-8B shapes (tokens are meaningless; speed is not).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ..integration import batch_buckets
from . import fit
from .decode import LLAMA_31_8B, TINY, build_model, free_memory, rocket_config, rocket_for_row, run_generate
from .options import WORKLOAD_CACHES, parse, plan_calls, workload_parser  # noqa: F401  (rows, calls: by name)


def build_parser() -> argparse.ArgumentParser:
    """The options (bench/options.py: read and checked without torch)."""
    return workload_parser()


def compiled_graphs() -> int:
    import torch._dynamo.utils as dynamo_utils

    return int(dynamo_utils.counters["stats"].get("unique_graphs", 0))


def run_cache(model, cache: str, calls, rocket, device, vocab: int, budget_s: float) -> list[dict]:
    torch.compiler.reset()  # the public spelling of torch._dynamo.reset: every compiled graph dropped
    records, started = [], time.perf_counter()
    for index, (batch, length, new) in enumerate(calls):
        if time.perf_counter() - started > budget_s:
            records.append(dict(call=index, batch=batch, context=length, new_tokens=new, status="skipped (budget)"))
            continue
        ids = torch.randint(3, vocab, (batch, length), device=device, generator=torch.Generator(device).manual_seed(index))
        graphs_before = compiled_graphs()
        t0 = time.perf_counter()
        try:
            result, _ = run_generate(model, cache, ids, new, rocket)
            status = "ok"
        except torch.OutOfMemoryError:
            result, status = {}, "oom"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        records.append(dict(
            call=index, batch=batch, batch_bucket=batch_bucket(cache, rocket, batch), context=length, new_tokens=new,
            status=status,
            wall_s=time.perf_counter() - t0, graphs_compiled=compiled_graphs() - graphs_before,
            **{k: v for k, v in result.items() if k != "new_tokens"},
        ))
        del ids
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def batch_bucket(cache: str, rocket, batch: int) -> int:
    """The batch size a call's decode runs at: its bucket for RocketKV rows (rocketkv-compile pads), else itself."""
    return batch_buckets.batch_bucket(rocket_for_row(rocket, cache), batch) if cache.startswith("rocketkv") else batch


def after_warm_up(records: list[dict]) -> list[dict]:
    """Every call but the first of its batch bucket (that one compiles the bucket's graph)."""
    seen, later = set(), []
    for record in records:
        bucket = record.get("batch_bucket", record["batch"])
        if bucket in seen:
            later.append(record)
        seen.add(bucket)
    return later


def summarise(cache: str, records: list[dict]) -> dict:
    done = [r for r in records if r["status"] == "ok"]
    later = done[1:]

    def median(key, rows):
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    return dict(
        cache=cache,
        calls_ok=len(done),
        first_call_s=done[0]["wall_s"] if done else None,
        warm_call_s=median("wall_s", later),
        graphs_first_call=done[0]["graphs_compiled"] if done else None,
        recompiles_after_first=sum(r["graphs_compiled"] for r in later),
        recompiles_after_warm_up=sum(r["graphs_compiled"] for r in after_warm_up(done)),
        ttft_s=median("prefill_s", done),
        decode_ms_per_token=median("decode_ms_per_token", later or done),
        peak_gib=max((r["peak_gib"] for r in done if r.get("peak_gib") is not None), default=None),
    )


def markdown(summaries: list[dict]) -> str:
    head = ("| cache | calls ok | first call s | later calls s (median) | graphs 1st call | recompiles after | "
            "recompiles after warm-up (1st call per batch bucket) | TTFT s | decode ms/token | peak GiB |")
    lines = [head, "|" + "---|" * 10]
    for s in summaries:
        cells = [s["cache"], s["calls_ok"], s["first_call_s"], s["warm_call_s"], s["graphs_first_call"],
                 s["recompiles_after_first"], s["recompiles_after_warm_up"], s["ttft_s"], s["decode_ms_per_token"],
                 s["peak_gib"]]
        lines.append("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> dict:
    args = parse(build_parser(), argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda" and not args.allow_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = getattr(torch, fit.bench_dtype(args, device.type))
    model_kwargs = dict(TINY if args.quick else LLAMA_31_8B)
    rocket = rocket_config(argparse.Namespace(config=args.config, prefill_batch_size=args.prefill_batch_size),
                           args.quick, device)
    free, where = free_memory(device)
    # every call runs (no point is skipped): the largest must fit, checked before the model is built
    fit.check_bench(args, workload=True, device_type=device.type, available=free, where=where,
                    prompt_budget=rocket.prompt_budget, prefill_batch_size=rocket.prefill_batch_size, fraction=0.92)
    model = build_model(model_kwargs, args.layers, dtype, device, args.seed)
    calls = plan_calls(args)
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=_device_name(device),
        torch=torch.__version__, command="hf-rocketkv bench " + " ".join(argv or []), calls=calls,
        rocketkv=rocket.to_dict(), caches={},
    )
    summaries = []
    for cache in args.caches:
        if args.quick and cache == "static-compile":
            continue  # the compiled StaticCache path needs CUDA (or minutes of CPU compile)
        records = run_cache(model, cache, calls, rocket, device, model_kwargs["vocab_size"], args.budget_s)
        summary = summarise(cache, records)
        summaries.append(summary)
        report["caches"][cache] = dict(summary=summary, calls=records)
        print(json.dumps(summary))
        if args.out:
            _write(report, args.out)
    report["markdown"] = markdown(summaries)
    print(report["markdown"])
    if args.out:
        _write(report, args.out)
    return report


def _write(report: dict, out: str) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "workload.json").write_text(json.dumps(report, indent=1, default=str))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    """Run the workload; a run that cannot fit in memory is refused in two lines, exit status 2."""
    try:
        run(argv)
    except fit.WontFit as err:
        print(f"hf-rocketkv bench: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
