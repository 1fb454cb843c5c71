"""Compile every Triton kernel variant the tests launch for a real GPU target, on a machine without a GPU.

Triton's interpreter (TRITON_INTERPRET=1, what CI runs) never runs the GPU compiler, so a kernel can pass every CPU
test and still fail to compile on the GPU: the paged sparse decode attention did, in Triton 3.6's layout pass on
sm_90, where every decode on an H100 then failed. This check closes that gap without a GPU:

    record   run kernel tests under the interpreter and write each launch's kernel, argument types, constexpr
             values and launch options (num_warps, num_stages) to a JSON file
    compile  compile each distinct variant with the installed Triton for the target (default cuda:90, the H100 /
             H200): every MLIR pass and ptxas run on the CPU; nothing is launched

    python tests/kernels/triton_compile_check.py record out/launches.json tests/kernels -q
    python tests/kernels/triton_compile_check.py compile out/launches.json --arch 90

test_gpu_compile.py (beside this file) runs both in subprocesses, in CPU CI. To check the Triton version of the GPU machine, run
``compile`` in a virtual environment with that Triton (e.g. ``pip install triton==3.6.0``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: hf_rocketkv is imported from there

TORCH_TO_TRITON = {
    "torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float64": "fp64",
    "torch.int8": "i8", "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64", "torch.uint8": "u8",
    "torch.bool": "i1", "torch.float8_e5m2": "fp8e5", "torch.float8_e4m3fn": "fp8e4nv",
}
LAUNCH_OPTIONS = ("num_warps", "num_stages")


# ------------------------------------------------------------------------------------------------------- record
def describe(value) -> list:
    """One launch argument as JSON: a tensor by its dtype, a Python scalar by its type and value."""
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype)]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", value]
    if value is None:
        return ["none", None]
    return ["repr", repr(value)]


def record(out: Path, pytest_args: list[str]) -> int:
    """Run pytest under the interpreter with every kernel launch recorded, then write the distinct variants."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    original = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        names = list(inspect.signature(fn).parameters)
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        launch = {
            "module": fn.__module__, "kernel": fn.__name__,
            "args": {name: describe(bound[name]) for name in names if name in bound},
            "options": {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs},
        }
        seen.setdefault(json.dumps(launch, sort_keys=True), launch)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        status = pytest.main(["-p", "no:cacheprovider", "-p", "no:xdist", *pytest_args])
    finally:
        InterpretedFunction.run = original
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(list(seen.values()), indent=1))
    print(f"recorded {len(seen)} distinct launches -> {out}")
    return int(status)


# ------------------------------------------------------------------------------------------------------ compile
HALF = ("torch.float16", "torch.bfloat16")


def gpu_choices(launch: dict) -> dict:
    """Constexprs a launcher sets differently under the interpreter than on a GPU (see each ``interpreting()`` in
    hf_rocketkv/kernels): the recorded launch is compiled with the GPU's choice, which is what the GPU runs."""
    from hf_rocketkv.kernels.select_pages import TL_SORT_ON_GPU

    kernel, args = launch["kernel"], launch["args"]
    dtype = lambda name: args.get(name, ["", ""])[1]  # noqa: E731
    if kernel in ("_select_chunk_kernel", "_select_merge_kernel") and "TL_SORT" in args:
        return {"TL_SORT": TL_SORT_ON_GPU}
    if kernel in ("_sparse_decode_split_kernel", "_fused_select_attend_kernel"):  # the same attention dtypes
        if dtype("k_ptr") == "torch.float8_e4m3fn":  # fp8 pages: fp32 dots for fp32 queries, else q's half type
            return {"QK_FP32": dtype("q_ptr") == "torch.float32", "PV_FP32": dtype("q_ptr") == "torch.float32"}
        same = dtype("q_ptr") == dtype("k_ptr") == dtype("v_ptr")
        return {"QK_FP32": not (same and dtype("k_ptr") in HALF), "PV_FP32": not (same and dtype("v_ptr") in HALF)}
    if kernel == "_page_logits_kernel" and dtype("kt_ptr") == "torch.bfloat16":
        return {"DOT_DT": 2}
    if kernel in ("_window_stats_kernel", "_window_accum_kernel"):
        q, k = dtype("q_ptr"), dtype("k_ptr")
        return {"FP32": not (q == k and k in HALF)}
    return {}


def triton_type(kind: str, value, float_type: str = "fp32") -> str:
    if kind == "tensor":
        return "*" + TORCH_TO_TRITON[value]
    if kind == "bool":
        return "i1"
    if kind == "int":
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if kind == "float":
        return float_type
    raise ValueError(f"cannot type a non-constexpr argument of kind {kind!r}")


def as_on_gpu(launch: dict) -> dict:
    """The recorded launch with the constexprs a GPU launch would use (``gpu_choices``)."""
    choices = {name: ["bool" if isinstance(v, bool) else "int", v] for name, v in gpu_choices(launch).items()}
    return dict(launch, args={**launch["args"], **choices})


def float_types(launch: dict) -> tuple[str, ...]:
    """How the launch's Python floats are typed: fp32 by Triton's launcher; a launch with float arguments is also
    compiled with them as fp64, as torch.compile's inductor passes them (a loop-carried fp32 value that a float
    argument turns into fp64 fails only there)."""
    has_float = any(kind == "float" for kind, _value in launch["args"].values())
    return ("fp32", "fp64") if has_float else ("fp32",)


def source_of(launch: dict, float_type: str = "fp32"):
    """The kernel's ASTSource: constexpr parameters take the launch's values, the others their types (Python floats
    as ``float_type``)."""
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    names = list(inspect.signature(kernel.fn).parameters)
    constexpr_names = {names[i] for i in kernel.constexprs}
    signature, constexprs = {}, {}
    missing = [name for name in names if name not in launch["args"] and name not in constexpr_names]
    if missing:
        raise ValueError(f"the record of {launch['kernel']} has no {missing}: recorded from another version of the "
                         f"kernel? Record again")
    for index, name in enumerate(names):
        kind, value = launch["args"].get(name, ["none", None])
        if name in constexpr_names or kind == "none":
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        else:
            signature[name] = triton_type(kind, value, float_type)
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs)


def compile_all(launches_file: Path, arch: int, out: Path | None) -> int:
    """Compile each recorded variant for ``cuda:<arch>``; print and return the number of failures."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    launches, unique = [], set()
    for recorded in json.loads(launches_file.read_text()):  # with the GPU's choices, then distinct
        launch = as_on_gpu(recorded)
        key = json.dumps(launch, sort_keys=True)
        if key not in unique:
            unique.add(key)
            launches.append(launch)
    results, failures = [], 0
    for launch, float_type in ((launch, kind) for launch in launches for kind in float_types(launch)):
        start = time.perf_counter()
        label = f"{launch['kernel']} {launch['options']} floats={float_type} " + " ".join(
            f"{k}={v[1]}" for k, v in launch["args"].items() if v[0] in ("bool", "none") or k.isupper())
        try:
            triton.compile(source_of(launch, float_type), target=target, options=dict(launch["options"]))
            status, error = "ok", None
        except Exception as err:  # noqa: BLE001 - report every variant, not the first failure
            failures += 1
            status, error = "FAIL", f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"
        seconds = time.perf_counter() - start
        results.append(dict(launch=label, status=status, error=error, seconds=round(seconds, 2)))
        print(f"{status:4} {seconds:5.1f}s {label}" + (f"\n     {error}" if error else ""), flush=True)
    summary = dict(triton=triton.__version__, arch=arch, variants=len(results), failures=failures, results=results)
    if out is not None:
        out.write_text(json.dumps(summary, indent=1))
    print(f"triton {triton.__version__}, cuda:{arch}: {len(results) - failures}/{len(results)} variants compiled")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run pytest under the interpreter and record kernel launches")
    rec.add_argument("out", type=Path)
    rec.add_argument("pytest_args", nargs=argparse.REMAINDER)
    comp = sub.add_parser("compile", help="compile the recorded launches for a GPU target")
    comp.add_argument("launches", type=Path)
    comp.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    comp.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.out, args.pytest_args or ["tests/kernels", "-q"])
    return 1 if compile_all(args.launches, args.arch, args.out) else 0


if __name__ == "__main__":
    sys.exit(main())
