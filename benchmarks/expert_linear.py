"""One mixture-of-experts layer of a decode step: transformers' experts forwards against RocketKV's in-place one.

gpt-oss-20b's experts (32 experts of hidden 2880 and intermediate 2880, top 4, bf16, random weights) called as the
modeling code calls them for ``T`` decode tokens: transformers' ``batched_mm`` (gathers the chosen experts' weights,
then multiplies), ``grouped_mm`` (one grouped GEMM over every expert, offsets per expert), and
``integration/experts.experts_forward`` (``kernels/expert_linear``: each pair's expert read in place; its schedule
chosen by the pairs per expert, and each schedule forced: ``rocketkv pairs``, ``rocketkv grouped``). Each is
captured as a CUDA graph of ``--calls`` calls and replayed (GPU time per call, as inside a graphed decode step); the
bytes of expert weights a call must read at least give its effective bandwidth. Outputs are checked against the
float64 forward first.

    python -m benchmarks.expert_linear --tokens 1 2 4 8 --out results/expert_linear.json
    python -m benchmarks.expert_linear --tokens 8 16 32 64 128 --sweep-grouped --out results/expert_grouped.json
    python -m benchmarks.expert_linear --quick     # tiny shapes on CPU (Triton's interpreter): the logic only
"""

from __future__ import annotations

import argparse
import functools
import datetime
import json
import os
from pathlib import Path

import torch


SWEEP = [("pairs", (n, k, w, st)) for n in (16, 32, 64) for k in (64, 128, 256) for w in (2, 4, 8) for st in (2, 4)
         if n * k <= 8192]
SWEEP_GROUPED = [("grouped", (n, k, w, st)) for n in (32, 64, 128) for k in (32, 64, 128) for w in (4, 8)
                 for st in (2, 3, 4) if n * k <= 8192]


def build(quick: bool, device, dtype):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    shapes = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
    if quick:
        shapes.update(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    config = GptOssConfig(**shapes)
    module = GptOssExperts(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return module.to(device, dtype), shapes


def routing(tokens: int, shapes: dict, device, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((tokens, shapes["hidden_size"]), generator=g).to(device, dtype)
    top, ids = torch.topk(torch.randn((tokens, shapes["num_local_experts"]), generator=g),
                          shapes["num_experts_per_tok"], dim=-1)
    return hidden, ids.to(device), torch.softmax(top, dim=-1).to(device, dtype)


def variants(module, shapes, sweep=()):
    """name -> a callable of (hidden, ids, weights): transformers' implementations by name, RocketKV's, and RocketKV's
    with each ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` of ``sweep``."""
    from transformers import GptOssConfig

    from hf_rocketkv.integration import compat, experts

    def transformers_impl(name):
        config = GptOssConfig(**shapes, experts_implementation=name)

        def call(hidden, ids, weights):
            module.config = config  # which implementation transformers' dispatcher reads (this module only)
            return module(hidden, ids, weights)
        return call

    layout = compat.experts_layout(module)
    out = {"batched_mm": transformers_impl("batched_mm"), "grouped_mm": transformers_impl("grouped_mm"),
           "rocketkv": lambda h, i, w: experts.experts_forward(module, layout, h, i, w)}
    for schedule in ("pairs", "grouped"):
        out[f"rocketkv {schedule}"] = functools.partial(_with_tiles, module, layout, schedule, None)
    for schedule, tiles in sweep:
        out[f"rocketkv {schedule}{tiles}"] = functools.partial(_with_tiles, module, layout, schedule, tiles)
    return out


def _with_tiles(module, layout, schedule, tiles, hidden, ids, weights):
    from hf_rocketkv.kernels import expert_linear

    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    up = expert_linear.expert_linear_triton(hidden, module.gate_up_proj, module.gate_up_proj_bias, flat,
                                            layout.transposed, top_k, tiles, schedule)
    down = expert_linear.expert_linear_triton(layout.apply_gate(up).contiguous(), module.down_proj,
                                              module.down_proj_bias, flat, layout.transposed, 1, tiles, schedule)
    return (down * weights.reshape(-1, 1)).view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def time_call(fn, args, calls: int, device) -> float:
    """GPU microseconds per call: ``calls`` calls captured in one CUDA graph, replayed (median of 5)."""
    if device.type != "cuda":
        fn(*args)
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[2]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--calls", type=int, default=24, help="calls per captured graph (default 24: gpt-oss' layers)")
    parser.add_argument("--sweep", action="store_true", help="also RocketKV's pairs schedule with other tiles")
    parser.add_argument("--sweep-grouped", action="store_true", help="also its grouped schedule with other tiles")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    quick = args.quick or not torch.cuda.is_available()
    if quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cpu" if quick else "cuda")
    dtype = torch.float32 if quick else torch.bfloat16
    from transformers import GptOssConfig

    module, shapes = build(quick, device, dtype)
    expert_bytes = sum(p[0].numel() * p.element_size() for p in (module.gate_up_proj, module.down_proj))
    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            hidden, ids, weights = routing(tokens, shapes, device, dtype, seed=tokens)
            module.config = GptOssConfig(**shapes, experts_implementation="eager")  # the loop over experts
            truth = module.double()(hidden.double(), ids, weights.double())
            module.to(dtype)
            distinct = len(set(ids.reshape(-1).tolist()))
            row = dict(tokens=tokens, pairs=ids.numel(), distinct_experts=distinct,
                       min_bytes=distinct * expert_bytes)
            sweep = (SWEEP if args.sweep else []) + (SWEEP_GROUPED if args.sweep_grouped else [])
            for name, fn in variants(module, shapes, sweep).items():
                out = fn(hidden, ids, weights)
                error = float((out.double() - truth).abs().max() / truth.abs().max())
                us = time_call(fn, (hidden, ids, weights), args.calls, device)
                row[name] = dict(us_per_call=us, relative_error=error,
                                 gb_per_s=row["min_bytes"] / (us * 1e-6) / 1e9 if us == us else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = dict(benchmark="expert_linear", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, transformers=__import__("transformers").__version__, dtype=str(dtype),
                  shapes=shapes, calls_per_graph=args.calls, rows=rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
