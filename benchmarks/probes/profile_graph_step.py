"""Where a decode step of the default runner (``decode_runner="cuda_graphs"``) spends its device time, on a GPU.

    python -m benchmarks.probes.profile_graph_step --batch 32 --context 8192 --prefill-batch-size 8 --out out/pg

One generate() captures the step's graph; a second one of the same shapes runs with torch.profiler on for
``--steps`` decode steps in its middle (graph replays only: the kernels inside a replayed CUDA graph are traced one by
one). Per step: wall time between CUDA events, GPU busy time (sum of kernel durations), the kernels, and the device
time per kernel family (GEMMs, RocketKV's Triton kernels, the rest of the model's kernels). With ``--eager`` the same
for the eager step (its launches).

The floor it is compared to: the weights' bytes read once per step at the device's bandwidth (``--bandwidth-tbs``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
import statistics
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from hf_rocketkv import RocketKVCache
from hf_rocketkv.bench.decode import LLAMA_31_8B, StepClock, build_model, pool_for_row, warm_up
from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.integration.registration import enable

FAMILIES = (  # (family, regex on the kernel name), first match wins
    ("rocketkv triton", re.compile(r"_append_token|_build_kt|_update_kt|_page_logits|_page_probs|_select_|"
                                   r"_sparse_decode|_window_|_fused_select|_fused_combine")),
    ("gemm", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|sm90_|sm80_|cublas", re.I)),
    ("attention (dense)", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("copy / index", re.compile(r"copy|index|gather|scatter|cat|fill", re.I)),
    ("reduce / softmax / topk", re.compile(r"reduce|softmax|topk|sort|argmax|max|sum|norm", re.I)),
)


class ProfileWindow:
    """Logits processor: starts ``profiler`` before decode step ``first``, stops it after ``steps`` steps."""

    def __init__(self, profiler, first: int, steps: int):
        self.profiler, self.first, self.steps, self.count = profiler, first, steps, 0

    def __call__(self, input_ids, scores):
        self.count += 1
        if self.count == self.first:
            torch.cuda.synchronize()
            self.profiler.start()
        elif self.count == self.first + self.steps:
            torch.cuda.synchronize()
            self.profiler.stop()
        return scores


def family_of(name: str) -> str:
    for family, pattern in FAMILIES:
        if pattern.search(name):
            return family
    return "other"


def kernel_table(profiler, steps: int) -> dict:
    """Device time per step: total, per family, top kernels."""
    us = collections.Counter()
    calls = collections.Counter()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            us[event.name] += event.device_time
            calls[event.name] += 1
    families = collections.Counter()
    for name, total in us.items():
        families[family_of(name)] += total
    return dict(
        gpu_busy_ms_per_step=sum(us.values()) / steps / 1e3,
        kernels_per_step=sum(calls.values()) / steps,
        families_ms_per_step={k: v / steps / 1e3 for k, v in families.most_common()},
        top_kernels=[dict(name=name[:120], family=family_of(name), calls_per_step=calls[name] / steps,
                          us_per_step=total / steps) for name, total in us.most_common(30)],
    )


def one_run(model, ids, rocket: RocketKVConfig, new_tokens: int, eager: bool, window: ProfileWindow | None,
            pool=None):
    clock = StepClock(ids.device)
    processors = [clock] + ([window] if window is not None else [])
    enable(model)
    model.generate(ids, attention_mask=torch.ones_like(ids), cache=RocketKVCache(rocket, pool=pool),
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                   logits_processor=LogitsProcessorList(processors), disable_compile=eager)
    times = clock.seconds()
    steps = [b - a for a, b in zip(times, times[1:])][4:]
    return statistics.median(steps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--prefill-batch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eager", action="store_true", help="also profile the eager step")
    parser.add_argument("--regions", action="store_true", help="hf_rocketkv.compile_regions(model) first")
    parser.add_argument("--rope-off", action="store_true", help="RocketKVConfig(fused_rope=False): transformers' RoPE")
    parser.add_argument("--bandwidth-tbs", type=float, default=3.35, help="device memory bandwidth (H100 SXM: 3.35)")
    parser.add_argument("--pool", default="none", choices=["none", "model", "fp8"],
                        help="cache pages: private (none), a KVBlockPool of the model's dtype, or of fp8 (e4m3)")
    parser.add_argument("--out", default="out/profile_graph_step")
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    torch.backends.cuda.enable_cudnn_sdp(False)  # as bench_decode: cuDNN re-plans per KV length when eager
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(LLAMA_31_8B, args.layers, torch.bfloat16, device, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.regions:
        from hf_rocketkv import compile_regions

        compile_regions(model)
    rocket = RocketKVConfig(backend="triton", decode_runner="cuda_graphs",
                            prefill_batch_size=min(args.batch, args.prefill_batch_size), fused_rope=not args.rope_off)
    warm_up(model, ["rocketkv"], rocket, device)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context), device=device)
    row = {"none": "rocketkv-graphs", "model": "rocketkv-graphs-pool", "fp8": "rocketkv-graphs-pool-fp8"}[args.pool]
    pool = pool_for_row(model, row, rocket, args.batch, args.context, args.new_tokens)
    report = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(device),
                  torch=torch.__version__, regions=args.regions, fused_rope=not args.rope_off, batch=args.batch, context=args.context, pool=args.pool,
                  layers=model.config.num_hidden_layers,
                  weight_gb=weight_bytes / 1e9, weight_floor_ms=weight_bytes / (args.bandwidth_tbs * 1e12) * 1e3)
    runs = [("graphs", False)] + ([("eager", True)] if args.eager else [])
    for name, eager in runs:
        one_run(model, ids, rocket, 8, eager, None, pool)  # capture / warm-up
        profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        window = ProfileWindow(profiler, first=args.new_tokens // 2, steps=args.steps)
        wall = one_run(model, ids, rocket, args.new_tokens, eager, window, pool)
        unprofiled = one_run(model, ids, rocket, args.new_tokens, eager, None, pool)
        table = kernel_table(profiler, args.steps)
        profiler.export_chrome_trace(str(out / f"trace_{name}_b{args.batch}_{args.context}_{args.pool}.json"))
        report[name] = dict(wall_ms_per_step=unprofiled, wall_ms_per_step_profiled=wall, **table)
        print(f"=== {name}: wall {unprofiled:.2f} ms/step (profiled {wall:.2f}); GPU busy "
              f"{table['gpu_busy_ms_per_step']:.2f} ms; {table['kernels_per_step']:.0f} kernels/step; "
              f"weights floor {report['weight_floor_ms']:.2f} ms", flush=True)
        for family, ms in table["families_ms_per_step"].items():
            print(f"   {ms:8.3f} ms  {family}")
        for k in table["top_kernels"][:25]:
            print(f"   {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  [{k['family']}] {k['name']}")
        torch.cuda.empty_cache()
    (out / f"profile_graph_step_{args.pool}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
