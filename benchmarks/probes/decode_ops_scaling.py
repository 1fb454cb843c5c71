"""How the Triton decode and prefill ops scale with the tokens kept, on a GPU: per-op times, GB/s, variants.

    python -m benchmarks.probes.decode_ops_scaling [--out DIR] [--quick]
    python -m benchmarks.probes.decode_ops_scaling --cpu-smoke     # the script's logic on a CPU (Triton interpreter)

Shapes: Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16), batch 1/4/16, contexts
2k..100k tokens. For the decode ops the context is the number of tokens in the (compacted) cache; RocketKV's
defaults (prompt_budget 2048, topk 64 pages of 4, fp8 KT) keep ~2k, the 8k..100k rows show how the ops scale when
a larger budget is kept. Writes ``decode_ops_scaling.json`` under --out (default $OUT or ./out) and prints a table.

Measured: the device's copy bandwidth (large device-to-device copy, bytes read + written), per-op median times
(triton.testing.do_bench, i.e. eager launches, and do_bench_cudagraph, i.e. CUDA-graph replays as a compiled decode
step runs them), the achieved GB/s of sparse_decode_attention (selected K/V rows + q + out + page ids), the same
attention over every page of the context against SDPA (a bandwidth test), and the share of page scoring + top-k in
the whole decode attention step. Variants are timed side by side to justify the launchers' choices (fused vs split
page scoring, Triton radix select vs torch.topk, split counts, tile shapes).

The ops' results at these shapes are checked against their PyTorch references by tests/gpu/test_kernels_large_shapes_gpu.py.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # logic check of this script on a CPU (tiny shapes, Triton interpreter)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import json
import platform
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import triton
from triton.testing import do_bench, do_bench_cudagraph

from hf_rocketkv.kernels.page_scores import page_scores_launch
from hf_rocketkv.kernels.sparse_decode_attention import (
    selected_slots,
    sparse_decode_attention_launch,
    sparse_decode_attention_torch,
)
from hf_rocketkv.kernels.triton_ops import TRITON_OPS as T
from hf_rocketkv.selection import stage1_snapkv as s1
from hf_rocketkv.selection import stage2_pages as s2

from benchmarks.probes.legacy_select_pages import HAS_MASKED_HISTOGRAM
from benchmarks.probes.legacy_select_pages import select_pages_launch as radix_select_launch

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
PAGE, TOPK, WINDOW = 4, 64, 32
DEV = torch.device("cuda")
SMS = 132
RESULTS: dict = {"timing": [], "notes": []}


def bench(fn, graph: bool = True) -> dict:
    if DEV.type == "cpu":
        t0 = time.perf_counter()
        fn()
        return {"eager_ms": (time.perf_counter() - t0) * 1e3}
    out = {"eager_ms": do_bench(fn, warmup=20, rep=60, return_mode="median")}
    if graph:
        try:
            out["graph_ms"] = do_bench_cudagraph(fn, rep=40, return_mode="median")
        except Exception as err:  # noqa: BLE001 - report and go on
            out["graph_error"] = repr(err)[:200]
    return out


def record(kind: str, **row) -> None:
    RESULTS[kind].append(row)
    print(kind[:4], json.dumps(row), flush=True)


def save(out_dir: Path) -> None:
    (out_dir / "decode_ops_scaling.json").write_text(json.dumps(RESULTS, indent=1))


# ------------------------------------------------------------------------------------------------ environment
def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV).normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=200, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------------------------ decode ops
def decode_inputs(batch: int, ctx: int, gen: torch.Generator):
    capacity = ctx + 256
    keys = torch.randn(batch, HKV, capacity, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    values = torch.randn(batch, HKV, capacity, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    # ragged rows, partial last pages: ctx - 0..37
    lengths = ctx - torch.randint(0, 38, (batch,), device=DEV, generator=gen)
    lengths[0] = ctx
    q = torch.randn(batch, HKV, G, D, device=DEV, dtype=torch.bfloat16, generator=gen) * 2
    return q, keys, values, lengths


def time_decode(batch: int, ctx: int, gen: torch.Generator) -> None:
    """One row of decode-op timings at ``batch`` x ``ctx`` kept tokens, and one of the attention over every page."""
    q, keys, values, lengths = decode_inputs(batch, ctx, gen)
    # reading the WHOLE context through the page gather (a large budget): a bandwidth test at a size that fills
    # the GPU
    all_pages = s2.num_pages(lengths, PAGE).max().item()
    idx_all = torch.arange(all_pages, device=DEV).expand(batch, HKV, all_pages).contiguous()
    valid_all = idx_all < s2.num_pages(lengths, PAGE)[:, None, None]
    kv_bytes = int(lengths.sum()) * HKV * D * 2 * 2
    row = dict(batch=batch, ctx=ctx, all_pages_bytes=kv_bytes)
    row["all_pages_sparse_attn"] = bench(lambda: T.sparse_decode_attention(q, keys, values, idx_all, valid_all, lengths, PAGE, D**-0.5), graph=False)
    row["all_pages_n32w4s2"] = bench(lambda: sparse_decode_attention_launch(q, keys, values, idx_all, valid_all, lengths, PAGE, D**-0.5, block_n=32, num_warps=4, num_stages=2), graph=False)
    row["all_pages_n64w4"] = bench(lambda: sparse_decode_attention_launch(q, keys, values, idx_all, valid_all, lengths, PAGE, D**-0.5, block_n=64, num_warps=4), graph=False)
    kd, vd = keys[:, :, :ctx], values[:, :, :ctx]
    row["all_pages_sdpa_flash"] = bench(lambda: F.scaled_dot_product_attention(q.reshape(batch, HQ, 1, D), kd, vd, enable_gqa=True), graph=False)
    for k in ("all_pages_sparse_attn", "all_pages_n32w4s2", "all_pages_n64w4", "all_pages_sdpa_flash"):
        row[k + "_GBps"] = kv_bytes / (row[k]["eager_ms"] * 1e-3) / 1e9
    record("timing", **row)

    # ---------------- timings (fp8 KT, topr = head_dim, RocketKV defaults) ----------------
    kt = T.build_kt(keys, lengths, PAGE, torch.float8_e5m2)
    n_pages = s2.num_pages(lengths, PAGE)
    key_new = keys[:, :, 0]
    probs = T.page_scores(q, kt, n_pages, 128)
    idx, valid = T.select_pages(probs, n_pages, TOPK)
    np_ = kt.shape[2]
    row = dict(batch=batch, ctx=ctx, pages=np_)
    row["update_kt"] = bench(lambda: T.update_kt(kt, key_new, lengths, PAGE))
    row["page_scores"] = bench(lambda: T.page_scores(q, kt, n_pages, 128))
    row["page_scores_fused"] = bench(lambda: page_scores_launch(q, kt, n_pages, 128, num_splits=1))
    splits = max(2, min(triton.cdiv(np_, 256), triton.cdiv(2 * SMS, batch * HKV)))
    row["page_scores_split"] = bench(lambda: page_scores_launch(q, kt, n_pages, 128, num_splits=splits))
    row["page_scores_split_n"] = splits
    row["page_scores_torch"] = bench(lambda: s2.page_scores(q, kt, n_pages, 128))
    row["select_triton"] = bench(lambda: T.select_pages(probs, n_pages, TOPK))
    row["select_radix_4bit"] = bench(lambda: radix_select_launch(probs, n_pages, TOPK, digit_bits=4, use_histogram=False))
    row["select_torch_topk"] = bench(lambda: s2.select_pages(probs, n_pages, TOPK))
    row["sparse_attn"] = bench(lambda: T.sparse_decode_attention(q, keys, values, idx, valid, lengths, PAGE, D**-0.5))
    row["sparse_attn_1split"] = bench(lambda: sparse_decode_attention_launch(q, keys, values, idx, valid, lengths, PAGE, D**-0.5, num_splits=1))
    row["sparse_attn_n32w4s2"] = bench(lambda: sparse_decode_attention_launch(q, keys, values, idx, valid, lengths, PAGE, D**-0.5, block_n=32, num_warps=4, num_stages=2))
    row["sparse_attn_n64w4"] = bench(lambda: sparse_decode_attention_launch(q, keys, values, idx, valid, lengths, PAGE, D**-0.5, block_n=64, num_warps=4))
    row["sparse_attn_torch"] = bench(lambda: sparse_decode_attention_torch(q, keys, values, idx, valid, lengths, PAGE, D**-0.5))
    n_tok = int(selected_slots(idx, valid, lengths, PAGE, keys.shape[2])[1].sum())  # selected tokens that exist
    bytes_attn = n_tok * D * 2 * 2 + q.numel() * 2 * 2 + idx.numel() * 9
    for key in ("eager_ms", "graph_ms"):
        if key in row["sparse_attn"]:
            row[f"sparse_attn_GBps_{key[:-3]}"] = bytes_attn / (row["sparse_attn"][key] * 1e-3) / 1e9
    row["sparse_attn_bytes"] = bytes_attn

    def step():
        T.update_kt(kt, key_new, lengths, PAGE)
        p = T.page_scores(q, kt, n_pages, 128)
        i, v = T.select_pages(p, n_pages, TOPK)
        return T.sparse_decode_attention(q, keys, values, i, v, lengths, PAGE, D**-0.5)

    def step_torch():
        s2.update_kt(kt, key_new, lengths, PAGE)
        p = s2.page_scores(q, kt, n_pages, 128)
        i, v = s2.select_pages(p, n_pages, TOPK)
        return sparse_decode_attention_torch(q, keys, values, i, v, lengths, PAGE, D**-0.5)

    row["decode_step_triton"] = bench(step)
    row["decode_step_torch"] = bench(step_torch)
    qd = q.reshape(batch, HQ, 1, D)
    mask = (torch.arange(keys.shape[2], device=DEV)[None, :] < lengths[:, None])[:, None, None, :]
    row["dense_sdpa_masked"] = bench(lambda: F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, enable_gqa=True))
    kv_dense = keys[:, :, :ctx]
    vv_dense = values[:, :, :ctx]
    row["dense_sdpa_nomask"] = bench(lambda: F.scaled_dot_product_attention(qd, kv_dense, vv_dense, enable_gqa=True))
    row["dense_bytes"] = kv_dense.numel() * 2 * 2
    for key in ("eager_ms", "graph_ms"):
        if key in row["decode_step_triton"] and key in row["page_scores"]:
            row[f"select_share_{key[:-3]}"] = (row["page_scores"][key] + row["select_triton"][key]) / row["decode_step_triton"][key]
    record("timing", **row)


# ------------------------------------------------------------------------------------------------ prefill ops
def time_window(batch: int, ctx: int, gen: torch.Generator) -> None:
    """Stage 1's window scores and the KT build of a prefill of ``ctx`` tokens."""
    keys = torch.randn(batch, HKV, ctx, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, HQ, WINDOW, D, device=DEV, dtype=torch.bfloat16, generator=gen) * 2
    start = torch.randint(0, max(ctx // 8, 1), (batch,), device=DEV, generator=gen)
    start[0] = 0
    end = torch.full((batch,), ctx, device=DEV)
    row = dict(batch=batch, ctx=ctx, window_scores=bench(lambda: T.window_scores(q, keys, start, end, D**-0.5), graph=False))
    if batch == 1:
        row["window_scores_torch"] = bench(lambda: s1.window_scores(q, keys, start, end, D**-0.5), graph=False)
    row["build_kt"] = bench(lambda: T.build_kt(keys, end, PAGE, torch.float8_e5m2), graph=False)
    row["keys_bytes"] = keys.numel() * 2
    record("timing", **row)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true", help="two small shapes only")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the script's logic on CPU, tiny shapes")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    global DEV, SMS
    if args.cpu_smoke:
        DEV, name, SMS = torch.device("cpu"), "cpu (interpreter)", 4
    else:
        props = torch.cuda.get_device_properties(0)
        name, SMS = props.name, props.multi_processor_count
    RESULTS["env"] = dict(
        device=name, sms=SMS, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        masked_histogram=HAS_MASKED_HISTOGRAM,
    )
    print(RESULTS["env"], flush=True)
    RESULTS["env"]["copy_GBps"] = copy_bandwidth() if DEV.type == "cuda" else float("nan")
    print("copy GB/s", RESULTS["env"]["copy_GBps"], flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    grid = [(1, 300), (2, 260)] if args.cpu_smoke else [(1, 2048), (16, 2048)] if args.quick else [
        (1, 2048), (4, 2048), (16, 2048), (1, 8192), (4, 8192), (16, 8192),
        (1, 32768), (4, 32768), (16, 32768), (1, 100_000), (4, 100_000), (16, 100_000),
    ]
    t_start = time.time()
    for batch, ctx in grid:
        for name, fn in (("decode", time_decode), ("window", time_window)):
            try:
                fn(batch, ctx, gen)
            except Exception:  # noqa: BLE001 - keep going, report
                RESULTS["notes"].append(f"{name} {batch}x{ctx}: {traceback.format_exc()[-1500:]}")
                print(RESULTS["notes"][-1], flush=True)
            torch.cuda.empty_cache()
        save(out_dir)
        print(f"-- {batch}x{ctx} done at {time.time() - t_start:.0f}s", flush=True)
    save(out_dir)
    summary(RESULTS)
    return 0


def summary(res: dict) -> None:
    print(f"\n== timings (median ms; eager = do_bench, graph = CUDA-graph replay) on {res['env']['device']}, "
          f"copy {res['env']['copy_GBps']:.0f} GB/s ==")
    keys = ("update_kt", "page_scores", "page_scores_fused", "page_scores_split", "page_scores_torch", "select_triton",
            "select_triton_4bit", "select_torch_topk", "sparse_attn", "sparse_attn_1split", "sparse_attn_n32w4s2",
            "sparse_attn_n64w4", "sparse_attn_torch", "all_pages_sparse_attn", "all_pages_n32w4s2", "all_pages_n64w4",
            "all_pages_sdpa_flash",
            "decode_step_triton", "decode_step_torch", "dense_sdpa_nomask", "window_scores", "build_kt")
    for r in res["timing"]:
        cells = [f"B{r['batch']} N{r['ctx']}"]
        for k in keys:
            if k in r:
                v = r[k]
                cells.append(f"{k}={v.get('eager_ms', float('nan')):.4f}/{v.get('graph_ms', float('nan')):.4f}")
        for k in ("sparse_attn_GBps_graph", "select_share_graph", "all_pages_sparse_attn_GBps", "all_pages_n32w4s2_GBps",
                  "all_pages_n64w4_GBps", "all_pages_sdpa_flash_GBps"):
            if k in r:
                cells.append(f"{k}={r[k]:.2f}")
        print(" ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
