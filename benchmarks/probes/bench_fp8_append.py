"""Device time of one decode append (``paged_append_token``) on fp8 pool pages against bf16 pages, on a GPU.

    python -m benchmarks.probes.bench_fp8_append [--batch 1 32] [--out DIR]

Llama-3.1-8B KV shapes (8 KV heads, head_dim 128), pool pages of 16 tokens, KT pages of 4. Each case appends
``--steps`` tokens per row into pages that start empty, captured as one CUDA graph and timed with CUDA events over
three replays (device time per append, as in a graphed decode step), so every page opens, grows and keeps its scale
as in decode. Token magnitudes:
``steady`` (every token N(0, 1): the page scale grows at a page's record amax, a few times per page), ``rising``
(each token larger than the last: the scale grows at every step, every slot below re-quantized), ``falling`` (never
grows after a page opens). Writes ``bench_fp8_append.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from hf_rocketkv.kernels.triton_ops import TRITON_OPS

HEADS, DIM, PAGE, KT_PAGE = 8, 128, 16, 4


def tokens(kind: str, steps: int, batch: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(steps):
        x = torch.randn((batch, HEADS, DIM), generator=g)
        if kind == "rising":
            x = x * (1.05 ** (i % PAGE))
        elif kind == "falling":
            x = x * (0.95 ** (i % PAGE))
        out.append(x.to(device, torch.bfloat16))
    return out


def run_case(batch: int, dtype: torch.dtype, granularity: str, kind: str, steps: int, device) -> float:
    pages_per_row = -(-steps // PAGE) + 1
    num_pages = batch * pages_per_row
    k = torch.zeros((num_pages, HEADS, PAGE, DIM), dtype=dtype, device=device)
    v = torch.zeros_like(k)
    kt = torch.zeros((num_pages, HEADS, PAGE // KT_PAGE, 2, DIM), dtype=torch.float8_e5m2, device=device)
    table = torch.arange(num_pages, dtype=torch.int32, device=device).reshape(batch, pages_per_row)
    positions = torch.zeros((batch, HEADS, pages_per_row * PAGE), dtype=torch.int32, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    seen = torch.tensor(1, device=device)
    scales = {}
    if dtype == torch.float8_e4m3fn:
        shape = (num_pages,) if granularity == "page" else (num_pages, HEADS)
        scales = dict(k_scale=torch.ones(shape, device=device), v_scale=torch.ones(shape, device=device))
    new = tokens(kind, steps, batch, device)
    append = TRITON_OPS.paged_append_token

    def once():
        lengths.zero_()
        for x in new:
            append(k, v, kt, table, positions, lengths, seen, x, x, KT_PAGE, **scales)

    once()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # launches replayed without the host, as in a graphed decode step
    with torch.cuda.graph(graph):
        once()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (3 * steps)  # us per append


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for batch in args.batch:
        for dtype, granularity in ((torch.bfloat16, "-"), (torch.float8_e4m3fn, "page"), (torch.float8_e4m3fn, "head")):
            for kind in ("steady", "rising", "falling"):
                us = run_case(batch, dtype, granularity, kind, args.steps, device)
                row = dict(batch=batch, dtype=str(dtype).replace("torch.", ""), granularity=granularity, tokens=kind,
                           us_per_append=round(us, 2))
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fp8_append.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows),
                                                          indent=1))


if __name__ == "__main__":
    main()
