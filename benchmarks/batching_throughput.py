"""Throughput and latency of the continuous-batching engine (serving/batching/engine.py): Llama-3.1-8B shapes, random
bf16 weights, a fixed workload and Poisson arrivals.

    python -m benchmarks.batching_throughput [--out DIR] [--requests 32] [--prompt-len 8192] [--new-tokens 512]
    python -m benchmarks.batching_throughput --quick          # tiny model on the CPU: the script's logic

One engine serves every step, as a server would: before it starts, ``BatchingEngine.warm_up`` captures the decode
graph of every bucket for max_tokens up to max(--new-tokens, --mixed-new-tokens) (``startup_capture_s``), so no
workload pays for a capture or a table widening. Its counters are cumulative: each step reports its own deltas
(``graph_captures`` included: 0 after the warm-up).

Steps (each in its own try/except: one failure never loses the others' results):

  warmup     the startup capture (``startup_capture_s``, also at the report's top level), then two short requests
             through the engine (Triton JIT, allocator), timed and excluded from the rest
  fixed      --requests x --prompt-len prompt tokens x --new-tokens new tokens (greedy, EOS ignored), all submitted
             at once: total output tokens/s, TTFT p50/p99 (submit -> first token, queueing included), ms per decode
             step (median, p90; mean rows per step), prefill s per request, peak GiB (torch.cuda.max_memory_allocated)
  mixed      Poisson arrivals at each --rates (requests/s), prompt lengths log-uniform in [--mixed-min-prompt,
             --mixed-max-prompt], --mixed-new-tokens new tokens, at most --mixed-requests requests or --mixed-time-s
             seconds of arrivals per rate: tokens/s per GPU (all output tokens / wall time), per user (median of each
             request's (tokens - 1) / (last token - first token)), TTFT p50/p99, inter-token latency p50/p99 (the
             gaps between a request's successive tokens, all requests pooled), finished / errors; with
             --step-deadline-s, requests unfinished then are cancelled and counted (``unfinished_at_deadline``)

``--engine both``: every step on hf_rocketkv's engine, then the warm-up and the mixed rates on transformers' continuous
batching in the same process (the model back on sdpa, our engine and pool freed), the same arrivals and prompts per
rate (``transformers_steps``), and ``mixed_curve.png`` (tokens/s per GPU against tokens/s per user, one line per
engine; points in ``curve``). Each rate is bounded by --step-deadline-s (default 30 with both; arrivals stop at half
of it). On one H100: ``python -m benchmarks.batching_throughput --engine both --skip-fixed --out $OUT`` ~4-5 min
(model build ~30 s, our warm-up ~30 s, 3 rates x at most 30 s per engine, transformers' warm-up).

The pool is sized for the workload: every running request's view (min(prompt, prompt_budget) + new tokens) plus
the prefill peak of the longest prompt, +10% (``--pool-gib`` overrides). Nothing is downloaded; the model is built
from its config with random weights (``hf_rocketkv.bench.decode.build_model``), so tokens are meaningless but
shapes, memory and timings are real. Model load is excluded from every timing.

``--quick``: a tiny model (``TINY``), 4 requests x 96 tokens x 8 new, on the CPU without a GPU (< 60 s), to check
the script's logic. Expected runtime on one H100 with the defaults: ~4-6 minutes (model build ~30 s, fixed ~1-2
min, mixed 3 rates ~2-3 min); scale down with --requests / --prompt-len / --new-tokens / --mixed-requests / --rates.
Writes ``batching_throughput.json`` under --out (default $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import statistics
import time
import traceback
from pathlib import Path

import torch

import hf_rocketkv
from benchmarks.token_sink import TokenRecorder
from benchmarks.triton_watch import TritonWatch
from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
from hf_rocketkv.cache import request_pages
from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.memory import KVBlockPool, PoolSpec
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from hf_rocketkv.serving.engines.interface import EngineRequest
from hf_rocketkv.serving.sampling import SamplingParams

GIB = 1 << 30


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder of batching_throughput.json")
    parser.add_argument("--quick", action="store_true", help="tiny model, tiny workload (CPU without a GPU)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--min-prompt-len", type=int, default=None,
                        help="fixed workload's prompt lengths uniform in [this, --prompt-len] (default: all --prompt-len)")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--max-running", type=int, default=32, help="BatchingConfig.max_running")
    parser.add_argument("--prefills-per-step", type=int, default=1)
    parser.add_argument("--prefill-chunk-tokens", type=int, default=BatchingConfig.prefill_chunk_tokens,
                        help="BatchingConfig.prefill_chunk_tokens: the most prompt tokens in one prefill forward")
    parser.add_argument("--prefill-token-budget", type=int, default=BatchingConfig.prefill_token_budget,
                        help="BatchingConfig.prefill_token_budget: prompt tokens prefilled per decode step")
    parser.add_argument("--concurrent-prefill-tokens", type=int, default=None,
                        help="BatchingConfig.concurrent_prefill_tokens: prefill beside the decode steps (own thread "
                             "and CUDA stream) in chunks of this many tokens; default: chunks between decode steps")
    parser.add_argument("--page-size", type=int, default=16, help="pool page size (tokens)")
    parser.add_argument("--pool-gib", type=float, default=None, help="pool size (default: sized for the workload)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the pool's K/V pages: the model's dtype (auto) or e4m3 with a scale per page (fp8)")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than Llama-3.1-8B's 32")
    parser.add_argument("--rates", default="0.5,1,2", help="Poisson arrival rates (requests/s), comma separated; "
                                                            "empty: skip the mixed workload")
    parser.add_argument("--mixed-requests", type=int, default=32, help="requests at most per rate")
    parser.add_argument("--mixed-time-s", type=float, default=60.0, help="seconds of arrivals at most per rate")
    parser.add_argument("--mixed-min-prompt", type=int, default=1024)
    parser.add_argument("--mixed-max-prompt", type=int, default=32768)
    parser.add_argument("--mixed-new-tokens", type=int, default=256)
    parser.add_argument("--decode", default="graphs", choices=["graphs", "eager"],
                        help="graphs: one CUDA graph per decode bucket (the engine's default on CUDA); eager")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--freeze-gc", action="store_true",
                        help="after the fixed workload, gc.freeze() and run it again (fixed_gc_frozen): do "
                             "collections of the long-lived heap slow the engine thread?")
    parser.add_argument("--time-host", action="store_true",
                        help="then the fixed workload again with the engine's methods timed on the host "
                             "(fixed_host_times: inclusive ms per iteration of each, prefill_host_time.Timers)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="after the fixed step: one more --prompt-len request (1 new token) through the running "
                             "engine under torch.profiler; its top ops in profile_prefill/ under --out")
    parser.add_argument("--no-overlap-decode", dest="overlap_decode", action="store_false",
                        help="BatchingConfig.overlap_decode=False: read each step's tokens before the next launch")
    parser.add_argument("--engine", default="rocketkv", choices=["rocketkv", "transformers", "both"],
                        help="rocketkv: hf_rocketkv's BatchingEngine on a KVBlockPool; transformers: transformers' own "
                             "continuous batching (ContinuousBatchingManager, dense paged cache) on the same workloads; "
                             "both: every step on rocketkv, then the mixed rates on transformers' with the same "
                             "arrivals and prompts (transformers_steps), and mixed_curve.png of both")
    parser.add_argument("--step-deadline-s", type=float, default=None,
                        help="a mixed rate's wall-time limit: requests unfinished then are cancelled and counted "
                             "(default: none; 30 with --engine both, whose transformers side is slow, and arrivals "
                             "then stop at half of it)")
    parser.add_argument("--skip-fixed", action="store_true", help="no fixed workload (only warm-up and mixed)")
    parser.add_argument("--prefill-warm-tokens", type=int, default=None,
                        help="BatchingEngine.warm_up(prefill_tokens=...): prompts up to this many tokens meet no new "
                             "cuDNN attention graph (default: the engine's, two prefill chunks; 0: none)")
    parser.add_argument("--prefill-times", action="store_true",
                        help="record every prefill chunk's prompt length, tokens and host seconds (prefill_times)")
    parser.add_argument("--fixed-again", action="store_true",
                        help="the fixed workload a second time, other prompts of the same lengths' law (a warm call)")
    parser.add_argument("--compile-regions", action="store_true",
                        help="hf_rocketkv.compile_regions(model) before the engine starts (fused norms and MLPs)")
    parser.add_argument("--rope-off", action="store_true",
                        help="RocketKVConfig(fused_rope=False): transformers' RoPE in the decode steps")
    return parser


def apply_quick(args) -> None:
    args.requests, args.prompt_len, args.new_tokens = min(args.requests, 4), min(args.prompt_len, 96), \
        min(args.new_tokens, 8)
    args.max_running = min(args.max_running, 4)
    args.min_prompt_len = args.min_prompt_len and min(args.min_prompt_len, args.prompt_len)
    args.mixed_requests, args.mixed_time_s = min(args.mixed_requests, 4), min(args.mixed_time_s, 5.0)
    args.mixed_min_prompt, args.mixed_max_prompt = min(args.mixed_min_prompt, 32), min(args.mixed_max_prompt, 160)
    args.mixed_new_tokens = min(args.mixed_new_tokens, 6)
    args.rates = ",".join(args.rates.split(",")[:1]) if args.rates else ""
    args.rates = "4" if args.rates else ""


def rocket_config(quick: bool, device: torch.device) -> RocketKVConfig:
    config = RocketKVConfig(prompt_budget=48, window_size=8, kernel_size=7, topk=4, page_size=4) if quick \
        else RocketKVConfig()
    return config.replace(backend="triton" if device.type == "cuda" else "torch")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# ------------------------------------------------------------------------------------------------ the pool
def pool_pages_for(args, config: RocketKVConfig, max_prompt: int, new_tokens: int) -> int:
    """Every running request's steady pages (its longest prompt) + one prefill peak, +10%."""
    spec = PoolSpec(args.page_size, config.page_size, config.kt_cache_dtype)  # the pool is sized from this
    longest = request_pages(config, spec, max_prompt, new_tokens, keep_all=False)
    steady = longest.steady_pages * args.max_running
    return int((steady + longest.peak_pages) * 1.1) + 4


def make_pool(model, args, config: RocketKVConfig, pages: int, device: torch.device) -> KVBlockPool:
    dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None  # None: the model's dtype
    probe = KVBlockPool(model, max_gpu_bytes=1 << 30, page_size=args.page_size, kt_page_size=config.page_size,
                        kt_dtype=config.kt_cache_dtype, device=device, dtype=dtype)  # lazily allocated: its page size
    size = int(args.pool_gib * GIB) if args.pool_gib else pages * probe.bytes_per_page
    return KVBlockPool(model, max_gpu_bytes=size, page_size=args.page_size, kt_page_size=config.page_size,
                       kt_dtype=config.kt_cache_dtype, device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------------ a run
def run_plan(plan: list, steps: dict, after) -> None:
    """Each ``(name, step)`` of ``plan`` in order: ``steps[name]`` is the step's dict (or ``{"error": traceback}``:
    one step's failure never loses the others) with its wall time ``step_s``; then ``after(name)`` (save, print)."""
    for name, step in plan:
        started = time.perf_counter()
        try:
            steps[name] = step()
        except Exception:  # noqa: BLE001 - recorded, and the next step runs
            steps[name] = {"error": traceback.format_exc()}
        steps[name]["step_s"] = time.perf_counter() - started
        after(name)


class Recorder(TokenRecorder):
    """The engine's sink (``benchmarks.token_sink``; waiters wake when a request finishes) and the step's summary."""

    def __init__(self):
        super().__init__()
        self.unfinished_at_deadline = 0  # requests cancelled at --step-deadline-s

    def summary(self, start: float, end: float) -> dict:
        ttft = [times[0] - self.submitted[rid] for rid, times in self.token_times.items()]
        per_user = [(len(t) - 1) / (t[-1] - t[0]) for t in self.token_times.values() if len(t) > 1 and t[-1] > t[0]]
        gaps = [later - earlier for t in self.token_times.values() for earlier, later in itertools.pairwise(t)]
        tokens = sum(len(t) for t in self.token_times.values())
        reasons: dict[str, int] = {}
        errors = []
        for event in self.finals.values():
            reasons[event.finish_reason.value] = reasons.get(event.finish_reason.value, 0) + 1
            if event.error:
                errors.append(event.error)
        wall = end - start
        return {
            "requests": len(self.submitted), "finished": reasons, "errors": errors[:5], "output_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "per_user_tokens_per_s_p50": percentile(per_user, 50),
            "per_user_tokens_per_s_p10": percentile(per_user, 10),
            # inter-token latency: the gaps between a request's successive tokens, every request's pooled
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "unfinished_at_deadline": self.unfinished_at_deadline,
        }


def greedy_request(rid: str, prompt: list[int], new_tokens: int) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams.greedy(new_tokens, ignore_eos=True), frozenset())


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


def engine_stats(before, after) -> dict:
    """The engine's counters over one step: ``after - before`` (two ``engine.stats()`` snapshots)."""
    steps = after.decode_steps - before.decode_steps
    prefills = after.prefills - before.prefills
    step_ms = list(after.step_ms)[-steps:] if steps else []
    return {
        "decode_steps": steps, "mean_rows_per_step": (after.decode_rows - before.decode_rows) / max(1, steps),
        "padded_rows": after.padded_rows - before.padded_rows, "ms_per_step_p50": percentile(step_ms, 50),
        "ms_per_step_p90": percentile(step_ms, 90), "prefills": prefills,
        "prefill_s_per_request": (after.prefill_seconds - before.prefill_seconds) / max(1, prefills),
    }


class EngineRun:
    """The one engine of the run and its sink, which forwards each event to the running step's Recorder."""

    def __init__(self, model, pool, config, args, warm_tokens: int):
        self.model, self.pool, self.config, self.args = model, pool, config, args
        self.warm_tokens = warm_tokens
        self.engine: BatchingEngine | None = None
        self.recorder: Recorder | None = None
        self.prefill_times: list | None = None  # --prefill-times: [prompt_len, chunk tokens, seconds] per chunk

    def _sink(self, event) -> None:
        recorder = self.recorder
        if recorder is not None:
            recorder(event)

    def start(self, warm_up: bool = True) -> dict | None:
        """Build the engine, capture its decode graphs (``warm_up``), start it; returns warm_up's report."""
        args = self.args
        batching = BatchingConfig(max_running=args.max_running, prefills_per_step=args.prefills_per_step,
                                  max_queue=4096, buckets=_buckets(args.max_running),
                                  overlap_decode=args.overlap_decode, prefill_chunk_tokens=args.prefill_chunk_tokens,
                                  prefill_token_budget=args.prefill_token_budget,
                                  concurrent_prefill_tokens=args.concurrent_prefill_tokens)
        engine = BatchingEngine(self.model, self.config, self.pool, batching,
                                decode_graphs=None if args.decode == "graphs" else False)
        if args.prefill_times:
            self.prefill_times = record_prefill_times(engine)
        extra = {} if args.prefill_warm_tokens is None else {"prefill_tokens": args.prefill_warm_tokens}
        report = engine.warm_up(max_new_tokens=self.warm_tokens, **extra) if warm_up else None
        started = time.perf_counter()
        engine.start(self._sink)  # after warm_up: returns once the prefill attention graphs are built
        if report is not None:
            report["start_s"] = time.perf_counter() - started
            graphs = getattr(engine, "prefill_graphs", None)  # (None on trees before it existed)
            report["prefill_graphs"] = graphs.report if graphs is not None else None
        self.engine = engine
        return report

    def run(self, body) -> dict:
        """``body(engine, recorder)`` submits and waits; returns its summary and the engine's counters over it."""
        if self.engine is None:  # the warmup step failed before starting it: measure the rest anyway, unwarmed
            self.start(warm_up=False)
        engine, recorder = self.engine, Recorder()
        graphs = engine.graphs
        captures = graphs.captures if graphs is not None else 0
        before = engine.stats()
        chunks_before = len(self.prefill_times) if self.prefill_times is not None else 0
        self.recorder = recorder
        try:
            with TritonWatch() as triton_watch:  # Triton kernels compiled or loaded during the step
                start = time.perf_counter()
                body(engine, recorder)
                end = time.perf_counter()
        finally:
            self._cancel_unfinished(recorder)
            self.recorder = None
        result = recorder.summary(start, end)
        result.update(engine_stats(before, engine.stats()))
        result["graph_captures"] = graphs.captures - captures if graphs is not None else None
        result["decode"] = "graphs" if engine.graphs_in_use else "eager"
        result["pool_free_pages_after"] = self.pool.free_pages()
        result["pool_total_pages"] = self.pool.total_pages()
        if self.prefill_times is not None:
            result["prefill_times"] = self.prefill_times[chunks_before:]
        result["triton_cache_added"] = triton_watch.added
        result["triton_kernels_loaded"] = triton_watch.loaded[:60]
        return result

    def _cancel_unfinished(self, recorder: Recorder) -> None:
        """A step that failed or timed out leaves none of its requests running into the next step."""
        unfinished = [rid for rid in recorder.submitted if rid not in recorder.finals]
        for rid in unfinished:
            self.engine.cancel(rid)
        recorder.wait(len(recorder.submitted), 120)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop(drain=False, timeout=120)


def record_prefill_times(engine) -> list:
    """Wrap the engine thread's prefill chunk call: ``[prompt_len, chunk tokens, host seconds]`` per chunk (a last
    chunk ends reading its logits, so it includes the device work queued before it; an earlier chunk does not)."""
    times: list = []
    inner = engine._prefill_chunk

    def timed(running, tokens):
        started = time.perf_counter()
        inner(running, tokens)
        times.append([running.request.prompt_len, tokens, time.perf_counter() - started])

    engine._prefill_chunk = timed
    return times


def _buckets(max_running: int) -> tuple[int, ...]:
    buckets, size = [], 1
    while size < max_running:
        buckets.append(size)
        size *= 2
    return tuple(buckets + [max_running])


def step_warmup(engine_run: EngineRun, args, vocab) -> dict:
    rng = random.Random(args.seed + 1)
    startup = engine_run.start()  # the decode graphs of every bucket, before any request

    def body(engine, recorder):
        for i in range(2):
            recorder.submit(engine, greedy_request(f"warm{i}", random_prompt(rng, 64 + 32 * i, vocab), 4))
        assert recorder.wait(2, 600), "warm-up requests did not finish"

    result = engine_run.run(body)
    result["startup_capture_s"] = startup["seconds"]
    result["startup_capture"] = startup
    return result


def step_fixed(engine_run: EngineRun, args, vocab, device, seed_offset: int = 0) -> dict:
    """The fixed workload: ``--requests`` prompts submitted at once (other prompts per ``seed_offset``)."""
    rng = random.Random(args.seed + 2 + seed_offset)
    low = args.min_prompt_len or args.prompt_len  # U[--min-prompt-len, --prompt-len] when given
    lengths = [rng.randint(low, args.prompt_len) for _ in range(args.requests)]
    prompts = [random_prompt(rng, length, vocab) for length in lengths]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def body(engine, recorder):
        for i, prompt in enumerate(prompts):
            recorder.submit(engine, greedy_request(f"fixed{i}", prompt, args.new_tokens))
        assert recorder.wait(len(prompts), 3600), "the fixed workload did not finish"

    result = engine_run.run(body)
    result["workload"] = {"requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                          "min_prompt_len": args.min_prompt_len, "prompt_tokens": sum(lengths)}
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    return result


def step_fixed_frozen(engine_run: EngineRun, args, vocab, device) -> dict:
    """The fixed workload again after ``gc.collect(); gc.freeze()``: the heap built so far (model, pool, graphs)
    is never traversed by a collection again."""
    import gc

    gc.collect()
    gc.freeze()
    result = step_fixed(engine_run, args, vocab, device)
    result["gc_frozen_objects"] = gc.get_freeze_count()
    return result


ENGINE_TIMED = tuple(("hf_rocketkv.serving.batching.engine", f"BatchingEngine.{name}") for name in (
    "_iteration", "_finish_cancelled", "_prefill_chunk", "_accept", "_end_row")) + tuple(
    ("hf_rocketkv.serving.batching.decode_step", f"BatchDecoder.{name}") for name in ("step", "step_logits",
    "_sample_rows")) + ( ("hf_rocketkv.serving.batching.scheduler", "Scheduler.next_step"),
    ("hf_rocketkv.integration.batch_graphs", "BatchedDecodeGraphs.run"),
    ("hf_rocketkv.cache.batch_view", "BatchedDecodeCache.prepare"),
    ("hf_rocketkv.cache.batch_view", "BatchedDecodeCache.next_positions"),
    ("hf_rocketkv.cache.batch_view", "BatchedDecodeCache.stepped"),
    ("hf_rocketkv.cache.batch_view", "BatchedDecodeCache.join"),
)


def step_fixed_host_times(engine_run: EngineRun, args, vocab, device) -> dict:
    """The fixed workload with the engine's methods wrapped by host timers: where an iteration's host time goes
    (``_sample_rows`` includes the wait for the step's tokens; what is outside ``step_logits`` the GPU waits for)."""
    from benchmarks.prefill_host_time import Timers, patched

    timers = Timers()
    with patched(timers, ENGINE_TIMED) as skipped:
        result = step_fixed(engine_run, args, vocab, device)
    iterations = max(1, timers.calls.get("BatchingEngine._iteration", 0))
    result["host_ms_per_iteration"] = {name: round(1e3 * s / iterations, 4)
                                       for name, s in sorted(timers.seconds.items(), key=lambda kv: -kv[1])}
    result["calls"] = dict(timers.calls)
    result["iterations"] = iterations
    result["skipped"] = skipped
    return result


def step_mixed(engine_run: EngineRun, args, vocab, rate: float) -> dict:
    rng = random.Random(args.seed + int(rate * 1000))
    low, high = math.log(args.mixed_min_prompt), math.log(args.mixed_max_prompt)
    lengths = [int(math.exp(rng.uniform(low, high))) for _ in range(args.mixed_requests)]

    def body(engine, recorder):
        start = time.perf_counter()
        sent = 0
        for i, length in enumerate(lengths):
            if time.perf_counter() - start > args.mixed_time_s:
                break
            recorder.submit(engine, greedy_request(f"mixed{i}", random_prompt(rng, length, vocab),
                                                   args.mixed_new_tokens))
            sent += 1
            time.sleep(rng.expovariate(rate))
        if args.step_deadline_s:  # what is left then is cancelled (EngineRun.run): counted, not waited for
            if not recorder.wait(sent, max(0.0, args.step_deadline_s - (time.perf_counter() - start))):
                recorder.unfinished_at_deadline = sent - len(recorder.finals)
        else:
            assert recorder.wait(sent, 3600), "the mixed workload did not finish"

    result = engine_run.run(body)
    result["workload"] = {"rate_per_s": rate, "prompt_lens": [min(lengths), statistics.median(lengths),
                                                              max(lengths)], "new_tokens": args.mixed_new_tokens}
    result["tokens_per_s_per_gpu"] = result["tokens_per_s"]
    return result


def step_profile_prefill(engine_run: EngineRun, args, vocab, device, out: Path) -> dict:
    """One request's prefill in the engine thread, under torch.profiler (it records every thread's ops)."""
    from benchmarks.profile_prefix_hit import (
        gpu_gaps,
        profiled,
        summarize,
        write_report,
    )

    rng = random.Random(args.seed + 3)
    prompts = [random_prompt(rng, args.prompt_len, vocab) for _ in range(2)]

    def one(i):
        def body(engine, recorder):
            recorder.submit(engine, greedy_request(f"profiled{i}", prompts[i], 1))
            assert recorder.wait(1, 600), "the profiled request did not finish"
        return engine_run.run(body)

    isolated = [one(0)["prefill_s_per_request"] for _ in range(3)]  # same shapes before the profile, unprofiled
    result = {}
    prof = profiled(device, lambda: result.update(one(1)), all_threads=True, with_stack=True)
    report = {"prefill_s_per_request": result.get("prefill_s_per_request"), "prompt_len": args.prompt_len,
              "isolated_prefill_s": isolated}
    summarize(prof, device, report)
    trace = out / "profile_prefill" / "engine_prefill_trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    report["gaps"] = gpu_gaps(trace, window_function="_prefill_chunk")  # the engine thread's chunk, its token read
    trace.unlink()  # tens of MB: the gap report keeps what it says
    write_report(report, out / "profile_prefill" / "engine_prefill.json")
    return report


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        apply_quick(args)
    both = args.engine == "both"
    if both:
        args.engine = "rocketkv"  # first; the transformers side follows (run_transformers_side)
        args.step_deadline_s = args.step_deadline_s if args.step_deadline_s is not None else 30.0
        args.mixed_time_s = min(args.mixed_time_s, args.step_deadline_s / 2)  # arrivals end half-way
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": {**vars(args), "engine": "both" if both else args.engine}, "env": {"torch": torch.__version__, "python": platform.python_version(),
                                                "device": torch.cuda.get_device_name(device)
                                                if device.type == "cuda" else platform.processor() or "cpu"}}
    steps: dict = {}
    report["steps"] = steps
    path = out / "batching_throughput.json"

    def save():
        path.write_text(json.dumps(report, indent=2, default=str))

    try:
        started = time.perf_counter()
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        model = build_model(TINY if args.quick else LLAMA_31_8B, args.layers, dtype, device, args.seed)
        if args.engine == "rocketkv":
            hf_rocketkv.enable(model)
        if args.compile_regions and args.engine == "rocketkv":
            hf_rocketkv.compile_regions(model)  # compiled on first use: inside warm_up's startup_capture_s
        config = rocket_config(args.quick, device).replace(fused_rope=not args.rope_off)
        vocab = model.config.vocab_size
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        longest = max([args.prompt_len] + ([args.mixed_max_prompt] if rates else []))
        new_tokens = max(args.new_tokens, args.mixed_new_tokens if rates else 0)
        if args.engine == "rocketkv":
            pool = make_pool(model, args, config, pool_pages_for(args, config, longest, new_tokens), device)
            report["setup"] = {"model_build_s": time.perf_counter() - started, "pool_pages": pool.total_pages(),
                               "pool_gib": pool.total_pages() * pool.bytes_per_page / GIB,
                               "pool_dtype": str(pool.dtype).removeprefix("torch."), "config": config.to_dict()}
        else:
            pool = None
            report["setup"] = {"model_build_s": time.perf_counter() - started, "engine": "transformers",
                               "transformers": __import__("transformers").__version__}
    except Exception:  # noqa: BLE001 - nothing else can run; say why
        report["setup_error"] = traceback.format_exc()
        save()
        print(report["setup_error"])
        return 1
    save()
    from benchmarks.transformers_cb import (
        TransformersEngineRun,
        plot_both,
        run_transformers_side,
    )

    run_class = EngineRun if args.engine == "rocketkv" else TransformersEngineRun
    engine_run = run_class(model, pool, config, args, warm_tokens=new_tokens)
    plan = [("warmup", lambda: step_warmup(engine_run, args, vocab))]
    if not args.skip_fixed:
        plan.append(("fixed", lambda: step_fixed(engine_run, args, vocab, device)))
    if args.fixed_again:
        plan.append(("fixed_again", lambda: step_fixed(engine_run, args, vocab, device, seed_offset=1000)))
    if args.freeze_gc:
        plan.append(("fixed_gc_frozen", lambda: step_fixed_frozen(engine_run, args, vocab, device)))
    if args.time_host:
        plan.append(("fixed_host_times", lambda: step_fixed_host_times(engine_run, args, vocab, device)))
    if args.profile_prefill:
        plan.append(("profile_prefill", lambda: step_profile_prefill(engine_run, args, vocab, device, out)))
    plan += [(f"mixed_rate_{rate:g}", lambda rate=rate: step_mixed(engine_run, args, vocab, rate)) for rate in rates]
    def after(name: str) -> None:
        report["startup_capture_s"] = steps.get("warmup", {}).get("startup_capture_s")
        save()
        shown = {k: v for k, v in steps[name].items() if k != "errors" and not k.startswith("top_")}
        print(name, json.dumps(shown, default=str), flush=True)

    try:
        run_plan(plan, steps, after)
    finally:
        engine_run.close()
    if both:
        del engine_run, pool
        report["transformers_steps"] = run_transformers_side(model, config, args, vocab, rates, new_tokens, save)
        report["curve"] = plot_both(report, out / "mixed_curve.png")
        save()
        steps = {**steps, **{f"transformers/{k}": v for k, v in report["transformers_steps"].items()}}
    print(f"wrote {path}")
    return 0 if all("error" not in s for s in steps.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
