"""Where the decode step's weight GEMMs stand against the memory floor, and what the ecosystem offers to get closer.

    python -m benchmarks.probes.gemm_floor --out out/gemm_floor            # CUDA, about 3 minutes on an H100
    python -m benchmarks.probes.gemm_floor --cpu-smoke --out out/gemm_smoke  # CPU: the script's own logic, tiny shapes

At decode every weight of the model is read once per step, so a step's GEMMs cannot take less than
``weight bytes / memory bandwidth``. This times all of Llama-3.1-8B's decode GEMMs (32 layers x q, k, v, o, gate, up,
down, then the LM head; bf16, random weights, 15.0 GiB) for one step, captured in one CUDA graph (so launch overhead
is not counted: the decode runners replay graphs too), at batch 1 and batch 64, for each variant:

- ``cublas``: ``F.linear`` as transformers calls it (torch's default BLAS, bf16 reduced-precision reductions allowed,
  torch's default);
- ``cublas_full_precision_reduction``: the same with ``allow_bf16_reduced_precision_reduction = False``;
- ``cublaslt``: ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``inductor_max_autotune``: ``torch.compile(F.linear, mode="max-autotune-no-cudagraphs")`` per shape (inductor picks
  among its Triton templates and cuBLAS by timing);
- ``cublas+fused_qkv_gate_up`` / ``inductor_max_autotune+fused_qkv_gate_up``: the same weights with q, k, v
  concatenated into one GEMM and gate, up into one (compared with ``cublas`` on the first layer's outputs);
- ``triton_gemv``: a plain split-N Triton GEMV written here (one program per block of output features, the row of
  ``x`` reused from registers; batch 1 only).

Reported per variant: ms per step, achieved GB/s (weight bytes / time) and its fraction of the device's peak
(``--peak-gbs``; default from the device name), and exactness against ``cublas``: the largest absolute difference of
the outputs and whether they are bit-identical, plus the largest error of either against a float64 reference on
the first layer's shapes. A variant is worth keeping only if faster and as exact as ``cublas`` against float64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

# Llama-3.1-8B: (in_features, out_features) of each decoder layer's projections, then the LM head
LAYER_SHAPES = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
                "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}
LM_HEAD = (4096, 128256)
LAYERS = 32
PEAK_GBS = {"H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0, "H100 NVL": 3900.0}


def peak_for(name: str) -> float | None:
    return next((gbs for key, gbs in PEAK_GBS.items() if key in name), None)


def step_gemms(layers: int, layer_shapes: dict, lm_head: tuple, device, dtype) -> list[torch.Tensor]:
    """One weight ``[out, in]`` per GEMM of a decode step, in the order the model runs them."""
    generator = torch.Generator(device=device).manual_seed(0)
    weights = []
    for _ in range(layers):
        for fan_in, fan_out in layer_shapes.values():
            weights.append(torch.randn(fan_out, fan_in, device=device, dtype=dtype, generator=generator) * fan_in**-0.5)
    weights.append(torch.randn(lm_head[1], lm_head[0], device=device, dtype=dtype, generator=generator) * 0.02)
    return weights


def run_step(linear, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Every GEMM of the step on a fixed input of its width (the values do not change the time)."""
    return [linear(inputs[w.shape[1]], w) for w in weights]


def time_graph(fn, repeats: int) -> list[float]:
    """Milliseconds of each replay of ``fn`` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_eager(fn, repeats: int) -> list[float]:
    """CPU fallback (``--cpu-smoke``): wall milliseconds of each call."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def triton_gemv():
    """``linear(x, w)`` for x ``[1, K]``, w ``[N, K]`` bf16 -> ``[1, N]``, fp32 accumulation."""
    import triton
    import triton.language as tl

    SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4  # noqa: N806

    @triton.jit
    def kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                        other=0.0)
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        if m != 1:
            raise ValueError("triton_gemv: batch 1 only")
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        block_m = 1
        # enough programs to keep every SM streaming (4 per SM), as wide as that allows
        block_n = next((b for b in (64, 32, 16) if triton.cdiv(n, b) >= 4 * SMS), 8)
        kernel[(triton.cdiv(n, block_n),)](x, w, out, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n,
                                           BLOCK_K=256)
        return out

    return linear


def variants(device: torch.device) -> dict:
    """name -> (linear(x, w), setup(), teardown())."""
    matmul = torch.backends.cuda.matmul
    noop = lambda: None  # noqa: E731
    out = {"cublas": (F.linear, noop, noop)}
    if device.type != "cuda":
        return out
    previous = {}

    def full_precision():
        previous["reduced"] = matmul.allow_bf16_reduced_precision_reduction
        matmul.allow_bf16_reduced_precision_reduction = False

    def restore_precision():
        matmul.allow_bf16_reduced_precision_reduction = previous["reduced"]

    def lt():
        previous["blas"] = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")

    def restore_lt():
        torch.backends.cuda.preferred_blas_library(previous["blas"])

    # one graph per (batch, weight shape): more than dynamo's default limit of 8 per function
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    out["cublas_full_precision_reduction"] = (F.linear, full_precision, restore_precision)
    out["cublaslt"] = (F.linear, lt, restore_lt)
    out["inductor_max_autotune"] = (compiled, noop, noop)
    out["triton_gemv"] = (triton_gemv(), noop, noop)
    return out


def per_shape(linear, weights, inputs, timer, repeats: int, peak: float | None) -> dict:
    """``"in x out"`` -> GB/s of the GEMMs of that weight shape, every layer's in one replay (so the weights stream
    from memory: one layer's would sit in the L2 cache across replays)."""
    out = {}
    groups: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        groups.setdefault(tuple(w.shape), []).append(w)
    for shape, group in groups.items():
        x = inputs[shape[1]]
        ms = statistics.median(timer(lambda group=group, x=x: [linear(x, w) for w in group], repeats))
        gbs = sum(w.numel() * w.element_size() for w in group) / ms / 1e6
        w = group[0]
        out[f"{w.shape[1]}x{w.shape[0]}"] = {"ms": ms, "gb_per_s": gbs,
                                             "fraction_of_peak": gbs / peak if peak else None}
    return out


def fuse_projections(weights: list[torch.Tensor], per_layer: int) -> list[torch.Tensor]:
    """The same step with q, k, v as one weight and gate, up as one (what a fused-projection model would hold)."""
    fused = []
    for start in range(0, len(weights) - 1, per_layer):
        q, k, v, o, gate, up, down = weights[start:start + per_layer]
        fused += [torch.cat([q, k, v]), o, torch.cat([gate, up]), down]
    return fused + weights[-1:]


def unfuse_first_layer(outputs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first layer's seven projection outputs from a fused step's outputs."""
    q, k, v, o, gate, up, down = weights[:7]
    qkv, o_out, gate_up, down_out = outputs[:4]
    q_out, k_out, v_out = qkv.split([q.shape[0], k.shape[0], v.shape[0]], dim=1)
    gate_out, up_out = gate_up.split([gate.shape[0], up.shape[0]], dim=1)
    return [q_out, k_out, v_out, o_out, gate_out, up_out, down_out]


def float64_error(linear, weights, inputs) -> float:
    """Largest |linear - float64 reference| over the first layer's GEMMs."""
    worst = 0.0
    for w in weights[: len(LAYER_SHAPES)]:
        x = inputs[w.shape[1]]
        reference = x.double() @ w.double().T
        worst = max(worst, (linear(x, w).double() - reference).abs().max().item())
    return worst


def measure(args) -> dict:
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.bfloat16
    layers, shapes, head = (LAYERS, LAYER_SHAPES, LM_HEAD) if not args.cpu_smoke else (
        2, {k: (v[0] // 64, v[1] // 64) for k, v in LAYER_SHAPES.items()}, (64, 2004))
    weights = step_gemms(layers, shapes, head, device, dtype)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_gbs or peak_for(name)
    timer = time_eager if args.cpu_smoke else time_graph
    rows = []
    for batch in args.batches:
        generator = torch.Generator(device=device).manual_seed(batch)
        widths = {w.shape[1] for w in weights}
        inputs = {k: torch.randn(batch, k, device=device, dtype=dtype, generator=generator) for k in widths}
        baseline = None
        available = variants(device)  # built once per batch: the compiled wrapper and the Triton kernel included
        for variant, (linear, setup, teardown) in available.items():
            row = {"batch": batch, "variant": variant}
            setup()
            try:
                outputs = run_step(linear, weights, inputs)
                times = timer(lambda linear=linear: run_step(linear, weights, inputs), args.repeats)
                ms = statistics.median(times)
                row.update(ms_per_step=ms, gb_per_s=weight_bytes / ms / 1e6,
                           error_vs_float64=float64_error(linear, weights, inputs))
                if peak:
                    row["fraction_of_peak"] = row["gb_per_s"] / peak
                row["per_shape"] = per_shape(linear, weights, inputs, timer, args.repeats, peak)
                if baseline is None:
                    baseline = outputs
                else:
                    row["max_abs_diff_vs_cublas"] = max((a.float() - b.float()).abs().max().item()
                                                        for a, b in zip(outputs, baseline))
                    row["bit_identical_to_cublas"] = all(torch.equal(a, b) for a, b in zip(outputs, baseline))
            except Exception as err:  # a variant that cannot run here is reported, not fatal  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            finally:
                teardown()
            rows.append(row)
            print(json.dumps(row), flush=True)
        if device.type == "cuda":  # the fused layout with the two variants that matter
            fused = fuse_projections(weights, len(shapes))
            for variant in ("cublas", "inductor_max_autotune"):
                linear = available[variant][0]
                row = {"batch": batch, "variant": variant + "+fused_qkv_gate_up"}
                outputs = run_step(linear, fused, inputs)
                ms = statistics.median(timer(lambda linear=linear: run_step(linear, fused, inputs), args.repeats))
                row.update(ms_per_step=ms, gb_per_s=weight_bytes / ms / 1e6)
                if peak:
                    row["fraction_of_peak"] = row["gb_per_s"] / peak
                first = unfuse_first_layer(outputs, weights)
                row["max_abs_diff_vs_cublas_first_layer"] = max(
                    (a.float() - b.float()).abs().max().item() for a, b in zip(first, baseline[:7]))
                row["bit_identical_to_cublas_first_layer"] = all(torch.equal(a, b) for a, b in zip(first, baseline))
                rows.append(row)
                print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"device": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": args.commit or commit or "unknown", "torch": torch.__version__,
            "command": "python -m benchmarks.probes.gemm_floor " + " ".join(args.argv), "weight_bytes": weight_bytes,
            "peak_gb_per_s": peak, "floor_ms": weight_bytes / peak / 1e6 if peak else None,
            "metric": "median ms of one decode step's weight GEMMs replayed as one CUDA graph (steady state)",
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gemm_floor.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--peak-gbs", type=float, default=None, help="the device's memory bandwidth in GB/s")
    parser.add_argument("--commit", default=None, help="the tree's commit where it is no git checkout")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (cublas variant only)")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --cpu-smoke)")
    record = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_floor.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
