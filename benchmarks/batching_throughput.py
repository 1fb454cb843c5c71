"""Throughput and latency of the continuous-batching engine (serving/batching/engine.py): Llama-3.1-8B shapes, random bf16
weights, a fixed workload and Poisson arrivals.

    python -m benchmarks.batching_throughput [--out DIR] [--requests 32] [--prompt-len 8192] [--new-tokens 512]
    python -m benchmarks.batching_throughput --quick          # tiny model on the CPU: the script's logic

One engine serves every step, as a server would: before it starts, ``BatchingEngine.warm_up`` captures the decode
graph of every bucket for max_tokens up to max(--new-tokens, --mixed-new-tokens) (``startup_capture_s``), so no
workload pays for a capture or a table widening. Its counters are cumulative: each step reports its own deltas
(``graph_captures`` included: 0 after the warm-up).

Steps (each in its own try/except: one failure never loses the others' results):

  warmup     the startup capture (``startup_capture_s``, also at the report's top level), then two short requests
             through the engine (Triton JIT, allocator), timed and excluded from the rest
  fixed      --requests x --prompt-len prompt tokens x --new-tokens new tokens (greedy, EOS ignored), all submitted
             at once: total output tokens/s, TTFT p50/p99 (submit -> first token, queueing included), ms per decode
             step (median, p90; mean rows per step), prefill s per request, peak GiB (torch.cuda.max_memory_allocated)
  mixed      Poisson arrivals at each --rates (requests/s), prompt lengths log-uniform in [--mixed-min-prompt,
             --mixed-max-prompt], --mixed-new-tokens new tokens, at most --mixed-requests requests or --mixed-time-s
             seconds of arrivals per rate: tokens/s per GPU (all output tokens / wall time), per user (median of each
             request's (tokens - 1) / (last token - first token)), TTFT p50/p99, inter-token latency p50/p99 (the
             gaps between a request's successive tokens, all requests pooled), finished / errors; with
             --step-deadline-s, requests unfinished then are cancelled and counted (``unfinished_at_deadline``)

``--engine both``: every step on hf_rocketkv's engine, then the warm-up and the mixed rates on transformers' continuous
batching in the same process (the model back on sdpa, our engine and pool freed), the same arrivals and prompts per
rate (``transformers_steps``), and ``mixed_curve.png`` (tokens/s per GPU against tokens/s per user, one line per
engine; points in ``curve``). Each rate is bounded by --step-deadline-s (default 30 with both; arrivals stop at half
of it). On one H100: ``python -m benchmarks.batching_throughput --engine both --skip-fixed --out $OUT`` ~4-5 min
(model build ~30 s, our warm-up ~30 s, 3 rates x at most 30 s per engine, transformers' warm-up).

The pool is sized for the workload: every running request's view (min(prompt, prompt_budget) + new tokens) plus
the prefill peak of the longest prompt, +10% (``--pool-gib`` overrides). Nothing is downloaded; the model is built
from its config with random weights (``hf_rocketkv.bench.decode.build_model``), so tokens are meaningless but
shapes, memory and timings are real. Model load is excluded from every timing.

``--quick``: a tiny model (``TINY``), 4 requests x 96 tokens x 8 new, on the CPU without a GPU (< 60 s), to check
the script's logic. Expected runtime on one H100 with the defaults: ~4-6 minutes (model build ~30 s, fixed ~1-2
min, mixed 3 rates ~2-3 min); scale down with --requests / --prompt-len / --new-tokens / --mixed-requests / --rates.
Writes ``batching_throughput.json`` under --out (default $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from pathlib import Path

import torch

import hf_rocketkv
from benchmarks.batching_steps import (  # noqa: F401  (Recorder, percentile: read by the tests too)
    GIB,
    EngineRun,
    Recorder,
    percentile,
    run_plan,
    step_fixed,
    step_fixed_frozen,
    step_fixed_host_times,
    step_mixed,
    step_profile_prefill,
    step_warmup,
)
from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
from hf_rocketkv.cache import request_pages
from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.memory import KVBlockPool, PoolSpec
from hf_rocketkv.serving.batching.scheduler import BatchingConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder of batching_throughput.json")
    parser.add_argument("--quick", action="store_true", help="tiny model, tiny workload (CPU without a GPU)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--min-prompt-len", type=int, default=None,
                        help="fixed workload's prompt lengths uniform in [this, --prompt-len] (default: all --prompt-len)")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--max-running", type=int, default=32, help="BatchingConfig.max_running")
    parser.add_argument("--prefills-per-step", type=int, default=1)
    parser.add_argument("--prefill-chunk-tokens", type=int, default=BatchingConfig.prefill_chunk_tokens,
                        help="BatchingConfig.prefill_chunk_tokens: the most prompt tokens in one prefill forward")
    parser.add_argument("--prefill-token-budget", type=int, default=BatchingConfig.prefill_token_budget,
                        help="BatchingConfig.prefill_token_budget: prompt tokens prefilled per decode step")
    parser.add_argument("--concurrent-prefill-tokens", type=int, default=None,
                        help="BatchingConfig.concurrent_prefill_tokens: prefill beside the decode steps (own thread "
                             "and CUDA stream) in chunks of this many tokens; default: chunks between decode steps")
    parser.add_argument("--page-size", type=int, default=16, help="pool page size (tokens)")
    parser.add_argument("--pool-gib", type=float, default=None, help="pool size (default: sized for the workload)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the pool's K/V pages: the model's dtype (auto) or e4m3 with a scale per page (fp8)")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than Llama-3.1-8B's 32")
    parser.add_argument("--rates", default="0.5,1,2", help="Poisson arrival rates (requests/s), comma separated; "
                                                            "empty: skip the mixed workload")
    parser.add_argument("--mixed-requests", type=int, default=32, help="requests at most per rate")
    parser.add_argument("--mixed-time-s", type=float, default=60.0, help="seconds of arrivals at most per rate")
    parser.add_argument("--mixed-min-prompt", type=int, default=1024)
    parser.add_argument("--mixed-max-prompt", type=int, default=32768)
    parser.add_argument("--mixed-new-tokens", type=int, default=256)
    parser.add_argument("--decode", default="graphs", choices=["graphs", "eager"],
                        help="graphs: one CUDA graph per decode bucket (the engine's default on CUDA); eager")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--freeze-gc", action="store_true",
                        help="after the fixed workload, gc.freeze() and run it again (fixed_gc_frozen): do "
                             "collections of the long-lived heap slow the engine thread?")
    parser.add_argument("--time-host", action="store_true",
                        help="then the fixed workload again with the engine's methods timed on the host "
                             "(fixed_host_times: inclusive ms per iteration of each, prefill_host_time.Timers)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="after the fixed step: one more --prompt-len request (1 new token) through the running "
                             "engine under torch.profiler; its top ops in profile_prefill/ under --out")
    parser.add_argument("--no-overlap-decode", dest="overlap_decode", action="store_false",
                        help="BatchingConfig.overlap_decode=False: read each step's tokens before the next launch")
    parser.add_argument("--engine", default="rocketkv", choices=["rocketkv", "transformers", "both"],
                        help="rocketkv: hf_rocketkv's BatchingEngine on a KVBlockPool; transformers: transformers' own "
                             "continuous batching (ContinuousBatchingManager, dense paged cache) on the same workloads; "
                             "both: every step on rocketkv, then the mixed rates on transformers' with the same "
                             "arrivals and prompts (transformers_steps), and mixed_curve.png of both")
    parser.add_argument("--step-deadline-s", type=float, default=None,
                        help="a mixed rate's wall-time limit: requests unfinished then are cancelled and counted "
                             "(default: none; 30 with --engine both, whose transformers side is slow, and arrivals "
                             "then stop at half of it)")
    parser.add_argument("--skip-fixed", action="store_true", help="no fixed workload (only warm-up and mixed)")
    parser.add_argument("--prefill-warm-tokens", type=int, default=None,
                        help="BatchingEngine.warm_up(prefill_tokens=...): prompts up to this many tokens meet no new "
                             "cuDNN attention graph (default: the engine's, two prefill chunks; 0: none)")
    parser.add_argument("--prefill-times", action="store_true",
                        help="record every prefill chunk's prompt length, tokens and host seconds (prefill_times)")
    parser.add_argument("--fixed-again", action="store_true",
                        help="the fixed workload a second time, other prompts of the same lengths' law (a warm call)")
    parser.add_argument("--compile-regions", action="store_true",
                        help="hf_rocketkv.compile_regions(model) before the engine starts (fused norms and MLPs)")
    parser.add_argument("--rope-off", action="store_true",
                        help="RocketKVConfig(fused_rope=False): transformers' RoPE in the decode steps")
    return parser


def apply_quick(args) -> None:
    args.requests, args.prompt_len, args.new_tokens = min(args.requests, 4), min(args.prompt_len, 96), \
        min(args.new_tokens, 8)
    args.max_running = min(args.max_running, 4)
    args.min_prompt_len = args.min_prompt_len and min(args.min_prompt_len, args.prompt_len)
    args.mixed_requests, args.mixed_time_s = min(args.mixed_requests, 4), min(args.mixed_time_s, 5.0)
    args.mixed_min_prompt, args.mixed_max_prompt = min(args.mixed_min_prompt, 32), min(args.mixed_max_prompt, 160)
    args.mixed_new_tokens = min(args.mixed_new_tokens, 6)
    args.rates = ",".join(args.rates.split(",")[:1]) if args.rates else ""
    args.rates = "4" if args.rates else ""


def rocket_config(quick: bool, device: torch.device) -> RocketKVConfig:
    config = RocketKVConfig(prompt_budget=48, window_size=8, kernel_size=7, topk=4, page_size=4) if quick \
        else RocketKVConfig()
    return config.replace(backend="triton" if device.type == "cuda" else "torch")


# ------------------------------------------------------------------------------------------------ the pool
def pool_pages_for(args, config: RocketKVConfig, max_prompt: int, new_tokens: int) -> int:
    """Every running request's steady pages (its longest prompt) + one prefill peak, +10%."""
    spec = PoolSpec(args.page_size, config.page_size, config.kt_cache_dtype)  # the pool is sized from this
    longest = request_pages(config, spec, max_prompt, new_tokens, keep_all=False)
    steady = longest.steady_pages * args.max_running
    return int((steady + longest.peak_pages) * 1.1) + 4


def make_pool(model, args, config: RocketKVConfig, pages: int, device: torch.device) -> KVBlockPool:
    dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None  # None: the model's dtype
    probe = KVBlockPool(model, max_gpu_bytes=1 << 30, page_size=args.page_size, kt_page_size=config.page_size,
                        kt_dtype=config.kt_cache_dtype, device=device, dtype=dtype)  # lazily allocated: its page size
    size = int(args.pool_gib * GIB) if args.pool_gib else pages * probe.bytes_per_page
    return KVBlockPool(model, max_gpu_bytes=size, page_size=args.page_size, kt_page_size=config.page_size,
                       kt_dtype=config.kt_cache_dtype, device=device, dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        apply_quick(args)
    both = args.engine == "both"
    if both:
        args.engine = "rocketkv"  # first; the transformers side follows (run_transformers_side)
        args.step_deadline_s = args.step_deadline_s if args.step_deadline_s is not None else 30.0
        args.mixed_time_s = min(args.mixed_time_s, args.step_deadline_s / 2)  # arrivals end half-way
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": {**vars(args), "engine": "both" if both else args.engine}, "env": {"torch": torch.__version__, "python": platform.python_version(),
                                                "device": torch.cuda.get_device_name(device)
                                                if device.type == "cuda" else platform.processor() or "cpu"}}
    steps: dict = {}
    report["steps"] = steps
    path = out / "batching_throughput.json"

    def save():
        path.write_text(json.dumps(report, indent=2, default=str))

    try:
        started = time.perf_counter()
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        model = build_model(TINY if args.quick else LLAMA_31_8B, args.layers, dtype, device, args.seed)
        if args.engine == "rocketkv":
            hf_rocketkv.enable(model)
        if args.compile_regions and args.engine == "rocketkv":
            hf_rocketkv.compile_regions(model)  # compiled on first use: inside warm_up's startup_capture_s
        config = rocket_config(args.quick, device).replace(fused_rope=not args.rope_off)
        vocab = model.config.vocab_size
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        longest = max([args.prompt_len] + ([args.mixed_max_prompt] if rates else []))
        new_tokens = max(args.new_tokens, args.mixed_new_tokens if rates else 0)
        if args.engine == "rocketkv":
            pool = make_pool(model, args, config, pool_pages_for(args, config, longest, new_tokens), device)
            report["setup"] = {"model_build_s": time.perf_counter() - started, "pool_pages": pool.total_pages(),
                               "pool_gib": pool.total_pages() * pool.bytes_per_page / GIB,
                               "pool_dtype": str(pool.dtype).removeprefix("torch."), "config": config.to_dict()}
        else:
            pool = None
            report["setup"] = {"model_build_s": time.perf_counter() - started, "engine": "transformers",
                               "transformers": __import__("transformers").__version__}
    except Exception:  # noqa: BLE001 - nothing else can run; say why
        report["setup_error"] = traceback.format_exc()
        save()
        print(report["setup_error"])
        return 1
    save()
    from benchmarks.transformers_cb import (
        TransformersEngineRun,
        plot_both,
        run_transformers_side,
    )

    run_class = EngineRun if args.engine == "rocketkv" else TransformersEngineRun
    engine_run = run_class(model, pool, config, args, warm_tokens=new_tokens)
    plan = [("warmup", lambda: step_warmup(engine_run, args, vocab))]
    if not args.skip_fixed:
        plan.append(("fixed", lambda: step_fixed(engine_run, args, vocab, device)))
    if args.fixed_again:
        plan.append(("fixed_again", lambda: step_fixed(engine_run, args, vocab, device, seed_offset=1000)))
    if args.freeze_gc:
        plan.append(("fixed_gc_frozen", lambda: step_fixed_frozen(engine_run, args, vocab, device)))
    if args.time_host:
        plan.append(("fixed_host_times", lambda: step_fixed_host_times(engine_run, args, vocab, device)))
    if args.profile_prefill:
        plan.append(("profile_prefill", lambda: step_profile_prefill(engine_run, args, vocab, device, out)))
    plan += [(f"mixed_rate_{rate:g}", lambda rate=rate: step_mixed(engine_run, args, vocab, rate)) for rate in rates]
    def after(name: str) -> None:
        report["startup_capture_s"] = steps.get("warmup", {}).get("startup_capture_s")
        save()
        shown = {k: v for k, v in steps[name].items() if k != "errors" and not k.startswith("top_")}
        print(name, json.dumps(shown, default=str), flush=True)

    try:
        run_plan(plan, steps, after)
    finally:
        engine_run.close()
    if both:
        del engine_run, pool
        report["transformers_steps"] = run_transformers_side(model, config, args, vocab, rates, new_tokens, save)
        report["curve"] = plot_both(report, out / "mixed_curve.png")
        save()
        steps = {**steps, **{f"transformers/{k}": v for k, v in report["transformers_steps"].items()}}
    print(f"wrote {path}")
    return 0 if all("error" not in s for s in steps.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
