"""Host microseconds per eager call of RocketKV's decode ops against a bare Triton launch, on a GPU (which part of the 513 us RocketKV adds per layer and step is Triton's launcher, which is ours).

    python -m benchmarks.probes.launch_overhead --out $OUT

Each entry is called ``--calls`` times back to back (no sync inside; the GPU work is tiny, so the loop is bound by
the host) on one layer's decode state at Llama-3.1-8B shapes (batch 1, 8 KV heads, 4 query heads per KV head,
head_dim 128, 2,304 kept tokens in pages of 4, fp8 KT): host us per call. ``bare_triton_launch``: a kernel with no
work and as many arguments as the append kernel (Triton's own per-launch cost: argument specialization, cache
lookup, driver call). The three RocketKV ops are timed twice: through ``kernels/launch.TritonLaunch`` (what eager calls use) and with its
fast path off (``[Triton's launcher]``: every launch through ``JITFunction.run``). Writes ``launch_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from hf_rocketkv.kernels.launch import TritonLaunch
from hf_rocketkv.kernels.triton_ops import TRITON_OPS

try:
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover
    set_wrap_triton_enabled = None


@triton.jit
def _nothing(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
             a22, a23, a24, a25, a26, a27, B: tl.constexpr):
    pass


def per_call_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def direct_launch(scalars):
    """The bare kernel launched through its compiled kernel's own ``run`` (what ``JITFunction.run`` calls after
    specializing the arguments and looking the kernel up), or None where this Triton's internals differ: the floor a
    launch path that skips re-specialization could reach."""
    try:
        compiled = _nothing[(1,)](*scalars, B=1)
        device = torch.cuda.current_device()
        stream = torch.cuda.current_stream(device).cuda_stream
        values = (*scalars, 1)
        metadata = compiled.launch_metadata((1, 1, 1), stream, *values)

        def run():
            compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata, None, None, *values)

        run()
        torch.cuda.synchronize()
        return run
    except Exception as err:  # noqa: BLE001 - an internal API: report and go on
        print(f"direct launch unavailable on triton {triton.__version__}: {type(err).__name__}: {err}")
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    dev = torch.device("cuda")
    heads, group, dim, page, kept = 8, 4, 128, 4, 2304
    capacity = kept + 256
    pages_per_row = capacity // page
    k = torch.randn((pages_per_row, heads, page, dim), device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kt = torch.randn((pages_per_row, heads, 1, 2, dim), device=dev).to(torch.float8_e5m2)
    table = torch.arange(pages_per_row, dtype=torch.int32, device=dev)[None]
    positions = torch.zeros((1, heads, capacity), dtype=torch.int32, device=dev)
    lengths = torch.full((1,), kept, dtype=torch.long, device=dev)
    seen = torch.tensor(kept, device=dev)
    q = torch.randn((1, heads, group, dim), device=dev, dtype=torch.bfloat16)
    new = torch.randn((1, heads, dim), device=dev, dtype=torch.bfloat16)
    ops = TRITON_OPS
    idx, valid = ops.paged_top_pages(q, kt, table, lengths, page, 128, 64)
    scalars = [k] * 12 + [1] * 16

    def append():
        lengths.fill_(kept)  # (one tiny fill: the append grows lengths)
        ops.paged_append_token(k, v, kt, table, positions, lengths, seen, new, new, page)

    entries = {
        "bare_triton_launch (28 args)": lambda: _nothing[(1,)](*scalars, B=1),
        "torch.empty": lambda: torch.empty((1, heads, group, dim), device=dev, dtype=torch.bfloat16),
        "lengths.fill_ (one aten launch)": lambda: lengths.fill_(kept),
        "paged_top_pages (scores + select)": lambda: ops.paged_top_pages(q, kt, table, lengths, page, 128, 64),
        "paged_sparse_decode_attention": lambda: ops.paged_sparse_decode_attention(
            q, k, v, table, idx, valid, lengths, page, dim**-0.5),
        "paged_append_token (+ one fill)": append,
    }
    direct = direct_launch(scalars)
    if direct is not None:
        entries["bare kernel through CompiledKernel.run (no re-specialization)"] = direct
    nothing = TritonLaunch(_nothing)

    def through_triton_launch():
        with set_wrap_triton_enabled(False):
            nothing[(1,)](*scalars, B=1)

    if set_wrap_triton_enabled is not None:
        entries["bare kernel through TritonLaunch (+ the wrap_triton switch)"] = through_triton_launch
    rows = {name: round(per_call_us(fn, args.calls), 2) for name, fn in entries.items()}
    # the same ops with TritonLaunch's fast path off (every launch through Triton's JITFunction.run), same process
    fast_getitem = TritonLaunch.__getitem__
    TritonLaunch.__getitem__ = lambda self, grid: (fast_getitem(self, grid) if torch.compiler.is_compiling()
                                                   else self.kernel[grid])
    try:
        for name in [n for n in entries if n.startswith("paged_")]:
            rows[f"{name} [Triton's launcher]"] = round(per_call_us(entries[name], args.calls), 2)
    finally:
        TritonLaunch.__getitem__ = fast_getitem
    for name, us in rows.items():
        print(f"{us:8.2f} us  {name}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_overhead.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), us_per_call=rows),
                                                          indent=1))


if __name__ == "__main__":
    main()
