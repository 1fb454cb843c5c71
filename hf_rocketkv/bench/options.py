"""The options of ``hf-rocketkv bench`` (the decode benchmark) and ``hf-rocketkv bench --workload``, without torch.

Kept apart from ``decode.py`` and ``workload.py`` (which import torch and transformers at once) so that the command
line reads, checks and explains a benchmark's arguments in a fraction of a second: ``--help`` and a mistake never
wait for torch. Both benchmarks build their parsers from here.
"""

from __future__ import annotations

import argparse
import random

from ..argparse_helpers import ShortErrorParser, int_at_least, number_in

CACHES = ("dynamic", "static-compile", "rocketkv", "rocketkv-graphs", "rocketkv-compile", "rocketkv-graphs-pool",
          "rocketkv-graphs-pool-fp8", "rocketkv-rope-off", "rocketkv-graphs-rope-off", "rocketkv-norm-off",
          "rocketkv-graphs-norm-off", "rocketkv-adakv", "rocketkv-graphs-adakv")
DEFAULT_CACHES = ("dynamic", "static-compile", "rocketkv")
WORKLOAD_CACHES = ("dynamic", "static-compile", "rocketkv-graphs", "rocketkv-compile")

DECODE_DESCRIPTION = ("Decode benchmark: Llama-3.1-8B-shaped model with RANDOM weights, DynamicCache vs "
                      "StaticCache+compile vs RocketKV.")
WORKLOAD_DESCRIPTION = ("``hf-rocketkv bench --workload``: what a user lives with over a workload of varied "
                        "requests, not one warm call.")


def decode_parser() -> argparse.ArgumentParser:
    p = ShortErrorParser(prog="hf-rocketkv bench", description=DECODE_DESCRIPTION)
    p.add_argument("--config", default=None, help="RocketKV YAML (sparse_attention_config); default RocketKVConfig()")
    p.add_argument("--batch", nargs="+", type=int_at_least(1), default=None, help="batch sizes (default 1 4 16)")
    p.add_argument("--context", nargs="+", type=int_at_least(1), default=None,
                   help="prompt tokens (default 8192 32768 100000)")
    p.add_argument("--new-tokens", type=int_at_least(1), default=None, help="tokens generated per run (default 32)")
    p.add_argument("--caches", nargs="+", choices=CACHES, default=None,
                   help=f"rows (default {' '.join(DEFAULT_CACHES)})")
    p.add_argument("--layers", type=int_at_least(1), default=None, help="override num_hidden_layers (fewer = faster)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default=None, help="default cuda if available, else cpu")
    p.add_argument("--out", default="out/bench_decode", help="folder for decode_bench.json / .png")
    p.add_argument("--quick", action="store_true", help="tiny model on CPU, tiny grid: a smoke run of this script")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--memory-fraction", type=number_in(0.0, 1.0, low_open=True), default=0.92,
                   help="skip points estimated above this share of the GPU's memory, in (0, 1] (default 0.92)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cudnn-for-static", action="store_true",
                   help="let the static-compile rows use cuDNN attention (it plans once, at CUDA-graph capture)")
    p.add_argument("--prefill-batch-size", type=int_at_least(1), default=None,
                   help="RocketKVConfig.prefill_batch_size for the rocketkv rows: prefill that many rows per forward "
                        "(default: the whole batch, or row groups chosen from the free memory when it would not fit)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of every generate call")
    p.add_argument(
        "--allow-cudnn-sdpa", action="store_true",
        help="keep PyTorch's cuDNN attention backend (off by default: torch 2.11 re-plans it for every new KV length, "
        "~37 ms of CPU per call in eager DynamicCache decode on an H100, which would make the baseline meaningless)",
    )
    return p


def workload_parser() -> argparse.ArgumentParser:
    p = ShortErrorParser(prog="hf-rocketkv bench --workload", description=WORKLOAD_DESCRIPTION)
    p.add_argument("--workload", action="store_true", help="(selects this benchmark)")
    p.add_argument("--config", default=None, help="RocketKV YAML (default RocketKVConfig())")
    p.add_argument("--calls", type=int_at_least(1), default=8, help="generate() calls per cache type")
    p.add_argument("--batches", type=int_at_least(1), nargs="+", default=[1, 4], help="batch sizes, used in turn")
    p.add_argument("--min-context", type=int_at_least(1), default=1024)
    p.add_argument("--max-context", type=int_at_least(1), default=16384)
    p.add_argument("--new-tokens", type=int_at_least(1), nargs="+", default=[64, 128],
                   help="max_new_tokens, used in turn")
    p.add_argument("--caches", nargs="+", choices=WORKLOAD_CACHES, default=list(WORKLOAD_CACHES))
    p.add_argument("--budget-s", type=number_in(0.0, None, low_open=True), default=240.0,
                   help="per cache type: skip its remaining calls after this many seconds (> 0)")
    p.add_argument("--layers", type=int_at_least(1), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model on CPU, short prompts")
    p.add_argument("--out", default=None, help="folder for workload.json")
    p.add_argument("--prefill-batch-size", type=int_at_least(1), default=None)
    p.add_argument("--allow-cudnn-sdpa", action="store_true",
                   help="keep PyTorch's cuDNN attention (off by default, as in the decode benchmark: torch 2.11 "
                   "re-plans it for every new KV length, ~37 ms of CPU per eager DynamicCache step)")
    return p


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser``'s arguments, with the checks between them (two lines and exit status 2 on a mistake)."""
    args = parser.parse_args(argv)
    low, high = getattr(args, "min_context", None), getattr(args, "max_context", None)
    if low is not None and high is not None and low > high:
        parser.error(f"--min-context {low} is above --max-context {high}")
    return args


def decode_grid(args: argparse.Namespace) -> dict:
    """The decode benchmark's batch sizes, contexts, new tokens and rows: the flags given, else the defaults (a
    tiny grid with ``--quick``)."""
    quick = args.quick
    return dict(
        batch=args.batch or ([1, 2] if quick else [1, 4, 16]),
        context=args.context or ([96, 192] if quick else [8192, 32768, 100_000]),
        new_tokens=args.new_tokens or (6 if quick else 32),
        caches=args.caches or list(DEFAULT_CACHES),
    )


def plan_calls(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """The workload's (batch, prompt tokens, new tokens) of every call, the same for every cache type."""
    rng = random.Random(args.seed)
    lo, hi = (48, 160) if args.quick else (args.min_context, args.max_context)
    return [
        (args.batches[i % len(args.batches)], rng.randint(lo, hi),
         args.new_tokens[(i // len(args.batches)) % len(args.new_tokens)])
        for i in range(args.calls)
    ]
