"""Launch-parameter sweep of the two heaviest decode kernels (page scoring and sparse attention), on a GPU.

    python -m benchmarks.probes.tune_decode_kernels --out out/tune

The graphed decode step profile (``profile_graph_step.py``, H100, batch 32 x 8k) puts ``_page_logits_kernel`` at
26 us and ``_sparse_decode_split_kernel`` at 25 us per layer, against ~10 us each for their bytes at the H100's
bandwidth. This times every variant of splits, warps and stages on the shapes of one Llama-3.1-8B layer (8 KV heads,
4 query heads each, head_dim 128, fp8 KT, bf16 K/V, page 4, topk 64, prompt budget 2048 + 512 decode slots), paged
through a block table as the pool does, at batch 1, 32 and 64, as CUDA-graph replays (``do_bench_cudagraph``), and
checks each variant's output against the default launch (the kernels' own tests check the default against torch).
Writes ``tune_decode_kernels.json`` under --out.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from pathlib import Path

import torch

from hf_rocketkv.kernels.page_scores import page_scores_launch
from hf_rocketkv.kernels.sparse_decode_attention import sparse_decode_attention_launch

HKV, GROUP, DIM, PAGE, TOPK = 8, 4, 128, 4, 64
POOL_PAGE = 16  # tokens per pool page (the pool's default in the benchmarks)
SCORE_GRID = ((None, 1, 2, 4, 8), (4, 8), (2, 3, 4))  # splits, warps, stages
ATTENTION_GRID = ((None, 1, 2, 4), (32, 64, 128), (4, 8), (2, 3))  # splits, block_n, warps, stages


def shapes(batch: int, kept: int, capacity: int, device: torch.device) -> dict:
    """Random tensors of one layer's decode step, K/V and KT paged through a shuffled block table."""
    gen = torch.Generator(device="cpu").manual_seed(batch)
    mp = capacity // POOL_PAGE  # pool pages per row
    n_pool = batch * mp
    table = torch.randperm(n_pool, generator=gen).view(batch, mp).to(torch.int32).to(device)
    kt_per_pool_page = POOL_PAGE // PAGE
    q = torch.randn(batch, HKV, GROUP, DIM, generator=gen).to(device, torch.bfloat16)
    kt = torch.randn(n_pool, HKV, kt_per_pool_page, 2, DIM, generator=gen).sort(dim=3).values
    kt = kt.to(device).to(torch.float8_e5m2)
    keys = torch.randn(n_pool, HKV, POOL_PAGE, DIM, generator=gen).to(device, torch.bfloat16)
    values = torch.randn(n_pool, HKV, POOL_PAGE, DIM, generator=gen).to(device, torch.bfloat16)
    lengths = torch.full((batch,), kept, dtype=torch.long, device=device) - torch.arange(batch, device=device) % 37
    n_pages = (lengths + PAGE - 1) // PAGE
    idx = torch.stack([torch.randperm(kept // PAGE - 10, generator=gen)[:TOPK] for _ in range(batch * HKV)])
    idx = idx.view(batch, HKV, TOPK).to(device)
    valid = torch.ones_like(idx, dtype=torch.bool)
    return dict(q=q, kt=kt, keys=keys, values=values, table=table, lengths=lengths, n_pages=n_pages, idx=idx,
                valid=valid)


def bench(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3  # us


def sweep_scores(t: dict, topr: int, grid=SCORE_GRID) -> list[dict]:
    ref = page_scores_launch(t["q"], t["kt"], t["n_pages"], topr, table=t["table"])
    rows = []
    for splits, warps, stages, *block_p in itertools.product(*grid):
        block_p = block_p[0] if block_p else None

        def run(splits=splits, warps=warps, stages=stages, block_p=block_p):
            return page_scores_launch(t["q"], t["kt"], t["n_pages"], topr, num_splits=splits, table=t["table"],
                                      num_warps=warps, num_stages=stages, block_p=block_p)
        variant = dict(splits=splits, warps=warps, stages=stages, block_p=block_p)
        try:
            err = (run() - ref).abs().max().item()
            rows.append(dict(variant, us=bench(run), max_abs_diff=err))
        except Exception as e:  # noqa: BLE001 - an invalid variant is recorded, the sweep goes on
            rows.append(dict(variant, error=f"{type(e).__name__}: {e}"[:200]))
    return rows


def sweep_attention(t: dict, grid=ATTENTION_GRID) -> list[dict]:
    args = (t["q"], t["keys"], t["values"], t["idx"], t["valid"], t["lengths"], PAGE, DIM**-0.5)
    ref = sparse_decode_attention_launch(*args, table=t["table"]).float()
    rows = []
    for splits, block_n, warps, stages in itertools.product(*grid):
        def run(splits=splits, block_n=block_n, warps=warps, stages=stages):
            return sparse_decode_attention_launch(*args, num_splits=splits, block_n=block_n, num_warps=warps,
                                                  num_stages=stages, table=t["table"])
        try:
            err = (run().float() - ref).abs().max().item()
            rows.append(dict(splits=splits, block_n=block_n, warps=warps, stages=stages, us=bench(run),
                             max_abs_diff=err))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(splits=splits, block_n=block_n, warps=warps, stages=stages,
                             error=f"{type(e).__name__}: {e}"[:200]))
    return rows


# the launchers' defaults at 8B shapes (block_p None: the launcher's own choice, 64 at head_dim 128)
DEFAULTS = {"page_scores": dict(splits=None, warps=4, stages=2, block_p=None),
            "sparse_decode": dict(splits=None, block_n=128, warps=4, stages=2)}


def show(name: str, rows: list[dict], keys: tuple[str, ...]) -> None:
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    default = next((r for r in rows if "us" in r and all(r.get(k) == v for k, v in DEFAULTS[name.split()[0]].items())),
                   None)
    print(f"--- {name}: default {default['us'] if default else float('nan'):.1f} us; best 6:", flush=True)
    for r in ok[:6]:
        print("   " + " ".join(f"{k}={r[k]}" for k in keys) + f"  {r['us']:.1f} us  (diff {r['max_abs_diff']:.2e})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--kept", type=int, default=2300, help="tokens per row (prompt budget 2048 + decoded)")
    parser.add_argument("--capacity", type=int, default=2560, help="slots per row (multiple of 16)")
    parser.add_argument("--topr", type=int, default=128)
    parser.add_argument("--skip-scores", action="store_true", help="sweep the sparse attention only")
    parser.add_argument("--skip-attention", action="store_true", help="sweep the page scoring only")
    parser.add_argument("--wide", action="store_true",
                        help="attention grid with larger tiles too: block_n up to 256, 16 warps, 1 stage")
    parser.add_argument("--out", default="out/tune")
    args = parser.parse_args()
    grid = ((None, 1, 2), (64, 128, 256), (4, 8, 16), (1, 2, 3)) if args.wide else ATTENTION_GRID
    score_grid = ((None, 1, 2, 4), (4, 8), (1, 2, 3), (None, 32, 128)) if args.wide else SCORE_GRID
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(device),
                  torch=torch.__version__, kept=args.kept, capacity=args.capacity, results={})
    for batch in args.batches:
        t = shapes(batch, args.kept, args.capacity, device)
        scores = [] if args.skip_scores else sweep_scores(t, args.topr, score_grid)
        if scores:
            show(f"page_scores b{batch}", scores, ("splits", "warps", "stages", "block_p"))
        attention = [] if args.skip_attention else sweep_attention(t, grid)
        if attention:
            show(f"sparse_decode b{batch}", attention, ("splits", "block_n", "warps", "stages"))
        report["results"][str(batch)] = dict(page_scores=scores, sparse_decode=attention)
        (out / "tune_decode_kernels.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
