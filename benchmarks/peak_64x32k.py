"""Peak GPU memory of generate_batch 64 x 32k / 32 new, and where it comes from (model, pool, per-phase transients).

    python -m benchmarks.peak_64x32k --pool default --out $OUT   # H100: ~2.5 min; KVBlockPool(model): 0.9 x free
    python -m benchmarks.peak_64x32k --pool 30 --out $OUT        # H100: ~2.5 min; KVBlockPool(model, 30 GiB)
    python -m benchmarks.peak_64x32k --quick --out out           # CPU: the script's logic (no CUDA numbers)

Llama-3.1-8B shapes, random bf16 weights (``hf_rocketkv.bench.decode.build_model``), ``RocketKVConfig()`` defaults,
``generate_batch(model, prompts, pool=pool, sampling=SamplingParams.greedy(32, ignore_eos=True))`` with 64 random
prompts of 32,768 tokens (public API; the engine's default ``BatchingConfig``: chunked prefill of 8192 tokens).

Reported (``peak_64x32k_<pool>.json``): ``torch.cuda.max_memory_allocated`` over the call, the model's bytes and the
pool's (``memory_allocated`` before and after building each), and for each phase of the engine the largest
transient above what was allocated when it began (the allocator's accounting is host-side, so brackets on the engine
thread are exact without a sync): ``prefill_chunk`` (a chunk that is not a prompt's last), ``prefill_last`` (a
prompt's last chunk: stage 1 of every layer runs at its end), ``decode_step`` (one batched decode step, graphs
captured on first use included). The phase and counters of the call's peak, the allocator's peak reserved bytes
and its retries, and with ``--snapshot`` a ``torch.cuda.memory._dump_snapshot`` pickle at the end of the call
(open it at https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

import hf_rocketkv
from hf_rocketkv import KVBlockPool
from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
from hf_rocketkv.serving import SamplingParams, generate_batch
from hf_rocketkv.serving.batching.chunked_prefill import ChunkedPrefill
from hf_rocketkv.serving.batching.decode_step import BatchDecoder

GIB = 2**30


class PhasePeaks:
    """Brackets ``ChunkedPrefill.run`` and ``BatchDecoder.step`` (class-level, for the call): per phase, the largest
    peak above the bytes allocated when it began, and the absolute peak with the phase that reached it."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.transient: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.peak = (0, None, None)  # (bytes, phase, call index of that phase)
        self._saved = {}

    def _bracket(self, phase_of, original):
        peaks = self

        def wrapped(*args, **kwargs):
            phase = phase_of(*args)
            before = torch.cuda.memory_allocated() if peaks.cuda else 0
            if peaks.cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                return original(*args, **kwargs)
            finally:
                peaks.calls[phase] += 1
                if peaks.cuda:
                    top = torch.cuda.max_memory_allocated()
                    peaks.transient[phase] = max(peaks.transient[phase], top - before)
                    if top > peaks.peak[0]:
                        peaks.peak = (top, phase, peaks.calls[phase])

        return wrapped

    def __enter__(self):
        def prefill_phase(prefill, tokens):
            return "prefill_last" if prefill.position + tokens >= prefill.prompt_len else "prefill_chunk"

        for owner, name, phase_of in ((ChunkedPrefill, "run", prefill_phase),
                                      (BatchDecoder, "step", lambda *_: "decode_step")):
            original = getattr(owner, name)
            self._saved[(owner, name)] = original
            setattr(owner, name, self._bracket(phase_of, original))
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)


def run(args, model, shapes, device) -> dict:
    cuda = device.type == "cuda"
    before_pool = torch.cuda.memory_allocated() if cuda else 0
    pool = KVBlockPool(model) if args.pool == "default" else KVBlockPool(model, max_gpu_bytes=int(float(args.pool) * GIB))
    pool_bytes = torch.cuda.memory_allocated() - before_pool if cuda else None
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shapes["vocab_size"], (args.requests, args.prompt_len), generator=generator).tolist()
    params = SamplingParams.greedy(args.new_tokens, ignore_eos=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if args.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
    start_allocated = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    with PhasePeaks(cuda) as phases:
        results = generate_batch(model, prompts, pool=pool, sampling=params)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    short = [(i, len(r.token_ids), r.finish_reason) for i, r in enumerate(results) if len(r.token_ids) != args.new_tokens]
    assert not short, f"requests ended early (index, tokens, finish reason): {short[:4]}"
    snapshot = None
    if cuda and args.snapshot:
        snapshot = str(Path(args.out) / f"peak_64x32k_{args.pool}_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats() if cuda else {}
    gib = (lambda b: None if b is None else round(b / GIB, 3))
    return {
        "pool": args.pool, "pool_pages": pool.total_pages(), "pool_page_size": pool.page_size,
        "pool_gib": gib(pool_bytes), "seconds": round(seconds, 2),
        # PhasePeaks resets the peak counter per phase: the call's peak is the largest phase peak
        "peak_gib": gib(phases.peak[0]) if cuda else None,
        "peak_phase": phases.peak[1], "peak_phase_call": phases.peak[2],
        "allocated_at_start_gib": gib(start_allocated) if cuda else None,
        "transient_gib": {phase: gib(b) for phase, b in phases.transient.items()} if cuda else None,
        "phase_calls": dict(phases.calls),
        "reserved_peak_gib": gib(stats.get("reserved_bytes.all.peak")) if cuda else None,
        "alloc_retries": stats.get("num_alloc_retries"), "ooms": stats.get("num_ooms"),
        "snapshot": snapshot,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes: the script's logic")
    parser.add_argument("--pool", default="default", help="'default' (KVBlockPool(model)) or a size in GiB")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--snapshot", action="store_true", help="also dump torch.cuda's memory snapshot (pickle)")
    args = parser.parse_args()
    if args.pool != "default":
        try:
            if float(args.pool) <= 0:
                raise ValueError
        except ValueError:
            parser.error(f"--pool must be 'default' or a size in GiB > 0, got {args.pool!r}")
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    if args.quick:
        args.requests, args.prompt_len, args.new_tokens = 4, 96, 4
        args.pool = args.pool if args.pool == "default" else "0.05"
    shapes = TINY if args.quick else LLAMA_31_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model = build_model(shapes, None, dtype, device, seed=0)
    hf_rocketkv.enable(model)
    weights = torch.cuda.memory_allocated() if device.type == "cuda" else None
    row = run(args, model, shapes, device)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("COMMIT", "unknown"),
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "model_gib": round(weights / GIB, 3) if weights is not None else None, **row,
    }
    if report["peak_gib"] is not None:
        report["other_at_peak_gib"] = round(report["peak_gib"] - report["model_gib"] - report["pool_gib"], 3)
    out = Path(args.out) / f"peak_64x32k_{args.pool}.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
