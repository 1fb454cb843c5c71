"""The first call against the second: ``generate_batch`` from a fresh Python process, public API only.

    python -m benchmarks.first_call --out $OUT                 # H100: ~1.5 min (32 x 8k / 512 new)
    python -m benchmarks.first_call --quick --out out          # CPU: the script's logic

Warm start across processes (docs/engine.md, "Warm start across processes"), two fresh processes on one folder:

    python -m benchmarks.first_call --compile-cache $DIR --warm-up-only --out $OUT   # 1: warm_up_engine into DIR
    python -m benchmarks.first_call --compile-cache $DIR --out $OUT                  # 2: first against second

``--compile-cache DIR`` calls ``hf_rocketkv.use_compile_cache(DIR)`` before the model is built; ``--warm-up-only``
builds the same model and pool, runs ``hf_rocketkv.warm_up_engine`` (every bucket, then one batch of
``--requests`` prompts of ``--prompt-len`` with 4 new tokens) and writes ``first_call_warm_up.json``. Each call's row
reports the Triton cache entries it added (``triton_cache_added``: kernels and launchers compiled, 0 when
everything came from the folder) and the kernels it loaded (``triton_kernels_loaded``: compiled or read from disk,
Triton's ``jit_cache_hook``).

Llama-3.1-8B shapes, random bf16 weights (``hf_rocketkv.bench.decode.build_model``; model build excluded),
``generate_batch(model, prompts, pool=KVBlockPool(model, max_gpu_bytes=...), sampling=SamplingParams.greedy(
max_tokens, ignore_eos=True))``: call 1 and call 2 take different random prompts of the same shape. Each call's wall
time includes prefill and every decode step. Call 1 is also sampled every 20 ms on every thread
(the engine steps on its own thread): the report lists the functions that were on a stack most often, in seconds
(Triton compilation, graph capture and allocator growth show up there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch

import hf_rocketkv
from benchmarks.triton_watch import TritonWatch
from hf_rocketkv import KVBlockPool
from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
from hf_rocketkv.serving import SamplingParams, generate_batch

GIB = 2**30


def prompts(count: int, length: int, vocab: int, seed: int, min_length: int | None = None) -> list[list[int]]:
    """``count`` random prompts of ``length`` tokens, or of lengths drawn uniformly from [min_length, length]."""
    generator = torch.Generator().manual_seed(seed)
    if min_length is None:
        return torch.randint(3, vocab, (count, length), generator=generator).tolist()
    lengths = torch.randint(min_length, length + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


class StackSampler:
    """Samples every thread's stack every ``interval`` s: seconds each function was on a stack (cumulative)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.counts, self._stop = interval, Counter(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                seen = set()
                while frame is not None:
                    code = frame.f_code
                    seen.add(f"{code.co_filename.split('site-packages/')[-1]}:{code.co_firstlineno}({code.co_name})")
                    frame = frame.f_back
                self.counts.update(seen)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def top(self, n: int = 60) -> list[tuple[str, float]]:
        return [(name, round(count * self.interval, 2)) for name, count in self.counts.most_common(n)]


def warm_up_only(model, pool, args, shapes, build_s: float, out: Path) -> None:
    """Process 1 of the warm-start recipe: the engine's kernels compiled into --compile-cache."""
    with TritonWatch() as watch:
        report = hf_rocketkv.warm_up_engine(model, pool=pool, batch_sizes=(args.requests,),
                                            prompt_tokens=args.prompt_len, new_tokens=4, max_tokens=args.new_tokens)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
    row = {**header(args, model, build_s), "warm_up_engine": report, "triton_cache_added": watch.added,
           "triton_kernels_loaded": len(watch.loaded)}
    (out / "first_call_warm_up.json").write_text(json.dumps(row, indent=2, default=str))
    print(f"warm_up_engine: {report['seconds']:.2f} s, {watch.added} Triton cache entries added -> "
          f"{out / 'first_call_warm_up.json'}")


def header(args, model, build_s: float) -> dict:
    return {
        "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("COMMIT", "unknown"), "label": args.label,
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "min_prompt_len": args.min_prompt_len,
                     "new_tokens": args.new_tokens,
                     "pool_gib": args.pool_gib}, "model_build_s": round(build_s, 2),
        "compile_cache": args.compile_cache, "compile_cache_found": args.compile_cache_found,
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
    }


def timed_call(model, batch, pool, params, profile: bool) -> tuple[float, list | None]:
    sampler = StackSampler() if profile else None
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if sampler:
        with sampler:
            results = generate_batch(model, batch, pool=pool, sampling=params)
    else:
        results = generate_batch(model, batch, pool=pool, sampling=params)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    short = [(i, len(r.token_ids), r.finish_reason) for i, r in enumerate(results) if len(r.token_ids) != params.max_tokens]
    assert not short, f"requests ended early (index, tokens, finish reason): {short}"
    return seconds, sampler.top() if sampler else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--min-prompt-len", type=int, default=None,
                        help="prompt lengths drawn uniformly from [this, --prompt-len] (default: all --prompt-len)")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--pool-gib", type=float, default=30.0)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--label", default="")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="hf_rocketkv.use_compile_cache(DIR) before the model is built")
    parser.add_argument("--warm-up-only", action="store_true",
                        help="run hf_rocketkv.warm_up_engine into --compile-cache instead of the two calls")
    args = parser.parse_args()
    if args.warm_up_only and not args.compile_cache:
        parser.error("--warm-up-only needs --compile-cache DIR (the folder the next process starts from)")
    # before torch.cuda or Triton compile anything
    args.compile_cache_found = hf_rocketkv.use_compile_cache(args.compile_cache) if args.compile_cache else None
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    if args.quick:
        args.requests, args.prompt_len, args.new_tokens, args.pool_gib = 4, 96, 8, 0.05
    shapes = TINY if args.quick else LLAMA_31_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    started = time.perf_counter()
    model = build_model(shapes, None, dtype, device, seed=0)
    hf_rocketkv.enable(model)
    build_s = time.perf_counter() - started
    pool = KVBlockPool(model, max_gpu_bytes=int(args.pool_gib * GIB))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.warm_up_only:
        warm_up_only(model, pool, args, shapes, build_s, out)
        return
    params = SamplingParams.greedy(args.new_tokens, ignore_eos=True)
    out_tokens = args.requests * args.new_tokens
    rows = []
    for call in (1, 2):
        batch = prompts(args.requests, args.prompt_len, shapes["vocab_size"], seed=call, min_length=args.min_prompt_len)
        with TritonWatch() as watch:
            seconds, top = timed_call(model, batch, pool, params, profile=args.profile and call == 1)
        rows.append({"call": call, "seconds": round(seconds, 3), "output_tok_s": round(out_tokens / seconds, 1),
                     "triton_cache_added": watch.added, "triton_kernels_loaded": len(watch.loaded),
                     "triton_kernels": watch.loaded[:80], "stack_top": top})
        print(f"call {call}: {seconds:.2f} s = {out_tokens / seconds:.0f} tok/s, {watch.added} Triton cache entries "
              f"added, {len(watch.loaded)} kernels loaded", flush=True)
    report = {
        **header(args, model, build_s), "calls": rows,
        "first_over_second": round(rows[0]["seconds"] / rows[1]["seconds"], 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if device.type == "cuda" else None,
        "hf_rocketkv": hf_rocketkv.__version__ if hasattr(hf_rocketkv, "__version__") else None,
    }
    name = f"first_call{('_' + args.label) if args.label else ''}.json"
    (out / name).write_text(json.dumps(report, indent=2, default=str))
    print(f"first/second = {report['first_over_second']}  -> {out / name}")


if __name__ == "__main__":
    main()
