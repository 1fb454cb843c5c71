"""Where the batching engine's time goes on a hybrid model: prefill against decode, and a decode step by kind of kernel.

    python -m benchmarks.probes.engine_decode_profile --model gemma-3-12b --requests 16 --out $OUT/engine_profile

One process, random bf16 weights of the published shapes (``benchmarks/hybrid_decode.py``), ``generate_batch`` over a
``KVBlockPool(model, max_gpu_bytes=--pool-gib GiB)`` with greedy sampling and EOS ignored. A first call warms the
engine (graphs, Triton JIT); then, with other random prompts each time:

- ``wall_prefill_s``: a call asking one new token per request (the prompts' prefill, the first token);
- ``wall_full_s``: a call asking ``--new-tokens``; ``decode_ms_per_step`` = (full - prefill) / (new tokens - 1);
- under torch.profiler, a call of 1 new token and one of ``1 + --steps``: the difference of their kernels, per step,
  is one decode step of the batch by kind (``profile_hybrid_step.kind_of``) with its top kernels.

Writes ``engine_decode_profile.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
from pathlib import Path

import torch

import hf_rocketkv
from benchmarks.hybrid_batching import run_call
from benchmarks.hybrid_decode import MODELS, build_model
from benchmarks.probes.profile_hybrid_step import kind_of
from hf_rocketkv import KVBlockPool


def kernel_totals(profiler) -> tuple[collections.Counter, collections.Counter]:
    """Per kernel name: launches and device microseconds."""
    count, micros = collections.Counter(), collections.Counter()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count[event.name] += 1
            micros[event.name] += event.device_time
    return count, micros


def per_step(short: tuple, long: tuple, steps: int) -> dict:
    """The kernels of ``long`` less those of ``short`` (same prompts' shapes), per decode step."""
    count = {name: (long[0][name] - short[0].get(name, 0)) / steps for name in long[0]}
    micros = {name: (long[1][name] - short[1].get(name, 0)) / steps for name in long[1]}
    by_kind_us, by_kind_n = collections.Counter(), collections.Counter()
    for name in micros:
        by_kind_us[kind_of(name)] += micros[name]
        by_kind_n[kind_of(name)] += count[name]
    top = sorted(micros, key=micros.get, reverse=True)[:30]
    return dict(
        gpu_busy_ms_per_step=sum(micros.values()) / 1e3, kernels_per_step=sum(count.values()),
        by_kind={kind: dict(ms_per_step=us / 1e3, kernels_per_step=by_kind_n[kind])
                 for kind, us in by_kind_us.most_common()},
        top_kernels=[dict(name=name[:120], kind=kind_of(name), calls_per_step=count[name], us_per_step=micros[name])
                     for name in top])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="gemma-3-12b")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32, help="decode steps in the profiled call")
    parser.add_argument("--pool-gib", type=float, default=30.0)
    parser.add_argument("--out", default="out/engine_profile")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    model, _ = build_model(args.model, False, None, torch.bfloat16, device)
    hf_rocketkv.enable(model)
    pool = KVBlockPool(model, max_gpu_bytes=int(args.pool_gib * 2**30))
    generator = torch.Generator().manual_seed(0)

    def call(new_tokens: int) -> float:
        """Seconds of one ``generate_batch`` call on other random prompts (``hybrid_batching.run_call``)."""
        prompts = torch.randint(3, model.config.vocab_size, (args.requests, args.prompt_len), generator=generator)
        return run_call(model, prompts.tolist(), pool, new_tokens)["wall_s"]

    warm = call(args.new_tokens)
    prefill, full = call(1), call(args.new_tokens)
    profiles = []
    for new_tokens in (1, 1 + args.steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            call(new_tokens)
        profiles.append(kernel_totals(profiler))
    report = dict(
        benchmark="engine_decode_profile", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        device=torch.cuda.get_device_name(device), torch=torch.__version__, model=args.model,
        requests=args.requests, prompt_len=args.prompt_len, new_tokens=args.new_tokens, pool_gib=args.pool_gib,
        wall_warm_s=warm, wall_prefill_s=prefill, wall_full_s=full,
        output_tokens_per_s=args.requests * args.new_tokens / full,
        decode_ms_per_step=(full - prefill) / (args.new_tokens - 1) * 1e3,
        decode_step=per_step(profiles[0], profiles[1], args.steps))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_decode_profile.json").write_text(json.dumps(report, indent=1))
    step = report["decode_step"]
    print(f"{args.model} {args.requests} x {args.prompt_len} / {args.new_tokens}: {report['output_tokens_per_s']:.0f} "
          f"tok/s; prefill call {prefill:.2f} s, decode {report['decode_ms_per_step']:.2f} ms/step "
          f"(GPU busy {step['gpu_busy_ms_per_step']:.2f} ms, {step['kernels_per_step']:.0f} kernels)")
    for kind, row in step["by_kind"].items():
        print(f"  {kind:24s} {row['ms_per_step']:7.2f} ms {row['kernels_per_step']:7.0f} kernels")
    for row in step["top_kernels"][:12]:
        print(f"  {row['us_per_step']:8.0f} us x{row['calls_per_step']:5.0f} {row['name'][:90]}")
    return report


if __name__ == "__main__":
    main()
