"""Will a benchmark run fit in memory? A rough estimate from the model's shapes, made before anything is allocated.

The benchmarks build a Llama-3.1-8B-shaped model with random weights (``--quick``: a tiny one). On a machine without
the memory for it, building it or filling its cache would end with the kernel killing the process, printing nothing.
So both benchmarks compare ``weights + KV cache + prefill activations`` (from the shapes, the dtype, the batch and
the context) with the memory this machine has free before they start, and refuse with the estimate and what to pass
instead (:class:`WontFit`). Standard library only: ``hf-rocketkv bench`` runs the check before torch is imported
when the benchmark will run on the CPU.

The estimate is deliberately generous on the cache (it counts the dense prefill of one layer twice for RocketKV) and
leaves out what torch itself needs (a few hundred MiB); it decides only whether to start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LLAMA_31_8B = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
    vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
)
TINY = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
    vocab_size=1024, max_position_embeddings=4096,
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 2**30


class WontFit(ValueError):
    """The run cannot fit in this machine's memory: the message gives the estimate, what is free and what to pass."""


@dataclass(frozen=True)
class Shapes:
    """The shapes the estimate reads (a Llama: ``hidden_size``, ``intermediate_size``, heads, layers, vocabulary)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool = False

    @classmethod
    def of(cls, config: dict | object, layers: int | None = None) -> Shapes:
        """From a shape dict (``LLAMA_31_8B``) or a transformers config; ``layers`` overrides ``num_hidden_layers``."""
        get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
        heads = get("num_attention_heads")
        return cls(hidden=get("hidden_size"), intermediate=get("intermediate_size"), heads=heads,
                   kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads,
                   layers=layers if layers is not None else get("num_hidden_layers"), vocab=get("vocab_size"),
                   tied=bool(get("tie_word_embeddings", False)))

    def parameters(self) -> int:
        """Weights of the Llama layout: embeddings (and an untied head), attention, gated MLP and norms."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden


def state_bytes(shapes: Shapes, elem: int, cache: str, batch: int, context: int, new_tokens: int,
                prompt_budget: int, prefill_batch_size: int | None = None) -> int:
    """KV cache + prefill activations of one generate() call (bytes), the weights left out. RocketKV rows
    (``cache`` starting with ``rocketkv``) keep ``prompt_budget`` prompt tokens per KV head (twice, for the KT cache
    and positions) and hold one layer's dense K/V plus its compacted copy during prefill; dense rows keep every
    token. The activations are those of ``prefill_batch_size`` rows; of one row when it is None (generate() then
    prefills in the row groups the free memory allows, down to one row: the least the call needs)."""
    kv_token_layer = 2 * shapes.kv_heads * shapes.head_dim * elem
    if cache.startswith("rocketkv"):
        kept = batch * (min(context, prompt_budget) + new_tokens)
        kv = shapes.layers * kept * kv_token_layer * 2
        kv += 2 * batch * context * kv_token_layer
        rows = 1 if prefill_batch_size is None else min(batch, prefill_batch_size)
    else:
        kv = shapes.layers * batch * (context + new_tokens) * kv_token_layer
        rows = batch
    activations = rows * context * (8 * shapes.hidden + 4 * shapes.intermediate) * elem
    return int(kv + activations)


def host_available_bytes() -> tuple[int | None, str]:
    """(bytes of host memory a new allocation can take, where that number comes from): MemAvailable of
    /proc/meminfo, lowered to what the process's cgroup still allows; (None, why) where neither can be read."""
    available, source = None, "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    if available is None and hasattr(os, "sysconf"):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            source = "free physical pages"
        except (ValueError, OSError):
            pass
    limit = cgroup_room()
    if limit is not None and (available is None or limit < available):
        available, source = limit, "the cgroup's memory.max less memory.current"
    return available, source


def cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the process's cgroup (v2) may still allocate, or None when it sets no limit or cannot be read."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Point:
    """One generate() call of a benchmark: the cache row, batch, prompt tokens and new tokens."""

    cache: str
    batch: int
    context: int
    new_tokens: int

    def describe(self) -> str:
        return f"{self.cache}, batch {self.batch} x {self.context} prompt tokens + {self.new_tokens} new"


def check_fits(*, shapes: Shapes, dtype: str, points: list[Point], prompt_budget: int,
               prefill_batch_size: int | None, available: int | None, where: str, fraction: float,
               largest: bool, model_name: str, instead: str) -> int | None:
    """Raise WontFit when the run cannot start in ``fraction`` of ``available`` bytes: with ``largest`` (a run that
    makes every call, the workload) its largest point must fit; otherwise (a grid that skips the points that do not
    fit) its smallest. Returns the estimate of that point (bytes), None where ``available`` is unknown (nothing is
    refused on a guess)."""
    if available is None or not points:
        return None
    elem = DTYPE_BYTES[dtype]
    weights = shapes.parameters() * elem

    def need(point: Point) -> int:
        return state_bytes(shapes, elem, point.cache, point.batch, point.context, point.new_tokens, prompt_budget,
                           prefill_batch_size)

    point = (max if largest else min)(points, key=need)
    total = weights + need(point)
    if total <= fraction * available:
        return total
    which = "the largest call" if largest else "the smallest point"
    raise WontFit(
        f"{which} ({point.describe()}) of a {model_name} model ({shapes.layers} layers, {dtype}) needs ~{total / GiB:.1f}"
        f" GiB (weights {weights / GiB:.1f} GiB + KV cache and activations {need(point) / GiB:.1f} GiB), more than "
        f"{fraction:g} of the {available / GiB:.1f} GiB free on {where}\n{instead}"
    )


def bench_dtype(args, device_type: str) -> str:
    """The dtype a benchmark builds its model in: ``--dtype`` (decode benchmark), else float32 on the CPU and
    bfloat16 elsewhere."""
    return getattr(args, "dtype", None) or ("float32" if device_type == "cpu" else "bfloat16")


def bench_points(args, workload: bool) -> list[Point]:
    """Every generate() call the benchmark makes (rows x grid points, or rows x planned calls)."""
    from .options import decode_grid, plan_calls

    if workload:
        caches = [c for c in args.caches if not (args.quick and c == "static-compile")]
        return [Point(c, batch, context, new) for c in caches for batch, context, new in plan_calls(args)]
    grid = decode_grid(args)
    return [Point(c, batch, context, grid["new_tokens"])
            for c in grid["caches"] for batch in grid["batch"] for context in grid["context"]]


def check_bench(args, *, workload: bool, device_type: str, available: int | None, where: str,
                prompt_budget: int, prefill_batch_size: int | None, fraction: float | None = None) -> int | None:
    """The benchmark's run checked against ``available`` bytes on ``device_type`` (:func:`check_fits`): the
    workload's largest call must fit (it makes every call), the decode grid's smallest point (it skips the points
    that do not fit, each with its estimate). The message says what to pass instead."""
    shapes = Shapes.of(TINY if args.quick else LLAMA_31_8B, args.layers)
    if workload:
        smaller = "a lower --max-context or smaller --batches"
    else:
        smaller = "a shorter --context or a smaller --batch"
    gpu = "" if device_type != "cpu" else "; or run it on a CUDA GPU"
    quick = "" if args.quick else "pass --quick (a tiny model: seconds on a CPU), or "
    instead = f"{quick}fewer --layers (32 by default), {smaller}{gpu}"
    return check_fits(shapes=shapes, dtype=bench_dtype(args, device_type), points=bench_points(args, workload),
                      prompt_budget=prompt_budget, prefill_batch_size=prefill_batch_size, available=available,
                      where=where, fraction=fraction if fraction is not None else getattr(args, "memory_fraction", 0.92),
                      largest=workload, model_name="tiny Llama" if args.quick else "Llama-3.1-8B-shaped",
                      instead=instead)
