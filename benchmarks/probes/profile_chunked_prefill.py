"""What one chunk of a chunked prefill costs, chunk by chunk, against transformers' own chunked prefill, on a GPU.

    python -m benchmarks.probes.profile_chunked_prefill --out $OUT                 # H100: about 1 minute
    python -m benchmarks.probes.profile_chunked_prefill --quick --out out          # CPU smoke run

The batching engine prefills a long prompt in chunks between decode steps (serving/batching/chunked_prefill.py), so a
chunk's time is what every running request waits for between two tokens. Llama-3.1-8B shapes, random bf16 weights,
RocketKVConfig() defaults on the Triton backend. One --prompt-len prompt per chunk size in --chunks, two ways side
by side:

    rocketkv      ``ChunkedPrefill`` on a pool-backed RocketKVCache, as the engine runs it (the last chunk runs
                  stage 1 on every layer)
    dynamic       the same chunks through transformers' DynamicCache (sdpa): the floor for a chunk at that offset

Each chunk is timed to its end on the device (host time to return beside it). Reported per chunk size: median and
max chunk ms, the last chunk's ms, the whole prefill's seconds; with --profile, one chunk near the prompt's end and
the last chunk under torch.profiler (top ops, syncs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_prefix_reuse import setup
from benchmarks.probes.profile_prefix_hit import profiled, summarize, sync, write_report
from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.serving.batching.chunked_prefill import ChunkedPrefill

GIB = 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--prompt-len", type=int, default=32768)
    parser.add_argument("--chunks", default="512,2048", help="chunk sizes (tokens), comma separated")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than Llama-3.1-8B's 32")
    parser.add_argument("--profile", action="store_true", help="profile a late chunk and the last one")
    return parser.parse_args()


def timed_chunks(run_chunk, count: int, device: torch.device) -> list[dict]:
    """``run_chunk(i)`` for i in range(count), each timed to its end on the device and to its return on the host."""
    times = []
    for index in range(count):
        sync(device)
        start = time.perf_counter()
        run_chunk(index)
        host = time.perf_counter() - start
        sync(device)
        times.append({"ms": (time.perf_counter() - start) * 1e3, "host_ms": host * 1e3})
    return times


def rocketkv_prefill(model, config, pool, ids: torch.Tensor, chunk: int, device, profile_at=None) -> dict:
    """The prompt through ``ChunkedPrefill`` (the engine's path) in ``chunk``-token chunks; chunk ``profile_at`` and
    the last one under the profiler when given."""
    cache = RocketKVCache(config, pool=pool, cache_salt=f"run-{time.monotonic_ns()}")  # cold: no earlier run's hit
    prefill = ChunkedPrefill(model, cache, ids[0].tolist(), max_new_tokens=64, reservation=None, chunk_tokens=chunk,
                             device=device)
    count = -(-prefill.left // chunk)
    profiles = {}

    def run_chunk(index):
        if profile_at is not None and index in (profile_at, count - 1):
            name = "last_chunk" if index == count - 1 else f"chunk_{index}"
            profiles[name] = profiled(device, lambda: prefill.run(chunk))
        else:
            prefill.run(chunk)

    try:
        times = timed_chunks(run_chunk, count, device)
    finally:
        prefill.abort()
        cache.close()
    return {"times": times, "profiles": profiles}


def dynamic_prefill(model, ids: torch.Tensor, chunk: int, device) -> dict:
    """The same chunks through transformers' DynamicCache (the model's sdpa attention, no RocketKV)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    count = -(-ids.shape[1] // chunk)

    def run_chunk(index):
        start, end = index * chunk, min(ids.shape[1], (index + 1) * chunk)
        with model_attention(model, "sdpa"):
            model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end, device=device)[None],
                  **cache_kwargs(cache), use_cache=True, logits_to_keep=1)

    return {"times": timed_chunks(run_chunk, count, device)}


class model_attention:
    """The model's attention implementation set to ``name`` inside the block (the RocketKV one is put back)."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        self.model.config._attn_implementation = self.name

    def __exit__(self, *exc):
        self.model.config._attn_implementation = self.previous


def summary(times: list[dict]) -> dict:
    ms = [t["ms"] for t in times]
    return {"chunks": len(ms), "median_ms": statistics.median(ms), "max_ms": max(ms), "last_ms": ms[-1],
            "total_s": sum(ms) / 1e3, "median_host_ms": statistics.median(t["host_ms"] for t in times),
            "first_ms": ms[0], "quarter_ms": [ms[int(q * (len(ms) - 1))] for q in (0.25, 0.5, 0.75)],
            "ms": [round(m, 3) for m in ms]}


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    torch.set_grad_enabled(False)
    config, _, model = setup(device, args.quick, layers=args.layers)
    prompt_len = min(args.prompt_len, 256) if args.quick else args.prompt_len
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.quick:
        chunks = sorted({min(c, 64 * (i + 1)) for i, c in enumerate(chunks)})
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=generator).to(device)
    pool = KVBlockPool(model, max_gpu_bytes=int((0.05 if args.quick else 12) * GIB), page_size=16,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=device)
    report: dict = {"prompt_len": prompt_len, "chunks": {}, "device": torch.cuda.get_device_name() if
                    device.type == "cuda" else "cpu", "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    rocketkv_prefill(model, config, pool, ids[:, :2 * chunks[0]], chunks[0], device)  # warm-up (JIT, allocator)
    dynamic_prefill(model, ids[:, :2 * chunks[0]], chunks[0], device)
    out = Path(args.out)
    for chunk in chunks:
        count = -(-prompt_len // chunk)
        rocket = rocketkv_prefill(model, config, pool, ids, chunk, device,
                                  profile_at=max(0, count - 2) if args.profile and count > 1 else None)
        dynamic = dynamic_prefill(model, ids, chunk, device)
        entry = {"rocketkv": summary(rocket["times"]), "dynamic": summary(dynamic["times"])}
        entry["median_ratio"] = entry["rocketkv"]["median_ms"] / entry["dynamic"]["median_ms"]
        for name, prof in rocket["profiles"].items():
            profile: dict = {}
            summarize(prof, device, profile)
            entry[f"profile_{name}"] = profile
        report["chunks"][str(chunk)] = entry
        print(f"chunk {chunk}: rocketkv median {entry['rocketkv']['median_ms']:.1f} ms (max "
              f"{entry['rocketkv']['max_ms']:.1f}, last {entry['rocketkv']['last_ms']:.1f}, total "
              f"{entry['rocketkv']['total_s']:.2f} s, host {entry['rocketkv']['median_host_ms']:.1f}); dynamic median "
              f"{entry['dynamic']['median_ms']:.1f} ms (max {entry['dynamic']['max_ms']:.1f}, total "
              f"{entry['dynamic']['total_s']:.2f} s)", flush=True)
    write_report(report, out / "profile_chunked_prefill.json")


if __name__ == "__main__":
    main()
