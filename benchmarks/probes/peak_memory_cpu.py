"""Peak live tensor bytes of bench_prefix_reuse.py step 8 (batch x shared prefix, pool, prefill_batch_size=1), on CPU.

    python -m benchmarks.probes.peak_memory_cpu                       # 4 layers, batch 8 x (2048 + 64), ~15 s
    python -m benchmarks.probes.peak_memory_cpu --batch 16 --vocab 32000 --top 25 --json out/peak.json
    python -m benchmarks.probes.peak_memory_cpu --prefill-batch-size 0       # the whole batch in one forward

Same structure as bench_prefix_reuse's batch x shared prefix step (a Llama with GQA, a preallocated ``KVBlockPool`` of 16-token pages sized by
its own accounting, rows that share a prefix and each add a suffix of their own, ``model.generate`` with
``RocketKVCache(config.replace(prefill_batch_size=1), pool=pool)``), at small dims in float32 on CPU.

How it measures: a ``TorchDispatchMode`` sees the output of every aten op run inside generate(); a storage it has not
seen is counted as allocated (its ``nbytes``) until its Python storage object is finalised (storages keep one Python
object per C++ storage, so ``weakref.finalize`` fires when the last tensor on it goes). Storages that existed before
generate() (weights, the pool, the inputs) are the static part and are reported apart. At each new peak it notes
the live storages; the report lists the largest at the peak with the op, shape and dtype that created them and the
innermost hf_rocketkv / transformers frames of the creating stack. Buffers an op allocates and frees inside itself
(e.g. the scratch of a fused kernel) are not seen: the numbers are live tensors between ops.

Reports (stdout, and ``--json``): static bytes (weights, pool), the transient peak above them, the phase it
happened in (row group i's prefill, stacking the groups, decode step i), the largest live tensors at the peak, and
the transient peak of every phase. To read it at Llama-3.1-8B shapes, scale each tensor's dims (tokens 2112 ->
33024, hidden 256 -> 4096, intermediate 1024 -> 14336) and its element size (float32 -> bfloat16).

Measured (4 layers, batch 8 x (2048 + 64), vocab 128256): weights 265 MiB, pool 18 MiB, transient peak 33.7 MiB,
in row group 0's prefill (the one cold row): the MLP's three [2112, 1024] float32 tensors (24.8 MiB) and four
[2112, 256] hidden states (8.3 MiB). The prefix-hit groups peak at 7-10 MiB; logits are [1, 1, vocab] per group.
The whole batch in one forward: 268.5 MiB (8x). At 8B shapes (33,024 tokens, bf16) that cold row is 3 x 0.95 GB +
4 x 0.27 GB = 3.65 GiB, which is what the H100's step 8 had above weights (14.96 GiB), its pool (27.32 GiB) and step
4's 24 GiB pool that the benchmark still held (70.03 GiB peak; fixed in bench_prefix_reuse.release_state).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
import weakref
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hf_rocketkv
from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.bench.decode import build_model

MIB = 2**20
OUR_FRAMES = ("hf_rocketkv", "transformers", "benchmarks")


def _frames(limit: int = 6) -> list[str]:
    """The innermost frames of hf_rocketkv / transformers code (file:line function), innermost first."""
    out = []
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if any(part in name for part in OUR_FRAMES) and "peak_memory_cpu" not in name:
            short = name.split("site-packages/")[-1].split("wt-peakmem/")[-1]
            out.append(f"{short}:{frame.lineno} {frame.name}")
            if len(out) >= limit:
                break
    return out


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created by aten ops while active; the peak and what was live at it."""

    def __init__(self, static_ptrs: set[int], stack_bytes: int = 256 * 1024):
        super().__init__()
        self.static_ptrs = static_ptrs
        self.stack_bytes = stack_bytes
        self.live: dict[int, tuple] = {}  # data_ptr -> (nbytes, op, shape, dtype, frames, phase)
        self.current = 0
        self.peak = 0
        self.peak_live: list[tuple] = []
        self.peak_phase = ""
        self.phase = "setup"
        self.phase_peaks: dict[str, int] = defaultdict(int)
        self.ops = 0

    def _free(self, ptr: int) -> None:
        entry = self.live.pop(ptr, None)
        if entry is not None:
            self.current -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        grew = False
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self.static_ptrs or ptr in self.live:
                continue
            frames = _frames() if nbytes >= self.stack_bytes else []
            self.live[ptr] = (nbytes, str(func.overloadpacket.__name__), tuple(tensor.shape), str(tensor.dtype),
                              frames, self.phase)
            weakref.finalize(storage, self._free, ptr)
            self.current += nbytes
            grew = True
        if grew:
            if self.current > self.phase_peaks[self.phase]:
                self.phase_peaks[self.phase] = self.current
            if self.current > self.peak:
                self.peak = self.current
                self.peak_phase = self.phase
                self.peak_frames = _frames(10)
                self.peak_op = str(func.overloadpacket.__name__)
                self.peak_live = [entry for entry in self.live.values() if entry[0] >= self.stack_bytes]
        return out


def live_storage_ptrs() -> set[int]:
    """data_ptrs of every tensor storage reachable from Python now (the static part: weights, pool, inputs)."""
    import gc
    import warnings

    ptrs = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated module attributes gc.get_objects() returns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    ptrs.add(obj.untyped_storage().data_ptr())
            except Exception:  # noqa: BLE001 - tensors without storage (meta, wrapper subclasses)
                pass
    return ptrs


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def pool_tensors(pool: KVBlockPool) -> list[torch.Tensor]:
    """Every page tensor of the pool's layers (K, V, KT, scales)."""
    return [t for i in range(pool.geometry.num_layers) for t in pool.layer(i).tensors().values()]


@contextlib.contextmanager
def phase_markers(mode: LiveBytes, model):
    """Name the phase ``mode`` is in: row group i's prefill, between groups, stacking the groups, the whole batch's
    prefill (no row groups), decode step i. Undone on exit."""
    from hf_rocketkv.cache.cache import RocketKVCache as CacheClass
    from hf_rocketkv.integration import generate as generate_module

    state = {"in_groups": False, "group": 0, "forwards": 0}
    original_groups = generate_module.prefill_in_row_groups
    original_adopt = CacheClass.adopt_row_groups

    def before_forward(module, args, kwargs):
        ids = kwargs.get("input_ids")
        shape = tuple(ids.shape) if ids is not None else "?"
        if state["in_groups"]:
            mode.phase = f"prefill group {state['group']} ({shape[1]} tokens)"
            state["group"] += 1
        elif state["forwards"] == 0:
            mode.phase = f"prefill ({shape[0]} rows x {shape[1]} tokens)"
            state["forwards"] += 1
        else:
            mode.phase = f"decode step {state['forwards'] - 1}"
            state["forwards"] += 1

    def after_forward(module, args, kwargs, output):
        if state["in_groups"]:
            mode.phase = "row groups (between groups)"

    def groups(prefill, cache, rows):
        state["in_groups"] = True
        mode.phase = "row groups (before the first)"
        try:
            return original_groups(prefill, cache, rows)
        finally:
            state["in_groups"] = False
            state["forwards"] = 1  # the next forward is decode step 0

    def adopt(self, parts):
        mode.phase = "stack row groups"
        return original_adopt(self, parts)

    hooks = [model.register_forward_pre_hook(before_forward, with_kwargs=True),
             model.register_forward_hook(after_forward, with_kwargs=True)]
    generate_module.prefill_in_row_groups = groups
    CacheClass.adopt_row_groups = adopt
    try:
        yield
    finally:
        generate_module.prefill_in_row_groups = original_groups
        CacheClass.adopt_row_groups = original_adopt
        for hook in hooks:
            hook.remove()


def run(args) -> dict:
    torch.manual_seed(0)
    dims = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate,
                vocab_size=args.vocab, max_position_embeddings=max(4096, 2 * (args.prefix + args.suffix)))
    dtype = getattr(torch, args.dtype)
    model = build_model(dims, None, dtype, torch.device("cpu"), seed=0)
    hf_rocketkv.enable(model)
    config = RocketKVConfig(backend="torch", prompt_budget=args.prompt_budget, window_size=args.window,
                            kernel_size=7, topk=args.topk, page_size=4, kt_cache_dtype="float32")

    def new_pool(nbytes: int) -> KVBlockPool:
        return KVBlockPool(model.config, max_gpu_bytes=nbytes, page_size=args.page_size, dtype=dtype,
                           kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device="cpu")

    sizing = new_pool(1 * MIB)
    per_row = sizing.pages_needed(args.prefix + args.suffix, args.new_tokens - 1, config)
    pages = args.batch * per_row.steady_state + per_row.prompt_pages + args.prefix // args.page_size + 64
    if not args.prefill_batch_size:  # one forward: every row's prompt pages at once (no hit inside a forward)
        pages = sizing.pages_needed([args.prefix + args.suffix] * args.batch, args.new_tokens - 1, config).prefill_peak
    pool = new_pool(pages * sizing.bytes_per_page)
    pool.bind_all("cpu")
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, args.vocab, (1, args.prefix), generator=g)
    ids = torch.cat([prefix.expand(args.batch, -1), torch.randint(3, args.vocab, (args.batch, args.suffix), generator=g)],
                    dim=1)
    mask = torch.ones_like(ids)
    cache = RocketKVCache(config.replace(prefill_batch_size=args.prefill_batch_size or None), pool=pool)

    weights = tensor_bytes(model.parameters())
    pool_bytes = tensor_bytes(pool_tensors(pool))
    static = live_storage_ptrs()
    mode = LiveBytes(static, stack_bytes=args.stack_kib * 1024)
    with torch.no_grad(), phase_markers(mode, model), mode:
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             disable_compile=True)
    assert out.shape == (args.batch, ids.shape[1] + args.new_tokens)
    stats = cache.stats.as_dict()
    cache.close()
    top = sorted(mode.peak_live, key=lambda e: -e[0])[: args.top]
    return dict(
        dims=dims, dtype=args.dtype, batch=args.batch, prefix=args.prefix, suffix=args.suffix,
        weights_mib=weights / MIB, pool_mib=pool_bytes / MIB, pool_pages=pool.num_pages,
        transient_peak_mib=mode.peak / MIB, peak_phase=mode.peak_phase, peak_op=mode.peak_op,
        peak_frames=mode.peak_frames, aten_ops=mode.ops, cache_stats=stats,
        phase_peaks_mib={k: v / MIB for k, v in mode.phase_peaks.items()},
        live_at_peak=[dict(mib=e[0] / MIB, op=e[1], shape=list(e[2]), dtype=e[3], created_in=e[5], frames=e[4])
                      for e in top],
        live_at_peak_total_listed_mib=sum(e[0] for e in mode.peak_live) / MIB,
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--prompt-budget", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-batch-size", type=int, default=1, help="rows per prefill forward (0: the whole batch)")
    p.add_argument("--stack-kib", type=int, default=256, help="record stacks of storages at least this big")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    report = run(args)
    print(f"weights {report['weights_mib']:.1f} MiB, pool {report['pool_mib']:.1f} MiB ({report['pool_pages']} pages)")
    print(f"transient peak {report['transient_peak_mib']:.1f} MiB in {report['peak_phase']!r} at aten.{report['peak_op']}")
    for frame in report["peak_frames"]:
        print("   ", frame)
    print("per phase (transient peak, MiB):")
    for phase, mib in report["phase_peaks_mib"].items():
        print(f"   {mib:10.1f}  {phase}")
    print(f"largest live tensors at the peak ({report['live_at_peak_total_listed_mib']:.1f} MiB listed):")
    for e in report["live_at_peak"]:
        print(f"   {e['mib']:9.2f} MiB  {e['op']:<24} {str(e['shape']):<28} {e['dtype']:<14} [{e['created_in']}]")
        for frame in e["frames"][:3]:
            print("        ", frame)
    print("cache stats:", report["cache_stats"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
