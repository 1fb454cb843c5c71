"""Packed engine steps against alternating ones, side by side in one process: ``generate_batch`` with
``BatchingConfig(packed_steps=True)`` (a prompt chunk and the decode step in one forward) and with the default
(a decode forward, then the chunk's own forward).

    python -m benchmarks.packed_steps [--out DIR]        # Llama-3.1-8B shapes, random bf16 weights, one GPU
    python -m benchmarks.packed_steps --quick            # tiny model on the CPU: the script's logic

One model and one ``KVBlockPool`` serve every call. Each workload (``--workloads``: ``N x P / T`` = N prompts of P
tokens, ``N x A-B / T`` = lengths uniform in [A, B], T new tokens, greedy, EOS ignored) is run once per mode to warm
up, then ``--rounds`` times per mode, the modes alternating (so drift of the clock or the allocator falls on both);
every call gets prompts of its own (no prefix hit). Reported per workload and mode: each timed call's output tokens/s
(all output tokens / wall time of the ``generate_batch`` call, prefill included), their median, the packed forwards
per call, and ``packed_vs_alternating`` (median tokens/s ratio). ``--chunk``: ``prefill_chunk_tokens`` and
``prefill_token_budget`` of both modes (default: ``offline_batching_config``'s on this device).

Writes ``packed_steps.json`` under --out (default $OUT, else ./out) with the device, date, commit and command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

DEFAULT_WORKLOADS = "32x8192/512,64x512-16384/256"


def parse_workload(text: str) -> tuple[int, int, int | None, int]:
    """``"32x8192/512"`` -> (32, 8192, None, 512); ``"64x512-16384/256"`` -> (64, 16384, 512, 256)."""
    count, rest = text.split("x", 1)
    lengths, new = rest.split("/")
    low, _, high = lengths.partition("-")
    return (int(count), int(high), int(low), int(new)) if high else (int(count), int(low), None, int(new))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default=None, help=f"comma separated (default {DEFAULT_WORKLOADS})")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument("--pool-gib", type=float, default=40.0)
    args = parser.parse_args(argv)

    import hf_rocketkv
    from benchmarks.first_call import prompts
    from hf_rocketkv import KVBlockPool, generate_batch
    from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
    from hf_rocketkv.serving import SamplingParams
    from hf_rocketkv.serving.batch import offline_batching_config
    from hf_rocketkv.serving.batching.scheduler import BatchingConfig

    device = torch.device("cpu" if args.quick else "cuda")
    shapes = TINY if args.quick else LLAMA_31_8B
    workloads = args.workloads or ("3x96/8,4x16-96/6" if args.quick else DEFAULT_WORKLOADS)
    model = build_model(shapes, None, torch.float32 if args.quick else torch.bfloat16, device, 0)
    hf_rocketkv.enable(model)
    pool = KVBlockPool(model, max_gpu_bytes=int((0.05 if args.quick else args.pool_gib) * 2**30))
    counter = PackedCounter(model)
    chunk = args.chunk or (32 if args.quick else offline_batching_config(model).prefill_chunk_tokens)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
                    "command": " ".join(["python -m benchmarks.packed_steps"] + (argv or sys.argv[1:])),
                    "prefill_chunk_tokens": chunk, "workloads": []}
    seed = 0
    for text in workloads.split(","):
        count, length, low, new = parse_workload(text)
        params = SamplingParams.greedy(new, ignore_eos=True)
        rows = {"alternating": [], "packed": []}
        packed_forwards = {"alternating": [], "packed": []}
        for round_ in range(args.rounds + 1):
            for mode in ("alternating", "packed"):
                seed += 1
                batch = prompts(count, length, shapes["vocab_size"], seed=seed, min_length=low)
                batching = BatchingConfig(prefill_chunk_tokens=chunk, prefill_token_budget=chunk,
                                          packed_steps=mode == "packed", max_queue=max(256, count))
                counter.count = 0
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                results = generate_batch(model, batch, pool=pool, sampling=params, batching=batching)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                assert all(len(r.token_ids) == new for r in results), "a request ended early"
                if round_ == 0:
                    continue  # the warm-up call of this mode
                rows[mode].append(count * new / seconds)
                packed_forwards[mode].append(counter.count)
                print(f"{text} {mode}: {count * new / seconds:.1f} tok/s ({seconds:.2f} s, {counter.count} packed "
                      f"forwards)", flush=True)
        medians = {mode: statistics.median(values) for mode, values in rows.items()}
        report["workloads"].append({"workload": text, "tokens_per_s": rows, "median_tokens_per_s": medians,
                                    "packed_forwards": packed_forwards,
                                    "packed_vs_alternating": medians["packed"] / medians["alternating"]})
        _save(args.out, report)
    report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    _save(args.out, report)
    print(json.dumps(report, indent=1))
    return report


class PackedCounter:
    """Counts the model's forwards that carried decoding rows and a prompt chunk (a ``PackedStepCache``)."""

    def __init__(self, model):
        from hf_rocketkv.cache import PackedStepCache

        self.count, self._kind = 0, PackedStepCache
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if isinstance(kwargs.get("past_key_values", kwargs.get("cache")), self._kind):
            self.count += 1


def _save(out: str, report: dict) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "packed_steps.json").write_text(json.dumps(report, indent=1))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
