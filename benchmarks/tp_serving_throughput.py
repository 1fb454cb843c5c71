"""Serving under tensor parallelism (serving/parallel/lockstep.py) against one GPU: the batching engine's throughput and
whether every rank stepped through exactly the same events.

    # a random bf16 checkpoint with Llama-3.1-8B shapes, then one GPU and two
    python -m benchmarks.random_checkpoint --layers 8 --dtype bfloat16 --dir /tmp/tps8
    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.tp_serving_throughput --dir /tmp/tps8 --out $OUT/ls_single.json
    torchrun --nproc_per_node=2 -m benchmarks.tp_serving_throughput --dir /tmp/tps8 --out $OUT/ls_tp.json
    python -m benchmarks.tp_serving_throughput --compare $OUT/ls_single.json $OUT/ls_tp.json

Every rank loads the checkpoint (``tp_plan="auto"`` under torchrun), builds a pool and a BatchingEngine (with a
``Lockstep`` under torchrun) and captures the decode graphs (``warm_up``); rank 0 drives the workloads through the
engine, the other ranks ``follow()``. Workloads (greedy, EOS ignored): ``fixed`` (--requests x --prompt-len, all at
once) and ``mixed`` (Poisson arrivals at --rate, prompt lengths log-uniform in [--min-prompt, --max-prompt]).
Reported: output tokens/s, TTFT p50/p99, tokens/s per user, decode ms/step, peak GiB per rank, and a digest of
every event each rank emitted (equal digests: the ranks stayed in lockstep). Model load and the graph capture are
excluded from the timings, and so is a warm-up of three requests (the fixed length, the shortest and the longest mixed
length) that compiles the prefill path's kernels first. Without CUDA it runs on the CPU (tests use a tiny checkpoint).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.batching_steps import Recorder, _buckets, engine_stats, greedy_request, random_prompt

GIB = 2**30


class Sink:
    """The engine's sink on every rank: a running SHA-256 of every event in arrival order, and each event forwarded
    to the current workload's batching_throughput Recorder (rank 0)."""

    def __init__(self):
        self.digest = hashlib.sha256()
        self.events = 0
        self.recorder: Recorder | None = None

    def __call__(self, event) -> None:
        self.digest.update(repr((event.request_id, tuple(event.token_ids),
                                 event.finish_reason.value if event.finish_reason else None)).encode())
        self.events += 1
        if self.recorder is not None:
            self.recorder(event)


def workloads(args, vocab: int) -> dict[str, list[tuple[float, list[int]]]]:
    """Name -> [(delay before submitting, prompt)], the same on every rank (seeded)."""
    rng = random.Random(args.seed)
    fixed = [(0.0, random_prompt(rng, args.prompt_len, vocab)) for _ in range(args.requests)]
    low, high = math.log(args.min_prompt), math.log(args.max_prompt)
    mixed = [(rng.expovariate(args.rate), random_prompt(rng, int(math.exp(rng.uniform(low, high))), vocab))
             for _ in range(args.mixed_requests)]
    # drawn last, so the measured workloads' prompts stay those of a run without the warm-up
    warmup = [(0.0, random_prompt(rng, n, vocab)) for n in (args.prompt_len, args.min_prompt, args.max_prompt)]
    return {"warmup": warmup, "fixed": fixed, "mixed": mixed}


def drive(engine, sink: Sink, name: str, plan, new_tokens: int) -> dict:
    """Submit ``plan`` (rank 0) with a Recorder of its own, wait for every request, summarise."""
    recorder = sink.recorder = Recorder()
    before = engine.stats()
    start = time.perf_counter()
    for i, (delay, prompt) in enumerate(plan):
        time.sleep(delay)
        recorder.submit(engine, greedy_request(f"{name}{i}", prompt, new_tokens))
    assert recorder.wait(len(plan), 3600), f"the {name} workload did not finish"
    summary = recorder.summary(start, time.perf_counter())
    summary.update(engine_stats(before, engine.stats()))
    return summary


def run(args) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_rocketkv
    from hf_rocketkv import KVBlockPool, RocketKVConfig
    from hf_rocketkv.serving import Lockstep
    from hf_rocketkv.serving.batching.engine import BatchingEngine
    from hf_rocketkv.serving.batching.scheduler import BatchingConfig

    cuda = torch.cuda.is_available()
    distributed = "WORLD_SIZE" in os.environ
    kwargs = ({"distributed_config": DistributedConfig(tp_plan="auto")} if distributed
              else ({"device_map": "cuda"} if cuda else {}))
    model = AutoModelForCausalLM.from_pretrained(args.dir, attn_implementation=hf_rocketkv.ATTN_NAME,
                                                 **kwargs).eval()
    device = next(model.parameters()).device
    config = RocketKVConfig(backend="triton" if cuda else "torch")
    if args.rocketkv_json:
        config = config.replace(**json.loads(args.rocketkv_json))
    # --pool-gib per GPU, as hf-rocketkv serve: under TP each rank's pages hold its shard of the KV heads
    from hf_rocketkv.cli.serve import shard_kv_heads

    world = int(os.environ.get("WORLD_SIZE", 1))
    pool = KVBlockPool(model, max_gpu_bytes=int(args.pool_gib * GIB), page_size=args.page_size,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=device,
                       num_kv_heads=shard_kv_heads(model, world) if distributed else None)
    lockstep = Lockstep() if distributed else None
    batching = BatchingConfig(max_running=args.max_running, max_queue=4096, buckets=_buckets(args.max_running))
    engine = BatchingEngine(model, config, pool, batching, lockstep=lockstep)
    capture = engine.warm_up(max_new_tokens=args.new_tokens) if engine.graphs_in_use else None
    vocab = int(model.config.get_text_config().vocab_size)
    plans = workloads(args, vocab)
    sink = Sink()
    results: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if lockstep is None or lockstep.is_leader:
        engine.start(sink)
        # untimed: the first prefills compile the prefill path's Triton kernels (graph capture does not reach them);
        # without this the first workload's TTFT carried ~10 s of compilation on a fresh machine
        drive(engine, sink, "warmup", plans.pop("warmup"), min(8, args.new_tokens))
        for name, plan in plans.items():
            results[name] = drive(engine, sink, name, plan, args.new_tokens)
        engine.stop(drain=True, timeout=600)
    else:
        engine.follow(sink)
    rank_report = {"rank": int(os.environ.get("RANK", 0)), "digest": sink.digest.hexdigest(), "events": sink.events,
                   "free_pages": pool.free_pages(), "total_pages": pool.total_pages(),
                   "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None}
    ranks = [rank_report]
    if distributed:
        import torch.distributed as dist

        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, rank_report)
    return {
        "command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": len(ranks), "capture_s": capture["seconds"] if capture else None,
        "workloads": {"fixed": [args.requests, args.prompt_len, args.new_tokens],
                      "mixed": [args.mixed_requests, args.rate, args.min_prompt, args.max_prompt, args.new_tokens]},
        "results": results, "ranks": ranks, "same_events_on_every_rank": len({r["digest"] for r in ranks}) == 1,
    }


def compare(single_path: str, tp_path: str) -> str:
    single, tp = (json.loads(Path(p).read_text()) for p in (single_path, tp_path))
    rows = ["| workload | metric | 1 GPU | TP ({} GPUs) | TP / 1 GPU |".format(tp["world_size"]),
            "|---|---|---|---|---|"]
    for name in single["results"]:
        for key in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "per_user_tokens_per_s_p50", "ms_per_step_p50"):
            a, b = single["results"][name].get(key), tp["results"][name].get(key)
            ratio = f"{b / a:.2f}" if a and b else "-"
            rows.append(f"| {name} | {key} | {a:.3g} | {b:.3g} | {ratio} |" if a and b else
                        f"| {name} | {key} | {a} | {b} | - |")
    peak = lambda r: max((x["peak_gib"] or 0) for x in r["ranks"])  # noqa: E731
    rows.append(f"| all | peak GiB per GPU | {peak(single):.1f} | {peak(tp):.1f} | {peak(tp) / max(peak(single), 1e-9):.2f} |")
    rows.append(f"\nsame events on every rank: {tp['same_events_on_every_rank']} "
                f"(digests {[r['digest'][:12] for r in tp['ranks']]}); device {tp['device']}, {tp['date']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="checkpoint folder (python -m benchmarks.random_checkpoint)")
    parser.add_argument("--out", help="JSON report (rank 0)")
    parser.add_argument("--compare", nargs=2, metavar=("SINGLE", "TP"), help="print the table of two reports")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--mixed-requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (mixed)")
    parser.add_argument("--min-prompt", type=int, default=1024)
    parser.add_argument("--max-prompt", type=int, default=32768)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pool-gib", type=float, default=20.0, help="KV pool GiB per GPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rocketkv-json", default=None, help="RocketKVConfig field overrides (JSON)")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    if not args.dir or not args.out:
        parser.error("--dir and --out are required (or --compare SINGLE TP)")
    report = run(args)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(json.dumps({k: report[k] for k in ("world_size", "same_events_on_every_rank", "capture_s")}))
        for name, result in report["results"].items():
            print(name, {k: result.get(k) for k in ("tokens_per_s", "ttft_p50_s", "per_user_tokens_per_s_p50",
                                                     "ms_per_step_p50", "finished")})
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.barrier()
        sys.stdout.flush()
        os._exit(0)  # as tests/integration/tp_worker.py: no gloo / NCCL teardown races at interpreter exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
