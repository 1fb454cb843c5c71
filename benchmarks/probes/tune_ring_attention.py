"""Launch-parameter sweep of the sliding-window ring kernel (``kernels/ring_attention.py``), on a GPU.

    python -m benchmarks.probes.tune_ring_attention --out out/tune_ring

One decode step of one sliding layer, as CUDA-graph replays (``do_bench_cudagraph``, the split reduce included), on
the shapes of the hybrid models: Gemma-3-12B (8 KV heads, 2 query heads each, head_dim 256, window 1024, decode mask)
and gpt-oss-20b (8 KV heads, 8 query heads each, head_dim 64, window 128, sinks, decode mask), at batch 1 (generate():
one ring per row) and at the engine's batches (16 and 32 rows read from a pool slab of 4x as many slots through
``rows``). Every variant of splits, tile, warps and stages is checked against the default launch (the kernel's own
tests check the default against the float64 oracle). Writes ``tune_ring_attention.json`` under --out.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time
from pathlib import Path

import torch

from hf_rocketkv.kernels.ring_attention import ring_decode_attention_launch

SHAPES = {  # name: (batch, KV heads, group, head_dim, window, sinks, store rows per batch row)
    "gemma3_b1": (1, 8, 2, 256, 1024, False, None),
    "gpt_oss_b1": (1, 8, 8, 64, 128, True, None),
    "gemma3_b16": (16, 8, 2, 256, 1024, False, 4),
    "gpt_oss_b32": (32, 8, 8, 64, 128, True, 4),
}
GRID = ((16, 32, 64, 128), (2, 4, 8), (1, 2), (None, 4, 8, 16, 32))  # block_n, warps, stages, splits


def tensors(name: str, device: torch.device) -> dict:
    batch, heads, group, dim, window, sinks, per_row = SHAPES[name]
    gen = torch.Generator(device="cpu").manual_seed(0)
    store = batch * (per_row or 1)
    keys = torch.randn(store, heads, window, dim, generator=gen).to(device, torch.bfloat16)
    values = torch.randn(store, heads, window, dim, generator=gen).to(device, torch.bfloat16)
    rows = None if per_row is None else torch.randperm(store, generator=gen)[:batch].to(device)
    return dict(q=torch.randn(batch, heads, group, dim, generator=gen).to(device, torch.bfloat16), keys=keys,
                values=values, seen=torch.full((batch,), 32768 + 17, dtype=torch.long, device=device),
                scaling=dim**-0.5, rows=rows, mask=torch.ones(batch, window, dtype=torch.bool, device=device),
                sinks=torch.randn(heads * group, generator=gen).to(device) if sinks else None)


def bench(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3  # us


def sweep(t: dict, budget_s: float) -> list[dict]:
    ref = ring_decode_attention_launch(**t).float()
    rows = [dict(default=True, us=bench(lambda: ring_decode_attention_launch(**t)), max_abs_diff=0.0)]
    started = time.monotonic()
    for block_n, warps, stages, splits in itertools.product(*GRID):
        if time.monotonic() - started > budget_s:
            rows.append(dict(note=f"sweep stopped after {budget_s} s"))
            break
        variant = dict(splits=splits, block_n=block_n, warps=warps, stages=stages)

        def run(v=variant):
            return ring_decode_attention_launch(**t, num_splits=v["splits"], block_n=v["block_n"],
                                                num_warps=v["warps"], num_stages=v["stages"])
        try:
            err = (run().float() - ref).abs().max().item()
            rows.append(dict(variant, us=bench(run), max_abs_diff=err))
        except Exception as e:  # noqa: BLE001 - an invalid variant (shared memory) is recorded, the sweep goes on
            rows.append(dict(variant, error=f"{type(e).__name__}: {e}"[:200]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--budget-s", type=float, default=45.0, help="seconds per shape before the sweep stops")
    parser.add_argument("--out", default="out/tune_ring")
    args = parser.parse_args()
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(device),
                  torch=torch.__version__, grid=GRID, results={})
    for name in args.shapes:
        rows = sweep(tensors(name, device), args.budget_s)
        report["results"][name] = rows
        ok = sorted((r for r in rows if "us" in r and not r.get("default")), key=lambda r: r["us"])
        print(f"--- {name}: default {rows[0]['us']:.1f} us; {len(ok)} variants timed; best 6:", flush=True)
        for r in ok[:6]:
            print(f"   splits={r['splits']} block_n={r['block_n']} warps={r['warps']} stages={r['stages']}  "
                  f"{r['us']:.1f} us  (diff {r['max_abs_diff']:.2e})", flush=True)
        (out / "tune_ring_attention.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
