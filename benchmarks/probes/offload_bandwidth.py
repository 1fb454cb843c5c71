"""KVBlockPool's host offload on a GPU: device<->host GB/s of evictions and onloads, how much of an onload hides
behind compute, pinned-buffer registration time, and plain pinned copies for comparison.

    python -m benchmarks.probes.offload_bandwidth [--out DIR]
    python -m benchmarks.probes.offload_bandwidth --small      # tiny shapes (the CPU without a GPU): the script's logic

Shapes: Llama-3.1-8B KV (32 layers, 8 KV heads, head_dim 128), bf16 pages of 16 tokens with fp8 KT (4-token KT
pages), a 32k-token prefix = 2048 pages of 2.25 MiB (4.6 GiB); a second pass with fp8 (e4m3) pages and per-head
scales.

Measured, per dtype:
  register_s            cudaHostRegister time of the host buffer (and the pinning mode actually obtained)
  offload_gbps          2048 pages evicted to the host (pool.evict + synchronize), page bytes / seconds
  onload_gbps           the same pages brought back by a prefix hit (pool.admit + synchronize)
  overlap               a chain of matmuls on the compute stream, then an onload: wall time of both vs each alone;
                        overlap_fraction = (t_mm + t_onload - t_both) / min(t_mm, t_onload) (1 = fully hidden)
Baselines: one 1 GiB pinned cudaMemcpy each way, and torch's pin_memory=True allocation time for the same host size.
Writes ``offload_bandwidth.json`` under --out (default $OUT or ./out). Expected runtime on an H100: ~1-2 minutes.
That the offloaded and onloaded pages keep every byte is tests/gpu/test_pool_offload_gpu.py's check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
import types
from pathlib import Path

import torch

from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.memory import KVBlockPool

GIB = 1 << 30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[object, float]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def fill_random(pool: KVBlockPool, pages: list[int], seed: int) -> None:
    """Random finite values in K, V, KT and scales of ``pages`` in every layer."""
    generator = torch.Generator(device=pool._storage.device()).manual_seed(seed)
    ids = torch.tensor(pages, dtype=torch.long, device=pool._storage.device())
    for layer_idx in range(pool.geometry.num_layers):
        for name, tensor in pool.layer(layer_idx).tensors().items():
            shape = (len(pages), *tensor.shape[1:])
            values = torch.randn(shape, generator=generator, device=tensor.device)
            if name.endswith("scale"):
                values = values.abs() + 0.01
            rows = tensor.reshape(tensor.shape[0], -1).view(torch.uint8)  # fp8 has no index_copy_: copy bytes
            rows.index_copy_(0, ids, values.to(tensor.dtype).reshape(len(pages), -1).view(torch.uint8))


def matmul_chain(device: torch.device, size: int, count: int):
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)

    def run():
        x = a
        for _ in range(count):
            x = (x @ a).clamp_(-1, 1)
        return x

    return run


def check_dtype(args, device: torch.device, dtype: str, granularity: str) -> dict:
    if args.small:
        model = types.SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4, head_dim=16,
                                      architectures=["Tiny"])
        prefix_tokens, page_size, mm_size, mm_count = 512, 16, 256, 4
    else:
        model = types.SimpleNamespace(num_hidden_layers=32, num_key_value_heads=8, num_attention_heads=32,
                                      head_dim=128, rope_theta=500000.0, architectures=["LlamaForCausalLM"])
        prefix_tokens, page_size, mm_size, mm_count = 32768, 16, 8192, 150
    cfg = RocketKVConfig(prompt_budget=2048, window_size=32, page_size=4, kt_cache_dtype="float8_e5m2")
    probe = KVBlockPool(model, max_gpu_bytes=GIB, page_size=page_size, dtype=dtype, scale_granularity=granularity)
    prefix_pages = prefix_tokens // page_size
    device_pages = prefix_pages + prefix_pages // 2 + 256
    host_pages = prefix_pages + 64
    result = {"dtype": dtype, "scale_granularity": granularity, "bytes_per_page": probe.bytes_per_page,
              "prefix_tokens": prefix_tokens, "prefix_pages": prefix_pages}

    pool, register_s = timed(lambda: KVBlockPool(
        model, max_gpu_bytes=device_pages * probe.bytes_per_page, host_bytes=host_pages * (probe.bytes_per_page + 4096),
        page_size=page_size, dtype=dtype, scale_granularity=granularity, device=device), device)
    pool.bind_all(device)
    result.update(host_bytes=pool._host.slots.numel(), pinning=pool._host.pinning,
                  register_s=pool._host.register_seconds, construct_s=register_s, device_pages=pool.total_pages(),
                  host_slots=pool.host_slots)

    ids = list(range(1000, 1000 + prefix_tokens + 300))  # the prefix + 300 tokens of a question
    adm = pool.admit(len(ids), 16, cfg, token_ids=ids)
    fill_random(pool, list(adm.prompt.pages), seed=1)
    pool.commit_prompt(adm)
    pool.release(adm)

    evicted, offload_s = timed(lambda: (pool.evict(), pool.synchronize())[0], device)
    data_bytes = evicted * pool.bytes_per_page  # all layers are bound with the planned heads
    result.update(evicted_pages=evicted, offload_s=offload_s, offload_gbps=data_bytes / offload_s / 1e9)

    adm, onload_s = timed(lambda: pool.admit(len(ids), 16, cfg, token_ids=ids), device)
    pool.synchronize()
    result.update(hit_pages=adm.hit_pages, onloaded_pages=adm.onloaded_pages, onload_s=onload_s,
                  onload_gbps=adm.onloaded_pages * pool.bytes_per_page / onload_s / 1e9)
    pool.release(adm)

    # overlap: matmuls on the compute stream, then an onload enqueued behind them (it waits only for page events)
    run_mm = matmul_chain(device, mm_size, mm_count)
    run_mm()
    _, t_mm = timed(run_mm, device)
    pool.evict()
    pool.synchronize()
    _, t_onload = timed(lambda: pool.release(pool.admit(len(ids), 16, cfg, token_ids=ids)), device)
    pool.evict()
    pool.synchronize()

    def both():
        run_mm()
        return pool.admit(len(ids), 16, cfg, token_ids=ids)

    adm, t_both = timed(both, device)
    pool.release(adm)
    result["overlap"] = {
        "t_matmul_s": t_mm, "t_onload_s": t_onload, "t_both_s": t_both,
        "overlap_fraction": (t_mm + t_onload - t_both) / min(t_mm, t_onload),
    }

    result["stats"] = pool.stats().as_dict()
    pool.close()
    return result


def baselines(device: torch.device, host_bytes: int) -> dict:
    if device.type != "cuda":
        return {}
    out = {}
    size = GIB
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(size, dtype=torch.uint8, device=device)
    for name, fn in (("h2d_gbps", lambda: gpu.copy_(pinned, non_blocking=True)),
                     ("d2h_gbps", lambda: pinned.copy_(gpu, non_blocking=True))):
        fn()
        _, seconds = timed(fn, device)
        out[name] = size / seconds / 1e9
    del pinned, gpu
    start = time.perf_counter()
    block = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
    out["pin_memory_alloc_s"] = time.perf_counter() - start
    out["pin_memory_alloc_bytes"] = host_bytes
    del block
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU when no GPU): checks the script")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "small": args.small, "results": [], "errors": [],
    }
    for dtype, granularity in (("bfloat16", "page"), ("float8_e4m3fn", "head")):
        try:
            row = check_dtype(args, device, dtype, granularity)
            report["results"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "stats"}), flush=True)
        except Exception:  # noqa: BLE001 - record and go on with the next dtype
            report["errors"].append(traceback.format_exc())
            print(report["errors"][-1], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        report["baselines"] = baselines(device, 4 * GIB if not args.small else 1 << 20)
    except Exception:  # noqa: BLE001
        report["errors"].append(traceback.format_exc())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload_bandwidth.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report.get("baselines", {})), flush=True)


if __name__ == "__main__":
    main()
