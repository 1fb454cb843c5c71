"""The pieces of a batching-engine benchmark run, shared by ``batching_throughput`` (hf_rocketkv's engine),
``transformers_cb`` (transformers' continuous batching behind the same steps) and ``tp_serving_throughput``: the
engine run, the token recorder, and the steps (warm-up, fixed workload, mixed arrivals, host times, profiled prefill),
each returning its dict for the report.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
import traceback
from pathlib import Path

import torch

from benchmarks.token_sink import TokenRecorder
from benchmarks.triton_watch import TritonWatch
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.engines.interface import EngineRequest
from hf_rocketkv.serving.sampling import SamplingParams
from hf_rocketkv.serving.batching.scheduler import BatchingConfig

GIB = 1 << 30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


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
    ("hf_rocketkv.serving.batching.decode_step", f"BatchDecoder.{name}") for name in ("step", "step_logits", "_sample_rows")) + (
    ("hf_rocketkv.serving.batching.scheduler", "Scheduler.next_step"),
    ("hf_rocketkv.integration.batch_graphs", "BatchedDecodeGraphs.run"),
    ("hf_rocketkv.cache.batch_view", "BatchedDecodeCache.prepare"),
    ("hf_rocketkv.cache.batch_view", "BatchedDecodeCache.next_positions"),
    ("hf_rocketkv.cache.batch_view", "BatchedDecodeCache.stepped"),
    ("hf_rocketkv.cache.batch_view", "BatchedDecodeCache.join"),
)


def step_fixed_host_times(engine_run: EngineRun, args, vocab, device) -> dict:
    """The fixed workload with the engine's methods wrapped by host timers: where an iteration's host time goes
    (``_sample_rows`` includes the wait for the step's tokens; what is outside ``step_logits`` the GPU waits for)."""
    from benchmarks.probes.prefill_host_time import Timers, patched

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
    from benchmarks.probes.profile_prefix_hit import (
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
