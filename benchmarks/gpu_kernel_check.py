"""One-shot GPU check of the Triton kernels: large-shape correctness vs the PyTorch references + micro-benchmarks.

    PYTHONPATH=. python3 benchmarks/gpu_kernel_check.py [--out DIR] [--quick]

Shapes: Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16), batch 1/4/16, contexts
2k..100k tokens. For the decode ops the context is the number of tokens in the (compacted) cache; RocketKV's
defaults (prompt_budget 2048, topk 64 pages of 4, fp8 KT) keep ~2k, the 8k..100k rows show how the ops scale when
a larger budget is kept. Writes ``gpu_kernel_check.json`` under --out (default $OUT or ./out) and prints a table.

Measured: the device's copy bandwidth (large device-to-device copy, bytes read + written), per-op median times
(triton.testing.do_bench, i.e. eager launches, and do_bench_cudagraph, i.e. CUDA-graph replays as a compiled decode
step runs them), the achieved GB/s of sparse_decode_attention (selected K/V rows + q + out + page ids) and the
share of page scoring + top-k in the whole decode attention step. Variants are timed side by side to justify the
launchers' choices (fused vs split page scoring, Triton radix select vs torch.topk, split counts).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the old radix select, frozen beside this file
from legacy_select_pages import HAS_MASKED_HISTOGRAM  # noqa: E402
from legacy_select_pages import select_pages_launch as radix_select_launch  # noqa: E402
from hf_rocketkv.kernels.sparse_decode_attention import (
    selected_slots,
    sparse_decode_attention_launch,
    sparse_decode_attention_torch,
)
from hf_rocketkv.kernels.triton_ops import TRITON_OPS as T
from hf_rocketkv.selection import stage1_snapkv as s1
from hf_rocketkv.selection import stage2_pages as s2

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
PAGE, TOPK, WINDOW = 4, 64, 32
DEV = torch.device("cuda")
SMS = 132
RESULTS: dict = {"correctness": [], "timing": [], "notes": []}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


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
    (out_dir / "gpu_kernel_check.json").write_text(json.dumps(RESULTS, indent=1))


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


def check_decode(batch: int, ctx: int, gen: torch.Generator, time_it: bool) -> None:
    q, keys, values, lengths = decode_inputs(batch, ctx, gen)
    capacity = keys.shape[2]
    for kt_dtype in (torch.float8_e5m2, torch.bfloat16):
        kt = T.build_kt(keys, lengths, PAGE, kt_dtype)
        kt_ref = s2.build_kt(keys, lengths, PAGE, kt_dtype)
        record("correctness", op="build_kt", batch=batch, ctx=ctx, kt=str(kt_dtype), exact=bool(torch.equal(kt.float(), kt_ref.float())))
        # one decode step: append a key, fold it into the KT
        key_new = torch.randn(batch, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        kt_upd = kt.clone()
        T.update_kt(kt_upd, key_new, lengths, PAGE)
        s2.update_kt(kt_ref, key_new, lengths, PAGE)
        record("correctness", op="update_kt", batch=batch, ctx=ctx, kt=str(kt_dtype), exact=bool(torch.equal(kt_upd.float(), kt_ref.float())))
        n_pages = s2.num_pages(lengths + 1, PAGE)
        for topr in ((128,) if kt_dtype == torch.float8_e5m2 else (128, 64)):
            probs = T.page_scores(q, kt_upd, n_pages, topr)
            probs_ref = s2.page_scores(q, kt_ref, n_pages, topr)
            record("correctness", op="page_scores", batch=batch, ctx=ctx, kt=str(kt_dtype), topr=topr,
                   max_abs=float((probs - probs_ref).abs().max()), rel=rel_err(probs, probs_ref))
        idx, valid = T.select_pages(probs_ref, n_pages, TOPK)
        ridx, rvalid = s2.select_pages(probs_ref, n_pages, TOPK)
        # tie-tolerant: same count, newest page in, every chosen page >= the reference's worst chosen (non-forced) page
        newest = (n_pages - 1)[:, None, None]
        p_sel = probs_ref.gather(-1, idx).masked_fill(~valid | (idx == newest), float("inf")).amin(-1)
        p_ref = probs_ref.gather(-1, ridx).masked_fill(~rvalid | (ridx == newest), float("inf")).amin(-1)
        ok = bool(torch.equal(valid.sum(-1), rvalid.sum(-1)) and ((idx == newest) & valid).any(-1).all()
                  and (p_sel >= p_ref).all())
        same_sets = float((idx.sort(-1).values == ridx.sort(-1).values).all(-1).float().mean())
        record("correctness", op="select_pages", batch=batch, ctx=ctx, kt=str(kt_dtype), ok=ok, identical_sets=same_sets)
        out = T.sparse_decode_attention(q, keys, values, idx, valid, lengths + 1, PAGE, D**-0.5)
        out_ref = sparse_decode_attention_torch(q, keys, values, idx, valid, lengths + 1, PAGE, D**-0.5)
        record("correctness", op="sparse_decode_attention", batch=batch, ctx=ctx, kt=str(kt_dtype), rel=rel_err(out, out_ref),
               max_abs=float((out.float() - out_ref.float()).abs().max()))
    # attention over MANY pages (a large budget): every page of the context
    all_pages = s2.num_pages(lengths, PAGE).max().item()
    idx_all = torch.arange(all_pages, device=DEV).expand(batch, HKV, all_pages).contiguous()
    valid_all = idx_all < s2.num_pages(lengths, PAGE)[:, None, None]
    out = T.sparse_decode_attention(q, keys, values, idx_all, valid_all, lengths, PAGE, D**-0.5)
    dense = F.scaled_dot_product_attention(
        q.reshape(batch, HQ, 1, D), keys, values, enable_gqa=True,
        attn_mask=(torch.arange(capacity, device=DEV)[None, :] < lengths[:, None])[:, None, None, :], scale=D**-0.5,
    ).reshape(batch, HKV, G, D)
    record("correctness", op="sparse_decode_attention_all_pages_vs_sdpa", batch=batch, ctx=ctx, rel=rel_err(out, dense))
    for variant, kw in (("n32w4s2", dict(block_n=32, num_warps=4, num_stages=2)), ("n64w4", dict(block_n=64, num_warps=4))):
        other = sparse_decode_attention_launch(q, keys, values, idx_all, valid_all, lengths, PAGE, D**-0.5, **kw)
        record("correctness", op=f"sparse_decode_attention_all_pages_{variant}", batch=batch, ctx=ctx, rel=rel_err(other, dense))
    if time_it:  # reading the WHOLE context through the page gather: a bandwidth test at a size that fills the GPU
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

    if not time_it:
        return
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
def check_window(batch: int, ctx: int, gen: torch.Generator, time_it: bool) -> None:
    keys = torch.randn(batch, HKV, ctx, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, HQ, WINDOW, D, device=DEV, dtype=torch.bfloat16, generator=gen) * 2
    start = torch.randint(0, max(ctx // 8, 1), (batch,), device=DEV, generator=gen)
    start[0] = 0
    end = torch.full((batch,), ctx, device=DEV)
    got = T.window_scores(q, keys, start, end, D**-0.5)
    errs = []
    for b in range(batch):  # the reference materialises [Hq, w, N] fp32 logits: one row at a time
        want = s1.window_scores(q[b : b + 1], keys[b : b + 1], start[b : b + 1], end[b : b + 1], D**-0.5)
        errs.append(rel_err(got[b : b + 1], want))
    record("correctness", op="window_scores", batch=batch, ctx=ctx, rel=max(errs),
           sum_ok=bool(torch.allclose(got.sum(-1), torch.full_like(got.sum(-1), G * WINDOW), rtol=1e-3)))
    if time_it:
        row = dict(batch=batch, ctx=ctx, window_scores=bench(lambda: T.window_scores(q, keys, start, end, D**-0.5), graph=False))
        if batch == 1:
            row["window_scores_torch"] = bench(lambda: s1.window_scores(q, keys, start, end, D**-0.5), graph=False)
        row["build_kt"] = bench(lambda: T.build_kt(keys, end, PAGE, torch.float8_e5m2), graph=False)
        row["keys_bytes"] = keys.numel() * 2
        record("timing", **row)


# ------------------------------------------------------------------------------------------------ compile
def check_compile() -> None:
    """The decode step inside torch.compile(fullgraph=True): no graph break, same result as eager."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    q, keys, values, lengths = decode_inputs(2, 3000, gen)
    kt = T.build_kt(keys, lengths, PAGE, torch.float8_e5m2)
    key_new = torch.randn(2, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)

    def step(kt, lengths):
        T.update_kt(kt, key_new, lengths, PAGE)
        n_pages = s2.num_pages(lengths + 1, PAGE)
        p = T.page_scores(q, kt, n_pages, 96)
        i, v = T.select_pages(p, n_pages, TOPK)
        return T.sparse_decode_attention(q, keys, values, i, v, lengths + 1, PAGE, D**-0.5)

    kt_eager = kt.clone()
    want = step(kt_eager, lengths)
    t0 = time.time()
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):
        kt_c = kt.clone()
        got = compiled(kt_c, lengths)
    record("correctness", op="torch.compile(fullgraph=True) decode step", rel=rel_err(got, want),
           kt_exact=bool(torch.equal(kt_c.float(), kt_eager.float())), compile_s=time.time() - t0)


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
        for name, fn in (("decode", check_decode), ("window", check_window)):
            try:
                fn(batch, ctx, gen, time_it=True)
            except Exception:  # noqa: BLE001 - keep going, report
                RESULTS["notes"].append(f"{name} {batch}x{ctx}: {traceback.format_exc()[-1500:]}")
                print(RESULTS["notes"][-1], flush=True)
            torch.cuda.empty_cache()
        save(out_dir)
        print(f"-- {batch}x{ctx} done at {time.time() - t_start:.0f}s", flush=True)
    try:
        if DEV.type == "cuda":
            check_compile()
    except Exception:  # noqa: BLE001
        RESULTS["notes"].append(f"compile: {traceback.format_exc()[-2500:]}")
        print(RESULTS["notes"][-1], flush=True)
    save(out_dir)
    summary(RESULTS)
    return 0


def summary(res: dict) -> None:
    print("\n== correctness ==")
    for r in res["correctness"]:
        print({k: (round(v, 7) if isinstance(v, float) else v) for k, v in r.items()})
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
