"""Probe: a gated MLP's first half at decode row counts, eager ops against one GEMM over the concatenated weights and
against ``kernels/gated_projection`` over a grid of tiles, then ``down_proj`` (cuBLAS against the plain kernel over
the same grid), then the attention's projections: ``q_proj``, ``k_proj`` and ``v_proj`` (three cuBLAS calls against
``kernels/stacked_projection``'s one launch; ``qkv_rope``: the same with the query and key rotated inside the launch,
as a decode step runs it, against the eager projections and ``apply_rotary_pos_emb``; ``qkv_cat``: the three weights
as one through the plain kernel) and ``o_proj`` (cuBLAS against the plain kernel); each replayed from a
CUDA graph as a decode step runs (``bench_kernels.time_graph``).

    python -m benchmarks.probes.tune_gated_projection --out results/<file>.json

Shapes: Gemma-3-12B (hidden 3840, intermediate 15360, gelu tanh; attention 16 x 256 queries, 8 x 256 keys)
and Llama-3.1-8B (4096, 14336, silu; 32 x 128 queries, 8 x 128 keys), bf16, random weights. Reports microseconds
per call and the weights' read rate (GB/s: the weights' bytes over the time).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json

import torch

from benchmarks.probes.bench_kernels import time_graph
from hf_rocketkv.kernels.gated_projection import (
    gated_projection_reference,
    gated_projection_triton,
    projection_reference,
    projection_triton,
)
from hf_rocketkv.kernels.stacked_projection import stacked_projection_reference, stacked_projection_triton

SHAPES = {"gemma-3-12b": (3840, 15360, "gelu_tanh"), "llama-3.1-8b": (4096, 14336, "silu")}
ATTENTION = {"gemma-3-12b": (4096, 2048), "llama-3.1-8b": (4096, 1024)}  # q_proj / k_proj (= v_proj) outputs
HEAD_DIM = {"gemma-3-12b": 256, "llama-3.1-8b": 128}
ROWS = (1, 16, 64)
TILES = ([(c, k, 4, s) for c, k, s in itertools.product((16, 32, 64), (128, 256), (3, 5))] + [(16, 512, 4, 3)]
         + [(64, 128, 8, 4), (128, 128, 8, 4)])  # (BLOCK_C, BLOCK_K, warps, stages)


def cold(run, copies: int):
    """``run`` over ``copies`` weight copies per timed call: ``run(i)`` uses copy ``i``; the time is per copy. With
    copies that together exceed the L2 cache, each call reads its weight from memory, as in a decode step (where the
    rest of the layer's weights pass through L2 between two calls of one projection)."""
    def timed(*args):
        return [run(i, *args) for i in range(copies)]
    return timed


def sweep_tiles(rows: int, run, ref, copies: int = 1, timed=None) -> list[dict]:
    """``run(tiles)`` timed over ``TILES`` (with the least row block holding ``rows``), its largest difference from
    ``ref`` (a tensor, or a tuple of them for a run that returns several); a tile that does not fit is listed with
    its error. ``timed(tiles)``: what is timed instead of ``run`` (``copies`` calls of it, ``cold``)."""
    block_r = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    sweep = []
    for c, k, w, s in TILES:
        tiles = (block_r, c, k, w, s)
        try:
            got, refs = run(tiles), ref if isinstance(ref, tuple) else (ref,)
            got = got if isinstance(got, tuple) else (got,)
            err = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, refs))
            us = time_graph(lambda: (timed or run)(tiles)) / copies
        except Exception as exc:  # out of shared memory for a large tile: skip it
            sweep.append({"tiles": tiles, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        sweep.append({"tiles": tiles, "us": us, "max_abs_diff_vs_eager": err})
    return sweep


def down_rows(model: str, hidden: int, inter: int, rows_list, dev, dtype) -> list[dict]:
    """``down_proj`` ([hidden, inter]) at each row count: cuBLAS (``F.linear``) against ``projection_triton``."""
    down = torch.randn(hidden, inter, device=dev, dtype=dtype) / inter ** 0.5
    gbytes = down.numel() * down.element_size() / 1e9
    out = []
    for rows in rows_list:
        h = torch.randn(rows, inter, device=dev, dtype=dtype)
        ref = projection_reference(h, down)
        row = {"model": model, "part": "down_proj", "rows": rows,
               "eager_us": time_graph(lambda: projection_reference(h, down))}
        sweep = sweep_tiles(rows, lambda tiles: projection_triton(h, down, tiles=tiles), ref)
        best = min((t for t in sweep if "us" in t), key=lambda t: t["us"])
        row.update(best=best, eager_gbps=gbytes / row["eager_us"] * 1e6, best_gbps=gbytes / best["us"] * 1e6,
                   sweep=sweep)
        print(f"{model} down_proj rows={rows}: cuBLAS {row['eager_us']:.1f} us ({row['eager_gbps']:.0f} GB/s), "
              f"plain kernel best {best['us']:.1f} us ({row['best_gbps']:.0f} GB/s) tiles {best['tiles']}", flush=True)
        out.append(row)
    return out


def attention_rows(model: str, hidden: int, rows_list, dev, dtype, copies: int = 1) -> list[dict]:
    """q/k/v (three ``F.linear`` calls against ``stacked_projection_triton``), the same with the rotation
    (``qkv_rope``: one token per row, ``rotary=(cos, sin, head_dim)``), the same three weights concatenated
    (``qkv_cat``: one ``F.linear`` against ``projection_triton``) and ``o_proj`` (``F.linear`` against
    ``projection_triton``) at each row count; each timed over ``copies`` weight copies (``cold``)."""
    q_out, kv_out = ATTENTION[model]
    head_dim = HEAD_DIM[model]
    qkv = [tuple(torch.randn(n, hidden, device=dev, dtype=dtype) / hidden ** 0.5 for n in (q_out, kv_out, kv_out))
           for _ in range(copies)]
    o_projs = [torch.randn(hidden, q_out, device=dev, dtype=dtype) / q_out ** 0.5 for _ in range(copies)]
    weights, o_proj = qkv[0], o_projs[0]
    # q/k/v as one weight through the plain kernel: the stacked kernel's three-way dispatch against none
    cats = [torch.cat(ws) for ws in qkv]
    out = []
    for rows in rows_list:
        x = torch.randn(rows, hidden, device=dev, dtype=dtype)
        h = torch.randn(rows, q_out, device=dev, dtype=dtype)  # the attention's output, o_proj's input
        x3 = x.reshape(rows, 1, hidden)  # one decode token per row, as the rotated launch takes it
        angles = torch.rand(rows, 1, head_dim, device=dev) * 6.0
        rot = (angles.cos().to(dtype), angles.sin().to(dtype), head_dim)
        for part, gbytes, eager, kernel, timed in (
            ("qkv", sum(w.numel() for w in weights) * 2 / 1e9, cold(lambda i: stacked_projection_reference(x, qkv[i]),
                                                                     copies),
             lambda tiles: stacked_projection_triton(x, weights, tiles=tiles),
             cold(lambda i, tiles: stacked_projection_triton(x, qkv[i], tiles=tiles), copies)),
            ("qkv_rope", sum(w.numel() for w in weights) * 2 / 1e9,
             cold(lambda i: stacked_projection_reference(x3, qkv[i], rot), copies),
             lambda tiles: stacked_projection_triton(x3, weights, tiles=tiles, rotary=rot),
             cold(lambda i, tiles: stacked_projection_triton(x3, qkv[i], tiles=tiles, rotary=rot), copies)),
            ("qkv_cat", cats[0].numel() * 2 / 1e9, cold(lambda i: projection_reference(x, cats[i]), copies),
             lambda tiles: projection_triton(x, cats[0], tiles=tiles),
             cold(lambda i, tiles: projection_triton(x, cats[i], tiles=tiles), copies)),
            ("o_proj", o_proj.numel() * 2 / 1e9, cold(lambda i: projection_reference(h, o_projs[i]), copies),
             lambda tiles: projection_triton(h, o_proj, tiles=tiles),
             cold(lambda i, tiles: projection_triton(h, o_projs[i], tiles=tiles), copies)),
        ):
            row = {"model": model, "part": part, "rows": rows, "copies": copies,
                   "eager_us": time_graph(eager) / copies}
            sweep = sweep_tiles(rows, kernel, eager()[0], copies, timed)
            best = min((t for t in sweep if "us" in t), key=lambda t: t["us"])
            row.update(best=best, eager_gbps=gbytes / row["eager_us"] * 1e6, best_gbps=gbytes / best["us"] * 1e6,
                       sweep=sweep)
            print(f"{model} {part} rows={rows}: cuBLAS {row['eager_us']:.1f} us ({row['eager_gbps']:.0f} GB/s), "
                  f"kernel best {best['us']:.1f} us ({row['best_gbps']:.0f} GB/s) tiles {best['tiles']}", flush=True)
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--parts", nargs="+", default=["mlp", "attention"], choices=["mlp", "attention"])
    parser.add_argument("--copies", type=int, default=1,
                        help="time the attention's projections over this many weight copies (more than the L2 "
                             "cache holds: each call reads its weight from memory, as in a decode step)")
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    results = []
    for model in args.models:
        hidden, inter, act = SHAPES[model]
        gate = torch.randn(inter, hidden, device=dev, dtype=dtype) / hidden ** 0.5
        up = torch.randn(inter, hidden, device=dev, dtype=dtype) / hidden ** 0.5
        both = torch.cat([gate, up])
        gbytes = 2 * gate.numel() * gate.element_size() / 1e9
        if "attention" in args.parts:
            results += attention_rows(model, hidden, args.rows, dev, dtype, args.copies)
        if "mlp" not in args.parts:
            continue
        for rows in args.rows:
            x = torch.randn(rows, hidden, device=dev, dtype=dtype)
            ref = gated_projection_reference(x, gate, up, act)
            eager_us = time_graph(lambda: gated_projection_reference(x, gate, up, act))
            row = {"model": model, "part": "gate_up", "rows": rows, "eager_us": eager_us}

            def cat_gemm():
                gu = torch.nn.functional.linear(x, both)
                g, u = gu[:, :inter], gu[:, inter:]
                f = torch.nn.functional
                a = f.gelu(g, approximate="tanh") if act == "gelu_tanh" else f.silu(g)
                return a * u

            row["cat_gemm_us"] = time_graph(cat_gemm)
            sweep = sweep_tiles(rows, lambda tiles: gated_projection_triton(x, gate, up, act, tiles=tiles), ref)
            ok = [t for t in sweep if "us" in t]
            best = min(ok, key=lambda t: t["us"])
            row.update(best=best, default=next((t for t in ok if t["tiles"][1:] == (32, 128, 4, 4)), None),
                       eager_gbps=gbytes / row["eager_us"] * 1e6, best_gbps=gbytes / best["us"] * 1e6,
                       cat_gemm_gbps=gbytes / row["cat_gemm_us"] * 1e6, sweep=sweep)
            print(f"{model} rows={rows}: eager {row['eager_us']:.1f} us ({row['eager_gbps']:.0f} GB/s), cat "
                  f"{row['cat_gemm_us']:.1f}, fused best {best['us']:.1f} us ({row['best_gbps']:.0f} GB/s) "
                  f"tiles {best['tiles']}", flush=True)
            results.append(row)
        results += down_rows(model, hidden, inter, args.rows, dev, dtype)
    with open(args.out, "w") as f:
        json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
