"""Hybrid models through the batching engine: ``generate_batch`` over a ``KVBlockPool``, first and second call.

    python -m benchmarks.hybrid_batching --model gemma-3-12b --requests 16 --prompt-len 8192 --new-tokens 256 --out $OUT
    python -m benchmarks.hybrid_batching --model gpt-oss-20b --requests 32 --prompt-len 8192 --new-tokens 256 --out $OUT
    python -m benchmarks.hybrid_batching --quick --out out/hybrid_batching     # tiny shapes on the CPU (seconds)

Random bf16 weights with the published shapes (``benchmarks/hybrid_decode.py``'s models), one process, what a user
runs: ``generate_batch(model, prompts, pool=KVBlockPool(model, max_gpu_bytes=--pool-gib GiB),
sampling=SamplingParams.greedy(n, ignore_eos=True))`` with the library's defaults otherwise, prefill included, model
build excluded. Two calls with different random prompts: the first pays the engine's warm-up (CUDA graphs, Triton
JIT: say whether the Triton cache was cold), the second is the steady state.

Columns per call: ``wall_s``, ``output_tokens_per_s`` (requests x new tokens / wall), ``peak_gib``
(``torch.cuda.max_memory_allocated``). Writes ``hybrid_batching.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

import hf_rocketkv
from hf_rocketkv import KVBlockPool, generate_batch
from hf_rocketkv.serving.sampling import SamplingParams

from .hybrid_decode import MODELS, build_model


def run_call(model, prompts: list[list[int]], pool, new_tokens: int) -> dict:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    results = generate_batch(model, prompts, pool=pool, sampling=SamplingParams.greedy(new_tokens, ignore_eos=True))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    produced = sum(len(r.token_ids) for r in results)
    if produced != len(prompts) * new_tokens:
        raise RuntimeError(f"hybrid_batching: {produced} tokens produced, {len(prompts) * new_tokens} asked")
    return dict(wall_s=wall, output_tokens=produced, output_tokens_per_s=produced / wall,
                peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                first_tokens=[r.token_ids[:4] for r in results[:2]])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="gemma-3-12b")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--pool-gib", type=float, default=30.0)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers of the model")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, fp32, CPU: checks the logic in seconds")
    parser.add_argument("--out", default="out/hybrid_batching")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        args.requests, args.prompt_len, args.new_tokens, args.pool_gib = 3, 64, 4, 0.05
    model, _ = build_model(args.model, args.quick, args.layers, dtype, device)
    hf_rocketkv.enable(model)
    pool = KVBlockPool(model, max_gpu_bytes=int(args.pool_gib * 2**30)) if device.type == "cuda" else \
        KVBlockPool(model, max_gpu_bytes=int(args.pool_gib * 2**30), device=device)
    generator = torch.Generator().manual_seed(0)
    calls = []
    for call in ("first", "second"):
        prompts = torch.randint(3, model.config.vocab_size, (args.requests, args.prompt_len), generator=generator)
        calls.append(dict(call=call, **run_call(model, prompts.tolist(), pool, args.new_tokens)))
    report = dict(
        benchmark="hybrid_batching", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, model=args.model, layers=args.layers or model.config.num_hidden_layers,
        requests=args.requests, prompt_len=args.prompt_len, new_tokens=args.new_tokens, pool_gib=args.pool_gib,
        calls=calls,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_batching.json").write_text(json.dumps(report, indent=1))
    for row in calls:
        print(f"{args.model} {args.requests} x {args.prompt_len} / {args.new_tokens} {row['call']} call: "
              f"{row['wall_s']:.1f} s = {row['output_tokens_per_s']:.0f} tok/s, peak {row['peak_gib'] or 0:.1f} GiB")
    return report


if __name__ == "__main__":
    main()
