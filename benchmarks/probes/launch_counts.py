"""Kernel launches of a pool-backed prefill, per RocketKV function (on a slow host the prefill and the prefix hit
are bound by the launches RocketKV adds to the model's).

    python -m benchmarks.probes.launch_counts --out out                    # CPU, about a minute
    TRITON_INTERPRET=1 python -m benchmarks.probes.launch_counts --triton  # the Triton backend's launches
    TRITON_INTERPRET=1 python -m benchmarks.probes.launch_counts --triton --decode-attention gemma-3-12b
                                                                # a decode step's launches per attention module

Counts run on the CPU with the tiny model: every aten op that launches a kernel on a GPU (views, empty allocations
and metadata ops excluded) and every Triton kernel launch is attributed to the innermost ``hf_rocketkv`` function on
the Python stack (``model`` when none: the model's own ops). The counts do not depend on the device, only on the
code path, so they are a CPU-measurable proxy for the host time of a GPU prefill;
``tests/kernels/test_launch_counts.py`` keeps the per-layer count of stage 1's compaction from growing back.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_rocketkv

# aten ops that launch no kernel: views, allocations without a fill, metadata
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "transpose", "permute", "unsqueeze", "squeeze",
    "as_strided", "t", "alias", "detach", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "unbind", "split", "split_with_sizes", "chunk", "narrow", "movedim", "view_as", "unflatten", "flatten",
    "lift_fresh", "_reshape_alias", "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "_has_compatible_shallow_copy_type", "is_same_size", "diagonal", "expand_as", "real", "conj", "resolve_conj",
    "resolve_neg", "_to_copy_noop", "unfold", "set_", "_local_scalar_dense", "dim", "size", "stride", "numel",
}


TRANSPARENT = {"Call.__call__", "RocketKVGenerateHooks._prefill_rows", "RocketKVGenerateHooks.prefill"}


# the package's own folder: a file is the package's when its path starts here (a path that merely holds a folder
# named hf_rocketkv, such as a clone of that name with its .venv inside, is not)
PACKAGE_DIR = os.path.dirname(os.path.abspath(hf_rocketkv.__file__)) + os.sep


def package_module(filename: str, package_dir: str = PACKAGE_DIR) -> str | None:
    """``cache.compaction`` for ``<package_dir>cache/compaction.py``; None for a file outside the package."""
    path = os.path.abspath(filename)
    if not path.startswith(package_dir):
        return None
    return path[len(package_dir):].removesuffix(".py").replace(os.sep, ".")


def _innermost_rocketkv_frame() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        # compat's ``Call`` wraps transformers' generate and forward: what runs inside it is the model's
        transparent = frame.f_code.co_qualname in TRANSPARENT
        module = None if transparent else package_module(frame.f_code.co_filename)
        if module is not None:
            return f"{module}.{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "model"


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops per innermost hf_rocketkv function (``counts``) and op (``ops``)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0  # > 0 inside an interpreted Triton kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH and not self.paused:
            where = _innermost_rocketkv_frame()
            self.counts[where] += 1
            self.ops[(where, name)] += 1
        return func(*args, **(kwargs or {}))

    def add_triton_launch(self, kernel_name: str) -> None:
        where = _innermost_rocketkv_frame()
        self.counts[where] += 1
        self.ops[(where, f"triton:{kernel_name}")] += 1


def _hook_triton(counter: LaunchCounter):
    """Count Triton launches: under TRITON_INTERPRET=1 by wrapping the interpreter's ``run`` (the copies the
    interpreter makes of the arguments are not counted: a GPU launch makes none), else through the launch-enter hook.
    Returns the function that undoes it (None when triton is absent)."""
    try:
        import triton
    except ImportError:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run

        def run(self, *args, **kwargs):
            counter.add_triton_launch(self.__name__)
            counter.paused += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.paused -= 1

        InterpretedFunction.run = run
        return lambda: setattr(InterpretedFunction, "run", original)
    knobs = triton.knobs.runtime

    def hook(metadata):
        counter.add_triton_launch(getattr(metadata, "name", None) or str(metadata.data.get("name", "?")))

    previous = knobs.launch_enter_hook
    knobs.launch_enter_hook = hook
    return lambda: setattr(knobs, "launch_enter_hook", previous)


def count_prefill(prompt_len: int = 512, layers: int = 2, backend: str = "torch", prefix_hit: bool = False) -> dict:
    """Launch counts of one pool-backed request's first token (``generate(max_new_tokens=1)``) for a new prompt of
    ``prompt_len`` tokens on the tiny model (``layers`` decoder layers); with ``prefix_hit`` the counted request shares
    all but its last 64 tokens with the one before it. Returns ``{"per_function": {...}, "per_op": {...}, "layers": layers}``."""
    from benchmarks.bench_prefix_reuse import setup

    from hf_rocketkv import KVBlockPool, RocketKVCache

    torch.set_grad_enabled(False)
    config, dtype, model = setup(torch.device("cpu"), quick=True, layers=layers)
    config = config.replace(backend=backend)
    pool = KVBlockPool(model.config, max_gpu_bytes=64 * 2**20, page_size=16, dtype=dtype,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device="cpu")
    g = torch.Generator().manual_seed(0)

    def prompt(n: int = prompt_len) -> torch.Tensor:
        return torch.randint(3, model.config.vocab_size, (1, n), generator=g)

    def first_token(ids: torch.Tensor) -> None:
        cache = RocketKVCache(config, pool=pool)
        try:
            model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=1,
                           do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=True)
        finally:
            cache.close()

    first_token(prompt())  # warm-up: lazy imports, first-call work
    ids = prompt()
    if prefix_hit:  # the prefix's pages stay in the pool (LRU) after the first request
        first_token(ids)
        ids = torch.cat([ids[:, :-64], prompt(64)], dim=1)
    counter = LaunchCounter()
    restore = _hook_triton(counter)
    try:
        with counter:
            first_token(ids)
    finally:
        if restore is not None:
            restore()
    per_op = collections.defaultdict(dict)
    for (where, op), n in sorted(counter.ops.items()):
        per_op[where][op] = n
    return {"layers": layers, "prompt_len": prompt_len, "backend": backend, "prefix_hit": prefix_hit,
            "per_function": dict(counter.counts.most_common()), "per_op": dict(per_op)}


def count_decode_attention(model_name: str = "gemma-3-12b", backend: str = "torch", new_tokens: int = 6) -> dict:
    """Kernel launches per decode step inside each attention module (projections, norms, RoPE, the cache's update and
    the attention itself), by layer kind, on a tiny random model of ``model_name``'s architecture (``gemma-3-12b``,
    ``gpt-oss-20b``: benchmarks/hybrid_decode.py's quick shapes; ``llama``: the prefix-reuse benchmark's tiny Llama),
    RocketKV defaults with small budgets, eager decode (``disable_compile=True``), batch 1. A decode step is a forward
    of one token; each request's first one (which also lays out its decode state) is left out. Returns ``{"per_layer_kind": {kind: launches per layer per step}, "per_op": {kind: {op: ...}}}``."""
    from hf_rocketkv import RocketKVCache, RocketKVConfig

    torch.set_grad_enabled(False)
    if model_name == "llama":
        from benchmarks.bench_prefix_reuse import setup

        _, _, model = setup(torch.device("cpu"), quick=True)
        kinds = ["full_attention"] * model.config.num_hidden_layers
    else:
        from benchmarks.hybrid_decode import build_model

        model, _ = build_model(model_name, True, None, torch.float32, torch.device("cpu"))
        hf_rocketkv.enable(model)
        kinds = list(model.config.layer_types)
    config = RocketKVConfig(prompt_budget=32, window_size=8, kernel_size=7, topk=4, backend=backend)
    ids = torch.randint(3, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    counter = LaunchCounter()
    per_kind_steps: collections.Counter = collections.Counter()
    kind_ops: dict = collections.defaultdict(collections.Counter)
    state = {"kind": None}

    def watch(index: int, attention: torch.nn.Module) -> list:
        def enter(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if hidden is not None and hidden.shape[1] == 1:  # a decode step
                decodes[index] += 1
                if decodes[index] == 1:  # the first one lays out the request's decode state (once per request)
                    return
                state["kind"] = kinds[index]
                per_kind_steps[kinds[index]] += 1
                counter.ops.clear()

        def leave(module, args, kwargs, output):
            if state["kind"] is not None:
                for (_, op), n in counter.ops.items():
                    kind_ops[state["kind"]][op] += n
                state["kind"] = None
        return [attention.register_forward_pre_hook(enter, with_kwargs=True),
                attention.register_forward_hook(leave, with_kwargs=True)]

    hooks = []
    def generate(tokens: int) -> None:
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=RocketKVCache(config),
                       max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                       disable_compile=True)

    for hook in hooks:  # warm-up (lazy imports, first-call work) uncounted
        hook.remove()
    generate(2)
    decodes = collections.Counter()
    hooks = [hook for index, layer in enumerate(model.model.layers) for hook in watch(index, layer.self_attn)]
    restore = _hook_triton(counter)
    try:
        with counter:
            generate(new_tokens)
    finally:
        if restore is not None:
            restore()
        for hook in hooks:
            hook.remove()
    per_layer = {kind: sum(kind_ops[kind].values()) / steps for kind, steps in per_kind_steps.items()}
    per_op = {kind: {op: n / per_kind_steps[kind] for op, n in ops.most_common()} for kind, ops in kind_ops.items()}
    return {"model": model_name, "backend": backend, "decode_steps": new_tokens - 2, "layer_kinds": kinds,
            "per_layer_kind": per_layer, "per_op": per_op}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--triton", action="store_true", help="backend='triton' (needs TRITON_INTERPRET=1 on CPU)")
    parser.add_argument("--prefix-hit", action="store_true")
    parser.add_argument("--decode-attention", metavar="MODEL", choices=["llama", "gemma-3-12b", "gpt-oss-20b"],
                        help="count one decode step's launches per attention module by layer kind instead")
    args = parser.parse_args()
    if args.decode_attention:
        report = count_decode_attention(args.decode_attention, "triton" if args.triton else "torch")
        report.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device="cpu",
                      command="TRITON_INTERPRET=1 " * args.triton + "python -m benchmarks.probes.launch_counts "
                      + "--triton " * args.triton + f"--decode-attention {args.decode_attention}",
                      commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True).stdout.strip() or None)
        print(f"{args.decode_attention} (backend {report['backend']}), launches per decode step per attention module:")
        for kind, n in report["per_layer_kind"].items():
            print(f"  {n:6.1f}  {kind}: " + ", ".join(f"{op} {k:g}" for op, k in report["per_op"][kind].items()))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"decode_attention_launches_{args.decode_attention}.json").write_text(json.dumps(report, indent=1))
        return
    report = count_prefill(args.prompt_len, args.layers, "triton" if args.triton else "torch", args.prefix_hit)
    total = sum(report["per_function"].values())
    print(f"{total} launches over {args.layers} layers ({args.prompt_len} tokens, backend {report['backend']}):")
    for where, n in report["per_function"].items():
        print(f"  {n:5d}  {n / args.layers:7.1f}/layer  {where}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_counts.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
