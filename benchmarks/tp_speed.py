"""Tensor-parallel speed against one GPU: TTFT and decode ms/token with compilation and graph capture warmed up.

    # 1. a random bf16 checkpoint with Llama-3.1-8B shapes, written once
    python -m benchmarks.random_checkpoint --layers 8 --dtype bfloat16 --dir /tmp/tps8
    # 2. one GPU, then two (torchrun), same workload
    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.tp_speed run --dir /tmp/tps8 --batch 1 --context 100000 \
        --new-tokens 64 --repeats 3 --out $OUT/single.json
    torchrun --nproc_per_node=2 -m benchmarks.tp_speed run --dir /tmp/tps8 --batch 1 --context 100000 \
        --new-tokens 64 --repeats 3 --out $OUT/tp.json
    # 3. a markdown table: TTFT, ms/token, tokens/s, peak GiB per GPU, TP/1-GPU ratios
    python -m benchmarks.tp_speed compare $OUT/single.json $OUT/tp.json

``run`` loads the checkpoint with ``attn_implementation="rocketkv"`` (``device_map="cuda"`` in one process,
``tp_plan="auto"`` under torchrun, the CPU without CUDA), makes the same random prompt on every rank, runs one
untimed warm-up generate() of exactly the timed shapes (Triton JIT, cuBLAS and allocator warm-up, any torch.compile
happen there), then ``--repeats`` timed pairs: TTFT = generate(max_new_tokens=1) (prefill, stage 1, first token) and
the full generate(max_new_tokens=N); decode ms/token = (full - TTFT) / (N - 1), median over the repeats.
decode_runner="cuda_graphs" captures every request's decode step on its second step, so the full call still holds
that capture; ``decode_ms_per_token_steady`` (per-token CUDA events, first steps left out, as bench_decode does) is
the number without it. Rank 0 writes the JSON, with every rank's peak memory.

``--rocketkv-json '{"prefill_batch_size": 8}'`` overrides RocketKVConfig fields (applied to both runs you compare).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    """Every rank enters a timed region together (under torchrun), so no rank's clock counts another's lateness."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if device.type == "cuda":  # NCCL's barrier is a collective on a device: name this rank's
            dist.barrier(device_ids=[device.index])
        else:  # gloo takes no device_ids
            dist.barrier()


def _generate(model, ids: torch.Tensor, config, new_tokens: int, clock=None) -> float:
    """Seconds of one synchronised generate() with a fresh cache (a RocketKVCache serves one request)."""
    from transformers import LogitsProcessorList

    from hf_rocketkv import RocketKVCache
    from hf_rocketkv.integration import compat

    kwargs: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if clock is not None:
        kwargs["logits_processor"] = LogitsProcessorList([clock])
    _barrier(ids.device)
    _sync(ids.device)
    t0 = time.perf_counter()
    if clock is not None:
        clock.start()
    with torch.no_grad():
        # the cache under the installed transformers' argument name (past_key_values before 5.24, cache after)
        model.generate(ids, **compat.cache_kwargs(RocketKVCache(config)), **kwargs)
    _sync(ids.device)
    return time.perf_counter() - t0


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins
    ("all-reduce (NCCL)", ("nccl",)),
    ("GEMM", ("gemm", "cutlass", "nvjet", "xmma", "splitk", "cublas")),
    ("Triton (RocketKV, compiled regions)", ("triton",)),
)


def _kernel_times(model, ids, config, new_tokens: int) -> tuple[dict[str, float], float, int]:
    """GPU microseconds per kernel kind, the busy microseconds (the union of kernel intervals), and the kernel count
    of one generate() under torch.profiler (CUDA graph replays included: CUPTI traces the kernels inside them)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _generate(model, ids, config, new_tokens)
    kinds: dict[str, float] = {}
    intervals = []
    for event in prof.events():
        if event.device_type != DeviceType.CUDA or "memcpy" in event.name.lower() or "memset" in event.name.lower():
            continue
        name = event.name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(key in name for key in keys)), "other kernels")
        kinds[kind] = kinds.get(kind, 0.0) + event.time_range.elapsed_us()
        intervals.append((event.time_range.start, event.time_range.end))
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):  # the union: overlapping kernels (two streams) count once
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return kinds, busy, len(intervals)


def _decode_profile(model, ids, config, new_tokens: int) -> dict:
    """Where a decode step's GPU time goes on this rank: profile generate(new_tokens) and generate(1) (prefill, stage 1,
    first token) and divide the difference by new_tokens - 1. Milliseconds per token per kernel kind, GPU busy, and
    kernels per token; the gap between busy and the measured ms/token is host time (the GPU waiting)."""
    full, full_busy, full_count = _kernel_times(model, ids, config, new_tokens)
    first, first_busy, first_count = _kernel_times(model, ids, config, 1)
    per_token = 1e-3 / (new_tokens - 1)
    return {
        "ms_per_token_by_kind": {k: (v - first.get(k, 0.0)) * per_token for k, v in sorted(full.items())},
        "gpu_busy_ms_per_token": (full_busy - first_busy) * per_token,
        "kernels_per_token": (full_count - first_count) / (new_tokens - 1),
    }


def run(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_rocketkv
    import transformers
    from hf_rocketkv import RocketKVConfig
    from hf_rocketkv.bench.decode import DROP_FIRST_STEPS, StepClock

    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2: decode ms/token is (full - TTFT) / (new_tokens - 1)")
    cuda = torch.cuda.is_available()
    distributed = "WORLD_SIZE" in os.environ
    kwargs: dict[str, Any] = {}
    if distributed:
        # transformers starts the process group (NCCL on CUDA, gloo on CPU)
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
    elif cuda:
        kwargs["device_map"] = "cuda"
    if args.dtype:
        kwargs["dtype"] = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.dir, attn_implementation=hf_rocketkv.ATTN_NAME, **kwargs).eval()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = next(model.parameters()).device
    # the kernels on CUDA (fp8 page summaries for a bf16 model, exact ones for float32), the reference on CPU
    config = RocketKVConfig(backend="triton" if cuda else "torch",
                            kt_cache_dtype="float32" if model.dtype == torch.float32 else "float8_e5m2")
    if args.rocketkv_json:
        config = config.replace(**json.loads(args.rocketkv_json))
    # a CPU generator with a fixed seed: every rank holds the same prompt, as tensor parallelism requires
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context),
                        generator=torch.Generator().manual_seed(0)).to(device)

    # warm-up with the timed shapes: every JIT compile, compile and allocator growth happens here, not below
    warm_up_s = _generate(model, ids, config, args.new_tokens)
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ttft, full, steady = [], [], []
    for _ in range(args.repeats):
        ttft.append(_generate(model, ids, config, 1))
        clock = StepClock(device)
        full.append(_generate(model, ids, config, args.new_tokens, clock))
        times = clock.seconds()  # per-token CUDA events, read after the timed call
        steps = [b - a for a, b in zip(times, times[1:])]
        steady.append(statistics.median(steps[DROP_FIRST_STEPS:] if len(steps) > DROP_FIRST_STEPS + 2 else steps))
    decode_ms = [(f - t) / (args.new_tokens - 1) * 1e3 for f, t in zip(full, ttft)]
    profile = _decode_profile(model, ids, config, args.new_tokens) if args.profile and device.type == "cuda" else None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    peaks = [peak]
    if distributed:
        import torch.distributed as dist

        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
    ms_per_token = statistics.median(decode_ms)
    record = dict(
        world_size=world, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, transformers=transformers.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        checkpoint=str(args.dir), dtype=str(model.dtype).removeprefix("torch."), batch=args.batch,
        context=args.context, new_tokens=args.new_tokens, repeats=args.repeats, rocketkv=config.to_dict(),
        warm_up_s=warm_up_s, ttft_s=statistics.median(ttft), full_s=statistics.median(full),
        decode_ms_per_token=ms_per_token, tokens_per_s=args.batch * 1e3 / ms_per_token,
        decode_ms_per_token_steady=statistics.median(steady) * 1e3,
        ttft_s_all=ttft, full_s_all=full, decode_ms_per_token_all=decode_ms,
        peak_gib_per_rank=peaks,
        # torch.compile graphs made during the timed repeats (0 when the warm-up compiled everything there is)
        recompilations_after_warmup=counters["stats"]["unique_graphs"] - graphs_before,
        decode_profile=profile,
    )
    if rank == 0:
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps({k: record[k] for k in ("world_size", "device", "ttft_s", "decode_ms_per_token",
                                                 "decode_ms_per_token_steady", "peak_gib_per_rank",
                                                 "recompilations_after_warmup")}))
    if distributed:
        _exit_distributed()


def _exit_distributed() -> None:
    """Leave without interpreter finalization or destroy_process_group() (as tp_serving_throughput.py does): the model's
    DTensor shards keep the process group alive, and on 2 H200s destroy_process_group() hung past the step's
    limit after the JSON was written; gloo's threads can also abort a half torn-down interpreter (SIGABRT after
    all the work, pytorch/pytorch#179291). The exit status should report the run, not those races."""
    import torch.distributed as dist

    dist.barrier()  # rank 0 has written the JSON
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def compare(args: argparse.Namespace) -> None:
    single = json.loads(Path(args.single).read_text())
    tp = json.loads(Path(args.tp).read_text())
    for key in ("batch", "context", "new_tokens", "dtype", "device"):
        if single[key] != tp[key]:
            print(f"WARNING: the runs differ in {key}: {single[key]} vs {tp[key]}")

    def peak(record: dict) -> float | None:  # the fullest GPU: what must fit
        values = [p for p in record["peak_gib_per_rank"] if p is not None]
        return max(values) if values else None

    rows = [  # (metric, 1-GPU value, TP value, lower is better)
        ("TTFT (s)", single["ttft_s"], tp["ttft_s"], True),
        ("decode ms/token", single["decode_ms_per_token"], tp["decode_ms_per_token"], True),
        ("decode ms/token (steady)", single["decode_ms_per_token_steady"], tp["decode_ms_per_token_steady"], True),
        ("tokens/s", single["tokens_per_s"], tp["tokens_per_s"], False),
        ("peak GiB per GPU", peak(single), peak(tp), None),
    ]
    print(f"batch {single['batch']} x context {single['context']}, {single['new_tokens']} new tokens, "
          f"{single['dtype']}, {single['device']}; medians of {single['repeats']} / {tp['repeats']} repeats; "
          f"recompilations after warm-up: {single['recompilations_after_warmup']} / "
          f"{tp['recompilations_after_warmup']}")
    print()
    print(f"| metric | 1 GPU | TP ({tp['world_size']} GPUs) | TP / 1 GPU | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name, one, many, lower_better in rows:
        if one is None or many is None:
            print(f"| {name} | {one} | {many} | - | - |")
            continue
        speed_up = "-" if lower_better is None else f"{(one / many if lower_better else many / one):.2f}x"
        print(f"| {name} | {one:.4g} | {many:.4g} | {many / one:.3f} | {speed_up} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dir", required=True, help="checkpoint (python -m benchmarks.random_checkpoint)")
    r.add_argument("--out", required=True)
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--context", type=int, default=32768)
    r.add_argument("--new-tokens", type=int, default=64)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--dtype", default=None, help="load the checkpoint in this dtype (default: as saved)")
    r.add_argument("--profile", action="store_true",
                   help="after the timed repeats, profile one generate() per rank: decode ms/token by kernel kind")
    r.add_argument("--rocketkv-json", default=None, help="RocketKVConfig fields to override, as a JSON object")
    c = sub.add_parser("compare")
    c.add_argument("single")
    c.add_argument("tp")
    args = p.parse_args()
    {"run": run, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
