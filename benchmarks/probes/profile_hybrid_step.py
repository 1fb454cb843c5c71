"""Where one decode step of a hybrid model (Gemma 3, gpt-oss; Llama-3.1-8B as the reference) spends its time, on a
GPU, by kind of kernel.

    python -m benchmarks.probes.profile_hybrid_step --model gemma-3-12b --context 32768 --out $OUT/profile

For each cache row (``rocketkv``: the defaults, decode captured as CUDA graphs; ``rocketkv-eager``;
``static-compile``: transformers' static cache, decode compiled by generate): one generate() warms up (JIT, graph
capture, compilation), a second one of the same shapes runs under torch.profiler for ``--steps`` decode steps and
reports per step: the median generate() gap, GPU busy time (the sum of kernel durations), the idle GPU time between
kernels (launch gaps up to 50 us, with the kernel pairs around the largest; longer host gaps), kernels, and time and
kernels by kind (weight GEMMs, attention, RocketKV's Triton kernels, normalisation, elementwise, copies and
indexing, other), with the top kernels. Random bf16 weights of the published configs' shapes
(``benchmarks/hybrid_decode.py``). Writes ``profile_hybrid_step.json`` and a Chrome trace per row under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
from pathlib import Path

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

import hf_rocketkv
from benchmarks.hybrid_decode import MODELS, REFERENCE_MODELS, build_model
from benchmarks.probes.profile_decode_step import ProfileWindow, StopAfter
from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.integration import compat

KINDS = (  # the first pattern a kernel's name matches decides its kind
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|splitk|matmul"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("rocketkv triton", r"page_logits|select|sparse|fused_decode|append|kt_|merge|window_scores|paged|topk|stage2"),
    ("norm and rope", r"rms|norm|rope|rotary"),
    ("copy and index", r"copy|index|gather|scatter|cat|memcpy|memset|fill"),
    ("elementwise and reduce", r"elementwise|reduce|vectorized|unrolled|triton_|pointwise"),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other")


HOST_GAP_US = 50.0  # an idle GPU between two kernels for longer than this waits on the host, not on a launch


def launch_and_host_gaps(profiler) -> tuple[float, float]:
    """Idle GPU time in the window, in us: the gaps between consecutive kernels up to ``HOST_GAP_US`` (the device's
    own launch latency, also inside a CUDA graph) and the longer ones (the GPU waiting for the host: generate()'s
    loop, sampling, input copies, graph launch)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in profiler.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    launch = host = 0.0
    end = spans[0][1] if spans else 0.0
    for start, stop in spans[1:]:
        gap = start - end
        if gap > 0:
            if gap <= HOST_GAP_US:
                launch += gap
            else:
                host += gap
        end = max(end, stop)
    return launch, host


def gap_pairs(profiler, steps: int, top: int = 30) -> list[dict]:
    """The launch gaps (up to ``HOST_GAP_US``) by the pair of kernels around them, largest total first: which
    neighbours leave the GPU idle inside the step (a carveout switch, a dependency on a tiny kernel)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in profiler.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, count = collections.Counter(), collections.Counter()
    for (_, prev_end, prev), (start, _, name) in zip(spans, spans[1:]):
        gap = start - prev_end
        if 0 < gap <= HOST_GAP_US:
            pair = f"{kind_of(prev)}:{prev[:60]} -> {kind_of(name)}:{name[:60]}"
            total[pair] += gap
            count[pair] += 1
    return [dict(pair=pair, us_per_step=us / steps, per_step=count[pair] / steps, mean_us=us / count[pair])
            for pair, us in total.most_common(top)]


def summarize(profiler, steps: int) -> dict:
    """Per step: GPU busy ms, kernels, and both by kind; the top 25 kernels."""
    count, micros = collections.Counter(), collections.Counter()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count[event.name] += 1
            micros[event.name] += event.device_time
    launch_gaps_us, host_gaps_us = launch_and_host_gaps(profiler)
    by_kind_us, by_kind_n = collections.Counter(), collections.Counter()
    for name in count:
        by_kind_us[kind_of(name)] += micros[name]
        by_kind_n[kind_of(name)] += count[name]
    return dict(
        gpu_busy_ms_per_step=sum(micros.values()) / steps / 1e3,
        launch_gaps_ms_per_step=launch_gaps_us / steps / 1e3,
        host_gaps_ms_per_step=host_gaps_us / steps / 1e3,
        kernels_per_step=sum(count.values()) / steps,
        by_kind={kind: dict(ms_per_step=by_kind_us[kind] / steps / 1e3, kernels_per_step=by_kind_n[kind] / steps)
                 for kind, _ in by_kind_us.most_common()},
        top_kernels=[dict(name=name[:120], kind=kind_of(name), calls_per_step=count[name] / steps,
                          us_per_step=us / steps) for name, us in micros.most_common(25)],
        top_gap_pairs=gap_pairs(profiler, steps),
    )


def run_row(model, dense_attention: str, row: str, ids: torch.Tensor, args, out: Path) -> dict:
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens + 8, do_sample=False,
               eos_token_id=None, pad_token_id=0)

    def kwargs() -> dict:
        if row.startswith("rocketkv"):
            hf_rocketkv.enable(model)
            return dict(compat.cache_kwargs(RocketKVCache(RocketKVConfig())), disable_compile=row == "rocketkv-eager")
        model.set_attn_implementation(dense_attention)
        return dict(cache_implementation="static")

    stop = StoppingCriteriaList([StopAfter(args.new_tokens)])
    with torch.no_grad():
        model.generate(ids, stopping_criteria=stop, **gen, **kwargs())  # warm-up: JIT, capture, compilation
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        window = ProfileWindow(profiler, first=args.new_tokens // 2, steps=args.steps)
        model.generate(ids, logits_processor=LogitsProcessorList([window]),
                       stopping_criteria=StoppingCriteriaList([StopAfter(args.new_tokens)]), **gen, **kwargs())
    model.set_attn_implementation(dense_attention)
    gaps = sorted(b - a for a, b in zip(window.times[4:], window.times[5:]))
    name = f"{row}_{args.model}_{ids.shape[1]}"
    profiler.export_chrome_trace(str(out / f"trace_{name}.json"))
    return dict(row=row, generate_ms_per_step=gaps[len(gaps) // 2] * 1e3 if gaps else None,
                **summarize(profiler, args.steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, *REFERENCE_MODELS], default="gemma-3-12b")
    parser.add_argument("--rows", nargs="+", default=["rocketkv"], choices=["rocketkv", "rocketkv-eager",
                                                                            "static-compile"])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers of the pattern")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="out/profile_hybrid_step")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    model, dense_attention = build_model(args.model, False, args.layers, torch.bfloat16, device)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  device=torch.cuda.get_device_name(device), torch=torch.__version__, model=args.model,
                  layers=model.config.num_hidden_layers, context=args.context, rows=[])
    for row in args.rows:
        result = run_row(model, dense_attention, row, ids, args, out)
        report["rows"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "top_kernels"}), flush=True)
        for kernel in result["top_kernels"][:12]:
            print(f"  {kernel['us_per_step']:9.1f} us  x{kernel['calls_per_step']:6.1f}  {kernel['kind']:22s} "
                  f"{kernel['name'][:90]}", flush=True)
        for pair in result["top_gap_pairs"][:12]:
            print(f"  gap {pair['us_per_step']:7.1f} us/step  x{pair['per_step']:6.1f}  {pair['mean_us']:5.2f} us  "
                  f"{pair['pair']}", flush=True)
        (out / "profile_hybrid_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
