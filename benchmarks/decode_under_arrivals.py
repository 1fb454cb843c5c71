"""Per-user decode rate of running requests while long prompts arrive, with and without chunked prefill (the
batching engine's ``BatchingConfig.prefill_chunk_tokens`` / ``prefill_token_budget``).

    python -m benchmarks.decode_under_arrivals [--out DIR]          # Llama-3.1-8B shapes, random bf16 weights, GPU
    python -m benchmarks.decode_under_arrivals --quick              # tiny model on the CPU: the script's logic

For each setting (``--settings``: ``one`` = every prompt in one forward, as the engine did before chunked prefill;
``C:B`` = chunks of C tokens, B prompt tokens per decode step; ``C:B:packed`` = the same with each chunk in the decode
step's forward, ``BatchingConfig.packed_steps``) one engine is built and warmed up (every decode bucket
captured for the running requests' max_tokens), then:

  alone      --running requests (--running-prompt tokens each, greedy, EOS ignored) decode; once every one has its
             first tokens, their tokens are timed for --alone-s seconds: per-user decode rate (median over the running
             requests of the tokens each produced in the window / the window's length)
  arrivals   --arrivals prompts of --long-prompt tokens (--long-new-tokens new tokens) are submitted at once while
             they go on decoding; the window runs until the last long prompt has its first token: the running
             requests' per-user decode rate in it, their longest gap between two tokens (the stall), the long
             prompts' time to first token, and the engine's decode steps and prefill chunks in it

``rate_ratio`` = arrivals rate / alone rate of the same engine (the goal: >= 0.8, i.e. within 20%). Then the running
requests are cancelled, every page is checked back in the pool, and the next setting starts.

The pool holds the running requests' views and every long prompt's prefill peak (+10%). Nothing is downloaded: the
model is built from its config with random weights (``hf_rocketkv.bench.decode.build_model``), so tokens are
meaningless but shapes, memory and timings are real; model build and warm-ups are outside every window. Expected
runtime on one H100 with the defaults (8 x 1k running, 2 x 32k arriving, 5 settings): ~3-5 minutes (model build
~30 s, each setting ~20-45 s, the smallest budget longest); peak memory ~50 GiB. ``--quick``: TINY model, 4 x 64
running, 2 x 1536 arriving, chunks of 128 (< 60 s on a CPU). Writes ``decode_under_arrivals.json`` under --out
(default $OUT, else ./out) with the device, date, commit and command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

import hf_rocketkv
from benchmarks.token_sink import TokenRecorder
from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
from hf_rocketkv.cache import request_pages
from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.memory import KVBlockPool
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from hf_rocketkv.serving.engines.interface import EngineRequest
from hf_rocketkv.serving.sampling import SamplingParams

GIB = 1 << 30
ONE_FORWARD = "one"  # a setting: every prompt in one forward (no chunking)
DEFAULT_SETTINGS = f"{ONE_FORWARD},2048:2048,2048:256,2048:64,2048:32"
QUICK_SETTINGS = f"{ONE_FORWARD},128:128,128:32,128:128:packed"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder of decode_under_arrivals.json")
    parser.add_argument("--quick", action="store_true", help="tiny model, tiny workload (CPU without a GPU)")
    parser.add_argument("--settings", default=None,
                        help="comma-separated: 'one' (whole prompt per forward) or CHUNK:BUDGET[:packed] "
                             f"(BatchingConfig.prefill_chunk_tokens:prefill_token_budget); default {DEFAULT_SETTINGS} "
                             f"({QUICK_SETTINGS} with --quick)")
    parser.add_argument("--running", type=int, default=8, help="requests decoding throughout")
    parser.add_argument("--running-prompt", type=int, default=1024)
    parser.add_argument("--arrivals", type=int, default=2, help="long prompts submitted at once")
    parser.add_argument("--long-prompt", type=int, default=32768)
    parser.add_argument("--long-new-tokens", type=int, default=8)
    parser.add_argument("--alone-s", type=float, default=4.0, help="seconds of the alone window")
    parser.add_argument("--running-max-tokens", type=int, default=4096,
                        help="max_tokens of the running requests (they are cancelled at the end of each setting)")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than Llama-3.1-8B's 32")
    parser.add_argument("--page-size", type=int, default=16, help="pool page size (tokens)")
    parser.add_argument("--decode", default="graphs", choices=["graphs", "eager"],
                        help="graphs: one CUDA graph per decode bucket (the engine's default on CUDA); eager")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def apply_quick(args) -> None:
    args.settings = args.settings or QUICK_SETTINGS
    args.running, args.running_prompt = min(args.running, 4), min(args.running_prompt, 64)
    args.arrivals, args.long_prompt, args.long_new_tokens = min(args.arrivals, 2), min(args.long_prompt, 1536), 2
    args.alone_s, args.running_max_tokens = min(args.alone_s, 1.0), min(args.running_max_tokens, 2000)


def parse_settings(text: str) -> list[tuple[str, int | None, int | None, bool]]:
    """``[(label, chunk tokens or None, budget or None, packed)]``; None, None: one forward per prompt; packed
    (``CHUNK:BUDGET:packed``): ``BatchingConfig.packed_steps``, each chunk in the decode step's forward."""
    settings = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if item == ONE_FORWARD:
            settings.append((ONE_FORWARD, None, None, False))
            continue
        chunk, _, rest = item.partition(":")
        budget, _, packed = rest.partition(":")
        try:
            if packed not in ("", "packed"):
                raise ValueError(packed)
            label = f"chunk{int(chunk)}_budget{int(budget)}" + ("_packed" if packed else "")
            settings.append((label, int(chunk), int(budget), bool(packed)))
        except ValueError:
            raise SystemExit(f"--settings: {item!r} is neither '{ONE_FORWARD}' nor CHUNK:BUDGET[:packed]") from None
    if not settings:
        raise SystemExit("--settings: no setting given")
    return settings


def provenance(argv: list[str] | None, device: torch.device) -> dict:
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], check=False,
                            capture_output=True, text=True).stdout.strip() or os.environ.get("GIT_COMMIT", "unknown")
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
        "command": " ".join(["python -m benchmarks.decode_under_arrivals"] + list(sys.argv[1:] if argv is None
                                                                                  else argv)),
        "torch": torch.__version__, "python": platform.python_version(),
    }


# ------------------------------------------------------------------------------------------------ the pool
def make_pool(model, args, config: RocketKVConfig, device: torch.device) -> KVBlockPool:
    """The running requests' compressed views and every long prompt's prefill peak, +10%."""
    probe = KVBlockPool(model, max_gpu_bytes=1 << 30, page_size=args.page_size, kt_page_size=config.page_size,
                        kt_dtype=config.kt_cache_dtype, device=device)  # lazily allocated: its page size only
    running = request_pages(config, probe, args.running_prompt, args.running_max_tokens)
    long = request_pages(config, probe, args.long_prompt, args.long_new_tokens)
    pages = int((args.running * running.peak_pages + args.arrivals * long.peak_pages) * 1.1) + 8
    return KVBlockPool(model, max_gpu_bytes=pages * probe.bytes_per_page, page_size=args.page_size,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=device)


# ------------------------------------------------------------------------------------------------ timing
def rates(times: TokenRecorder, rids: list[str], start: float, end: float) -> dict:
    """Per-user decode rate of ``rids`` inside [start, end]: tokens each produced in the window / its length (a stall
    counts), the median and the lowest over the requests, and the longest gap between two tokens of one request
    among the gaps that overlap the window (``TokenRecorder.gaps_overlapping``: one that spans its start counts)."""
    per_user, gaps = [], []
    for rid in rids:
        per_user.append(len(times.window(rid, start, end)) / (end - start))
        gaps.extend(times.gaps_overlapping(rid, start, end))
    return {"per_user_tokens_per_s_p50": statistics.median(per_user) if per_user else None,
            "per_user_tokens_per_s_min": min(per_user) if per_user else None,
            "max_gap_s": max(gaps) if gaps else None, "window_s": end - start}


def greedy(rid: str, prompt: list[int], new_tokens: int) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams.greedy(new_tokens, ignore_eos=True), frozenset())


# ------------------------------------------------------------------------------------------------ one setting
def run_setting(model, pool, config, args, label: str, chunk: int | None, budget: int | None, vocab: int,
                packed: bool = False) -> dict:
    longest = max(args.long_prompt, args.running_prompt)
    batching = BatchingConfig(max_running=args.running + args.arrivals, max_queue=64,
                              buckets=_buckets(args.running + args.arrivals),
                              prefill_chunk_tokens=chunk if chunk is not None else longest,
                              prefill_token_budget=budget if budget is not None else longest,
                              packed_steps=packed)
    engine = BatchingEngine(model, config, pool, batching, decode_graphs=None if args.decode == "graphs" else False)
    result: dict = {"setting": label, "prefill_chunk_tokens": batching.prefill_chunk_tokens,
                    "prefill_token_budget": batching.prefill_token_budget, "packed_steps": packed}
    started = time.perf_counter()
    result["warm_up"] = engine.warm_up(max_new_tokens=args.running_max_tokens)
    result["warm_up_s"] = time.perf_counter() - started
    times = TokenRecorder(wake_on_tokens=True)  # the waits below count tokens
    engine.start(times)
    rng = random.Random(f"{args.seed}-{label}")  # prompts of their own: no prefix hit on an earlier setting's pages
    running = [f"run{i}" for i in range(args.running)]
    long = [f"long{i}" for i in range(args.arrivals)]
    try:
        for rid in running:
            engine.submit(greedy(rid, [rng.randrange(3, vocab) for _ in range(args.running_prompt)],
                                 args.running_max_tokens))
        assert times.wait_for(lambda t: all(len(t.token_times.get(r, [])) >= 3 for r in running), 600), \
            "the running requests did not start decoding"
        before = engine.stats()
        start = time.perf_counter()
        time.sleep(args.alone_s)
        end = time.perf_counter()
        middle = engine.stats()
        result["alone"] = rates(times, running, start, end)
        result["alone"]["decode_steps"] = middle.decode_steps - before.decode_steps
        prompts = [[rng.randrange(3, vocab) for _ in range(args.long_prompt)] for _ in long]
        start = time.perf_counter()
        for rid, prompt in zip(long, prompts):
            engine.submit(greedy(rid, prompt, args.long_new_tokens))
        assert times.wait_for(lambda t: all(t.token_times.get(r) or r in t.finals for r in long), 1800), \
            "the long prompts got no first token"
        end = time.perf_counter()
        after = engine.stats()
        arrivals = rates(times, running, start, end)
        arrivals["long_ttft_s"] = [times.token_times[r][0] - start if times.token_times.get(r) else None for r in long]
        arrivals["decode_steps"] = after.decode_steps - middle.decode_steps
        arrivals["prefill_chunks"] = after.prefill_chunks - middle.prefill_chunks
        result["arrivals"] = arrivals
        alone_rate, arrivals_rate = result["alone"]["per_user_tokens_per_s_p50"], arrivals["per_user_tokens_per_s_p50"]
        result["rate_ratio"] = arrivals_rate / alone_rate if alone_rate and arrivals_rate else None
        result["errors"] = [e.error for e in times.finals.values() if getattr(e, "error", None)][:5]
    finally:
        for rid in running + long:
            engine.cancel(rid)
        times.wait(len(running) + len(long), 300)
        engine.stop(drain=False, timeout=300)
    result["pages_back"] = pool.free_pages() == pool.total_pages()
    return result


def _buckets(rows: int) -> tuple[int, ...]:
    buckets, size = [], 1
    while size < rows:
        buckets.append(size)
        size *= 2
    return tuple(buckets + [rows])


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        apply_quick(args)
    settings = parse_settings(args.settings or DEFAULT_SETTINGS)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode_under_arrivals.json"
    report: dict = {**provenance(argv, device), "args": vars(args), "settings": {}}

    def save():
        path.write_text(json.dumps(report, indent=2, default=str))

    try:
        started = time.perf_counter()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_model(TINY if args.quick else LLAMA_31_8B, args.layers, dtype, device, args.seed)
        hf_rocketkv.enable(model)
        config = (RocketKVConfig(prompt_budget=48, window_size=8, kernel_size=7, topk=4, page_size=4) if args.quick
                  else RocketKVConfig()).replace(backend="triton" if device.type == "cuda" else "torch")
        pool = make_pool(model, args, config, device)
        report["setup"] = {"model_build_s": time.perf_counter() - started, "pool_pages": pool.total_pages(),
                           "pool_gib": pool.total_pages() * pool.bytes_per_page / GIB, "config": config.to_dict()}
    except Exception:  # noqa: BLE001 - nothing else can run; say why
        report["setup_error"] = traceback.format_exc()
        save()
        print(report["setup_error"])
        return 1
    save()
    for label, chunk, budget, packed in settings:
        try:
            report["settings"][label] = run_setting(model, pool, config, args, label, chunk, budget,
                                                    model.config.vocab_size, packed)
        except Exception:  # noqa: BLE001 - one setting's failure never loses the others
            report["settings"][label] = {"error": traceback.format_exc()}
        save()
        shown = report["settings"][label]
        print(label, json.dumps({k: shown.get(k) for k in ("rate_ratio", "alone", "arrivals", "error")},
                                default=str), flush=True)
    print(f"wrote {path}")
    return 0 if all("error" not in s for s in report["settings"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
