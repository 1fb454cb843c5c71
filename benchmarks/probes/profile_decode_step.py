"""Where one compiled decode step spends its time, on a GPU.

    TORCH_LOGS=perf_hints python -m benchmarks.probes.profile_decode_step --caches rocketkv-compile \
        --batch 1 --context 32768 --out out/profile

For each cache: a first generate() compiles the decode step; a second one of the same shapes runs under
torch.profiler for a few decode steps only (compilation excluded), and reports per step: wall time, GPU busy time
(sum of kernel durations), kernels and CUDA-graph launches, device syncs, and the top kernels. Then it replays
generate()'s compiled forward back to back on the cache that request left (no per-step host work of generate(),
no sync between steps): the GPU-bound floor of a decode step. Writes a JSON summary and a Chrome trace per cache.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import hf_rocketkv
from hf_rocketkv import RocketKVCache
from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model
from hf_rocketkv.config import RocketKVConfig


class ProfileWindow:
    """Logits processor: starts the profiler before decode step ``first`` and stops it after ``steps`` steps."""

    def __init__(self, profiler, first: int, steps: int):
        self.profiler, self.first, self.steps = profiler, first, steps
        self.count = 0
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.count += 1
        self.times.append(time.perf_counter())
        if self.count == self.first:
            self.profiler.start()
        elif self.count == self.first + self.steps:
            self.profiler.stop()
        return scores


class StopAfter(StoppingCriteria):
    """Ends generate() after ``n`` tokens while its cache keeps capacity for max_new_tokens (room for replays)."""

    def __init__(self, n: int):
        self.n, self.count = n, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.count += 1
        return torch.full((input_ids.shape[0],), self.count >= self.n, dtype=torch.bool, device=input_ids.device)


def record_compiled_calls(model):
    """Wrap model.get_compiled_call so the last compiled call's inputs can be replayed."""
    original = model.get_compiled_call
    last: dict = {}

    def get_compiled_call(compile_config):
        compiled = original(compile_config)

        def call(**kwargs):
            last.clear()
            last.update(kwargs)
            last["__fn__"] = compiled
            return compiled(**kwargs)

        return call

    model.get_compiled_call = get_compiled_call
    return last


def summarize(profiler, steps: int) -> dict:
    gpu_us = 0.0
    kernels = collections.Counter()
    kernel_us = collections.Counter()
    runtime = collections.Counter()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += 1
            kernel_us[event.name] += event.device_time
            gpu_us += event.device_time
        elif event.name.startswith(("cuda", "cu")):
            runtime[event.name] += 1
    top = [dict(name=name[:110], calls_per_step=kernels[name] / steps, us_per_step=us / steps)
           for name, us in kernel_us.most_common(30)]
    return dict(gpu_busy_ms_per_step=gpu_us / steps / 1e3, kernels_per_step=sum(kernels.values()) / steps,
                runtime_calls_per_step={k: v / steps for k, v in runtime.most_common(15)}, top_kernels=top)


def replay(last: dict, n: int) -> float:
    """ms per back-to-back call of the compiled forward with the last decode step's inputs."""
    fn = last["__fn__"]
    kwargs = {k: v for k, v in last.items() if k != "__fn__"}
    with torch.no_grad():  # generate() runs under no_grad; grad mode is part of the compiled graph's guards
        return _replay(fn, kwargs, n)


def _replay(fn, kwargs: dict, n: int) -> float:
    for _ in range(3):
        fn(**kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn(**kwargs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def run_one(model, cache: str, batch: int, context: int, args, out: Path) -> dict:
    ids = torch.randint(3, model.config.vocab_size, (batch, context), device="cuda")
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens + args.replays + 8,
               do_sample=False, eos_token_id=None, pad_token_id=0)
    rocket = RocketKVConfig(backend="triton")

    def kwargs():
        if cache == "rocketkv-compile":
            hf_rocketkv.enable(model)
            return dict(cache=RocketKVCache(rocket))
        model.set_attn_implementation("sdpa")
        return dict(cache_implementation="static")

    last = record_compiled_calls(model)
    t0 = time.perf_counter()
    model.generate(ids, stopping_criteria=StoppingCriteriaList([StopAfter(args.new_tokens)]), **gen, **kwargs())
    compile_s = time.perf_counter() - t0
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    window = ProfileWindow(profiler, first=args.new_tokens // 2, steps=args.steps)
    extra = kwargs()
    model.generate(ids, logits_processor=LogitsProcessorList([window]),
                   stopping_criteria=StoppingCriteriaList([StopAfter(args.new_tokens)]), **gen, **extra)
    gaps = [b - a for a, b in zip(window.times, window.times[1:])][3:]
    wall_ms = sorted(gaps)[len(gaps) // 2] * 1e3
    name = f"{cache}_b{batch}_{context}"
    profiler.export_chrome_trace(str(out / f"trace_{name}.json"))
    row = dict(cache=cache, batch=batch, context=context, first_generate_s=compile_s, generate_ms_per_step=wall_ms,
               **summarize(profiler, args.steps))
    row["replay_ms_per_step"] = replay(last, args.replays) if "__fn__" in last else None
    del extra
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--caches", nargs="+", default=["rocketkv-compile"], choices=["rocketkv-compile", "static-compile"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1])
    parser.add_argument("--context", nargs="+", type=int, default=[32768])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default="out/profile")
    args = parser.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(LLAMA_31_8B, args.layers, torch.bfloat16, torch.device("cuda"), seed=0)
    rows = []
    for batch in args.batch:
        for context in args.context:
            for cache in args.caches:
                row = run_one(model, cache, batch, context, args, out)
                top = row.pop("top_kernels")
                print(json.dumps(row), flush=True)
                for k in top[:20]:
                    print(f"   {k['us_per_step']:9.1f} us/step {k['calls_per_step']:6.1f}x  {k['name']}")
                row["top_kernels"] = top
                rows.append(row)
                torch.cuda.empty_cache()
    (out / "profile_decode_step.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
