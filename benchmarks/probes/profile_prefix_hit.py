"""Where the time to first token of a prefix hit goes (target: <= 10% of a cold prefill), on a GPU.

    python -m benchmarks.probes.profile_prefix_hit --out $OUT          # H100: about 1 minute
    python -m benchmarks.probes.profile_prefix_hit --quick --out out   # CPU smoke run

Llama-3.1-8B shapes, random bf16 weights, RocketKVConfig() defaults on the Triton backend, a KVBlockPool of 16-token
pages. A cold request (32k shared prefix + 256 tokens) fills the pool, a warm-up hit compiles the hit path, then a
second hit (same prefix, other 256 tokens, one new token) runs under torch.profiler. Prints and writes the top ops by
CPU time and by device time, the wall time of the hit and of the cold request, and the host-device synchronisations.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from hf_rocketkv import KVBlockPool, RocketKVCache

from benchmarks.bench_prefix_reuse import setup

GIB = 2**30


def first_token(model, ids: torch.Tensor, cache: RocketKVCache) -> float:
    """Seconds to the first token of one request (generate with max_new_tokens=1, synchronised)."""
    sync(ids.device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=1, do_sample=False,
                   eos_token_id=None, pad_token_id=0, disable_compile=True)
    sync(ids.device)
    return time.perf_counter() - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def top_ops(prof, key: str, rows: int) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:rows]
    return [dict(name=e.key, calls=e.count, cpu_ms=round(e.cpu_time_total / 1e3, 3),
                 self_cpu_ms=round(e.self_cpu_time_total / 1e3, 3),
                 device_ms=round(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3, 3))
            for e in events]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--suffix", type=int, default=256)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        args.prefix, args.suffix = 256, 32
    config, dtype, model = setup(device, args.quick)
    pool = KVBlockPool(model.config, max_gpu_bytes=int((0.05 if args.quick else 24) * GIB), page_size=16, dtype=dtype,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=device)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, model.config.vocab_size, (1, args.prefix), generator=g)
    prompts = [torch.cat([prefix, torch.randint(3, model.config.vocab_size, (1, args.suffix), generator=g)], 1).to(device)
               for _ in range(3)]
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    def request(ids):
        cache = RocketKVCache(config, pool=pool)
        seconds = first_token(model, ids, cache)
        stats = cache.stats.as_dict()
        cache.close()
        return seconds, stats

    report["cold_s"], _ = request(prompts[0])
    report["cold_again_s"], _ = request(prompts[0][:, : args.prefix // 2].flip(1))  # another cold one, warm kernels
    report["warm_up_hit_s"], _ = request(prompts[1])
    def hit():
        report["hit_s"], report["hit_stats"] = request(prompts[2])

    # this script has always counted every memcpy with the syncs (kept: earlier results are comparable)
    summarize(profiled(device, hit), device, report, SYNC_OPS + ("cudaMemcpyAsync",))
    write_report(report, Path(args.out) / "profile_prefix_hit.json")


def profiled(device: torch.device, fn, all_threads: bool = False, with_stack: bool = False):
    """``fn()`` under torch.profiler (CPU, and CUDA on a GPU); returns the profiler. ``all_threads``: record the CPU
    ops of every thread (e.g. an engine's), where this torch can; else the calling thread's. ``with_stack``: also
    the Python functions (``python_function`` events of the chrome trace, for ``gpu_gaps``)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    config = None
    if all_threads:
        try:
            config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        except (AttributeError, TypeError):  # an older torch: the calling thread's CPU ops only (CUDA kernels all)
            config = None
    with torch.profiler.profile(activities=activities, record_shapes=False, experimental_config=config,
                                with_stack=with_stack) as prof:
        fn()
    return prof


def gpu_gaps(trace_path: Path, window_function: str = "_prefill", step_us: float = 5.0, rows: int = 25) -> dict:
    """Where the GPU sat idle inside one host function's span, from a chrome trace taken ``with_stack=True``.

    The window is the longest ``python_function`` event whose name ends in ``: <window_function>``. Device activity
    (kernels, memcpys, memsets) is merged into busy intervals; the idle time between them is sampled every
    ``step_us`` and each sample is charged to the innermost Python function and the innermost aten op the window's
    thread was in at that moment, i.e. what the host was doing while the GPU waited for it. Also reports the
    inclusive host time of the ``hf_rocketkv`` / ``transformers`` functions on that thread (top ``rows``)."""
    import bisect

    events = json.loads(trace_path.read_text())["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    python = [e for e in complete if e.get("cat") == "python_function"]
    suffix = f": {window_function}"
    windows = [e for e in python if e["name"].endswith(suffix)]
    if not windows:
        return {"error": f"no python_function ending in {suffix!r} in the trace"}
    window = max(windows, key=lambda e: e["dur"])
    start, end, tid = window["ts"], window["ts"] + window["dur"], window["tid"]
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in complete
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] < end and e["ts"] + e["dur"] > start)
    busy: list[list[float]] = []
    for s, e in device:
        s, e = max(s, start), min(e, end)
        if busy and s <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], e)
        else:
            busy.append([s, e])
    gaps, cursor = [], start
    for s, e in busy:
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < end:
        gaps.append((cursor, end))

    def innermost_table(candidates):
        ordered = sorted(candidates, key=lambda e: e["ts"])
        return ordered, [e["ts"] for e in ordered]

    own_python = innermost_table([e for e in python if e["tid"] == tid and e["ts"] < end and e["ts"] + e["dur"] > start])
    own_ops = innermost_table([e for e in complete if e.get("cat") == "cpu_op" and e["tid"] == tid
                               and e["ts"] < end and e["ts"] + e["dur"] > start])

    def innermost(table, t, keep=lambda name: True):
        ordered, starts = table
        i = bisect.bisect_right(starts, t) - 1
        for j in range(i, max(-1, i - 20000), -1):  # nested spans: the latest-starting one that contains t
            e = ordered[j]
            if e["ts"] + e["dur"] > t and keep(e["name"]):
                return e["name"]
        return "(none)"

    ours = lambda name: "hf_rocketkv" in name or "transformers" in name
    by_function: dict[str, float] = {}
    by_our_function: dict[str, float] = {}
    by_op: dict[str, float] = {}
    for s, e in gaps:
        t = s + step_us / 2
        while t < e:
            for table, key, keep in ((own_python, by_function, None), (own_python, by_our_function, ours),
                                     (own_ops, by_op, None)):
                name = innermost(table, t, keep) if keep else innermost(table, t)
                key[name] = key.get(name, 0.0) + step_us
            t += step_us
    inclusive: dict[str, list] = {}
    for e in own_python[0]:
        if ours(e["name"]):
            row = inclusive.setdefault(e["name"], [0.0, 0])
            row[0] += e["dur"]
            row[1] += 1

    def top(table: dict) -> list:
        return [{"name": k[:160], "idle_ms": round(v / 1e3, 3)} for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:rows]]

    idle = sum(e - s for s, e in gaps)
    return {
        "window": window["name"], "window_ms": round((end - start) / 1e3, 3),
        "device_busy_ms": round(sum(e - s for s, e in busy) / 1e3, 3), "device_idle_ms": round(idle / 1e3, 3),
        "idle_before_first_kernel_ms": round(((busy[0][0] if busy else end) - start) / 1e3, 3),
        "idle_after_last_kernel_ms": round((end - (busy[-1][1] if busy else start)) / 1e3, 3),
        "gaps_over_50us": sum(1 for s, e in gaps if e - s > 50),
        "idle_by_python_function": top(by_function), "idle_by_our_function": top(by_our_function),
        "idle_by_op": top(by_op),
        "host_inclusive_ms": [{"name": k[:160], "ms": round(v[0] / 1e3, 3), "calls": v[1]}
                              for k, v in sorted(inclusive.items(), key=lambda kv: -kv[1][0])[:rows]],
    }


SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item", "aten::_local_scalar_dense")


def summarize(prof, device: torch.device, report: dict, sync_ops: tuple[str, ...] = SYNC_OPS) -> None:
    """Top ops by CPU, self CPU and device time, and the calls of ``sync_ops`` (default: stream/device syncs and
    scalar reads; an asynchronous copy is not a wait), into ``report``."""
    report["top_by_cpu"] = top_ops(prof, "cpu_time_total", 30)
    report["top_by_self_cpu"] = top_ops(prof, "self_cpu_time_total", 20)
    if device.type == "cuda":
        report["top_by_device"] = top_ops(prof, "device_time_total", 20)
    report["syncs"] = sum(e.count for e in prof.key_averages() if any(s in e.key for s in sync_ops))


def write_report(report: dict, path: Path) -> None:
    """The report as JSON at ``path``; its scalars and top-op tables printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if not k.startswith("top")}, default=str))
    for key in ("top_by_cpu", "top_by_self_cpu", "top_by_device"):
        print(f"--- {key}")
        for row in report.get(key, []):
            print(f"{row['cpu_ms']:9.2f} cpu {row['self_cpu_ms']:9.2f} self {row['device_ms']:9.2f} dev "
                  f"{row['calls']:6d}x {row['name'][:90]}")

if __name__ == "__main__":
    main()
