"""Where a cold prefill's time goes (the batching engine's 8k prefill), on a GPU.

    python -m benchmarks.probes.profile_prefill --out $OUT            # H100: about 1 minute
    python -m benchmarks.probes.profile_prefill --quick --out out     # CPU smoke run

Llama-3.1-8B shapes, random bf16 weights, RocketKVConfig() defaults on the Triton backend. One prompt of --prompt-len
tokens, timed (median of --repeats after a warm-up) three ways, side by side:

    dense      the model alone (sdpa attention, no cache, logits of the last token): the floor
    rocketkv   a RocketKVCache without a pool (prefill + stage 1), as generate() runs it
    pool       a RocketKVCache on a KVBlockPool, the way the batching engine prefills (begin_prefill, forward,
               finish_prefill; prefix hashing and the prompt's pages kept for reuse)

then profiles one ``pool`` prefill with torch.profiler: top ops by CPU and device time, host-device syncs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch

from hf_rocketkv import KVBlockPool, RocketKVCache

from benchmarks.bench_prefix_reuse import setup
from benchmarks.probes.profile_prefix_hit import gpu_gaps, profiled, summarize, sync, write_report
from hf_rocketkv.integration.compat import cache_kwargs

GIB = 2**30


def timed(fn, device, repeats: int) -> tuple[float, float]:
    """Median seconds of ``fn()`` to its end on the device, and to its return on the host (no sync inside ``fn``:
    a host return close to the total says the host, not the GPU, sets the pace)."""
    fn()  # warm-up
    totals, hosts = [], []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        host_done = fn()  # fn may sync before it returns: then it returns when its host work was done
        hosts.append((host_done if isinstance(host_done, float) else time.perf_counter()) - start)
        sync(device)
        totals.append(time.perf_counter() - start)
    return statistics.median(totals), statistics.median(hosts)


def without_gc(fn):
    """``fn`` with Python's cyclic garbage collector off while it runs (does a collection pause show up?)."""
    def run():
        gc.disable()
        try:
            return fn()
        finally:
            gc.enable()
    return run


def prefill_args(repeats: int) -> argparse.Namespace:
    """The command line shared with prefill_host_time.py (--quick: a 256-token prompt)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--regions", action="store_true", help="hf_rocketkv.compile_regions(model) first")
    parser.add_argument("--cprofile", action="store_true", help="prefill_host_time.py: one more prefill under cProfile")
    args = parser.parse_args()
    if args.quick:
        args.prompt_len = 256
    return args


def prefill_setup(args: argparse.Namespace):
    """(device, config, model, pool): the benchmark model (compiled regions with --regions, compiled at its first
    call) and an 8 GiB pool of 16-token pages (50 MiB with --quick); autograd off."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    torch.set_grad_enabled(False)
    config, dtype, model = setup(device, args.quick)
    if args.regions:
        from hf_rocketkv import compile_regions

        compile_regions(model)
    pool = KVBlockPool(model.config, max_gpu_bytes=int((0.05 if args.quick else 8) * GIB), page_size=16, dtype=dtype,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=device)
    return device, config, model, pool


def pool_prefill(model, config, pool, ids: torch.Tensor, max_new_tokens: int = 64) -> RocketKVCache:
    """One prompt prefilled the way the batching engine does it (begin_prefill, forward, finish_prefill), with no
    synchronisation; returns the cache (the caller closes it)."""
    cache = RocketKVCache(config, pool=pool)
    cache.hints.max_length = ids.shape[1] + max_new_tokens
    cache.begin_prefill(ids, None, max_new_tokens=max_new_tokens)
    cache.hints.prefilling = True
    try:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), use_cache=True,
              logits_to_keep=1)
    finally:
        cache.hints.prefilling = False
    cache.finish_prefill()
    return cache


def main() -> None:
    args = prefill_args(repeats=3)
    device, config, model, pool = prefill_setup(args)  # regions compile in each row's warm-up call (timed())
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def prompt():
        return torch.randint(3, vocab, (1, args.prompt_len), generator=g).to(device)

    def dense():
        model(input_ids=prompt(), use_cache=False, logits_to_keep=1)

    def rocketkv():
        ids = prompt()
        cache = RocketKVCache(config)
        model(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), use_cache=True,
              logits_to_keep=1)

    def pooled():
        cache = pool_prefill(model, config, pool, prompt())  # a new prompt each time: cold, no prefix hit
        host_done = time.perf_counter()
        sync(device)
        cache.close()
        return host_done

    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "prompt_len": args.prompt_len, "regions": args.regions}
    for name, fn in (("dense_s", dense), ("rocketkv_s", rocketkv), ("pool_s", pooled),
                     ("pool_without_gc_s", without_gc(pooled))):
        report[name], report[name.replace("_s", "_host_return_s")] = timed(fn, device, args.repeats)
        print(name, round(report[name], 4), "host return", round(report[name.replace("_s", "_host_return_s")], 4),
              flush=True)
    prof = profiled(device, pooled, with_stack=True)
    summarize(prof, device, report)
    trace = Path(args.out) / "profile_prefill_trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    report["gaps"] = gpu_gaps(trace, "pooled")  # where the GPU waited for the host
    trace.unlink()
    write_report(report, Path(args.out) / "profile_prefill.json")

if __name__ == "__main__":
    main()
