"""Would a prefill running beside the decode steps keep the running requests' inter-token latency? A measurement, on
a GPU, of the design the batching engine does not have yet (docs/serving.md, "Measured: inter-token latency").

    python -m benchmarks.probes.decode_beside_prefill [--out DIR]      # Llama-3.1-8B shapes, random bf16 weights, GPU
    python -m benchmarks.probes.decode_beside_prefill --quick          # tiny model on the CPU: the script's logic

Today the engine's one thread runs a prefill chunk between two decode steps, so every chunk is a gap in every running
request's tokens. Here the engine decodes --running requests (CUDA graphs, as served) while a second host thread
prefills --arrivals prompts of --long-prompt tokens through ``ChunkedPrefill`` (the engine's own prefill object, on a
pool of its own) on a CUDA stream of its own, so the decode steps never wait for the host's chunk launches and the
GPU runs both at once. Per setting (``--chunks`` x ``--decode-priority``: the engine's stream at the default priority
or at the highest, the prefill's at the lowest):

  alone    the running requests decode for --alone-s seconds: per-user rate, inter-token latency p50 / p99
  beside   the long prompts are prefilled beside them: the same, and each long prompt's prefill seconds

``rate_ratio`` = beside / alone per-user rate; ``itl_p99_over_alone_p50``: the gaps' p99 against a decode step alone.
The engine is not changed: the benchmark runs its loop on the chosen stream. Writes ``decode_beside_prefill.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import threading
import time
import traceback
from pathlib import Path

import torch

import hf_rocketkv
from benchmarks.decode_under_arrivals import _buckets, greedy, make_pool, provenance, rates
from benchmarks.token_sink import TokenRecorder
from hf_rocketkv import RocketKVCache
from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.memory import KVBlockPool
from hf_rocketkv.serving.batching.chunked_prefill import ChunkedPrefill
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true", help="tiny model, tiny workload (CPU without a GPU)")
    parser.add_argument("--chunks", default="512,2048,32768", help="prefill chunk sizes, comma separated")
    parser.add_argument("--decode-priority", default="default,high", help="the engine stream's priority: "
                                                                          "default and/or high, comma separated")
    parser.add_argument("--running", type=int, default=8)
    parser.add_argument("--running-prompt", type=int, default=1024)
    parser.add_argument("--arrivals", type=int, default=2)
    parser.add_argument("--long-prompt", type=int, default=32768)
    parser.add_argument("--long-new-tokens", type=int, default=8)
    parser.add_argument("--alone-s", type=float, default=3.0)
    parser.add_argument("--running-max-tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def gap_quantiles(times: TokenRecorder, rids: list[str], start: float, end: float) -> dict:
    """Median and p99 of the inter-token gaps of ``rids`` that overlap [start, end]: a gap that began before the
    window or ended after it counts (the gap that spans a prefill is the one the users wait through), so a window
    shorter than a decode step still has one gap per request once each has a token after ``end``."""
    gaps = sorted(gap for rid in rids for gap in times.gaps_overlapping(rid, start, end))
    if not gaps:
        return {"itl_p50_s": None, "itl_p99_s": None}
    return {"itl_p50_s": statistics.median(gaps), "itl_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]}


def wait_for_a_token_after(times: TokenRecorder, rids: list[str], moment: float, timeout: float = 600) -> None:
    """Until each of ``rids`` has a token later than ``moment``: the gap that spans a window's end is then known."""
    later = lambda recorder: all(recorder.token_times.get(r, [0.0])[-1] > moment for r in rids)  # noqa: E731
    if not times.wait_for(later, timeout):
        raise RuntimeError(f"the running requests produced no token within {timeout} s after the window")


def stream_for(device: torch.device, priority: str):
    """A new stream at the lowest ("low"), default or highest ("high") priority; None on the CPU."""
    if device.type != "cuda":
        return None
    lowest, highest = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device, priority={"low": lowest, "default": 0, "high": highest}[priority])


def prefill_beside(model, config, pool, prompts: list[list[int]], chunk: int, stream, device, out: dict) -> None:
    """The prompts, one after another, through ``ChunkedPrefill`` in ``chunk``-token chunks on ``stream`` (this
    thread's), each cache closed after; ``out["prefill_s"]``: each prompt's seconds to its last chunk's end."""
    torch.set_grad_enabled(False)
    context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    seconds = []
    try:
        with context:
            for index, prompt in enumerate(prompts):
                started = time.perf_counter()
                cache = RocketKVCache(config, pool=pool, cache_salt=f"beside-{index}-{time.monotonic_ns()}")
                prefill = ChunkedPrefill(model, cache, prompt, 8, None, chunk, device)
                while not prefill.done:
                    prefill.run(chunk)
                if stream is not None:
                    stream.synchronize()
                seconds.append(time.perf_counter() - started)
                cache.close()
    except Exception:  # noqa: BLE001 - reported in the setting's result
        out["error"] = traceback.format_exc()
    out["prefill_s"] = seconds


def run_setting(model, pool, side_pool, config, args, chunk: int, priority: str, device) -> dict:
    rows = args.running
    engine = BatchingEngine(model, config, pool, BatchingConfig(max_running=rows, buckets=_buckets(rows)))
    result: dict = {"chunk": chunk, "decode_priority": priority,
                    "warm_up": engine.warm_up(max_new_tokens=args.running_max_tokens)}
    decode_stream = stream_for(device, priority)
    if decode_stream is not None:  # the engine's loop on that stream (graph replays go to the current stream)
        torch.cuda.synchronize()
        loop = engine._loop

        def loop_on_stream():
            with torch.cuda.stream(decode_stream):
                loop()

        engine._loop = loop_on_stream
    times = TokenRecorder(wake_on_tokens=True)
    engine.start(times)
    rng = random.Random(f"{args.seed}-{chunk}-{priority}")
    running = [f"run{i}" for i in range(rows)]
    try:
        for rid in running:
            engine.submit(greedy(rid, [rng.randrange(3, model.config.vocab_size) for _ in range(args.running_prompt)],
                                 args.running_max_tokens))
        assert times.wait_for(lambda t: all(len(t.token_times.get(r, [])) >= 3 for r in running), 600)
        start = time.perf_counter()
        time.sleep(args.alone_s)
        end = time.perf_counter()
        wait_for_a_token_after(times, running, end)
        result["alone"] = {**rates(times, running, start, end), **gap_quantiles(times, running, start, end)}
        prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(args.long_prompt)]
                   for _ in range(args.arrivals)]
        side: dict = {}
        worker = threading.Thread(target=prefill_beside, name="prefill-beside",
                                  args=(model, config, side_pool, prompts, chunk, stream_for(device, "low"), device,
                                        side))
        start = time.perf_counter()
        worker.start()
        worker.join()
        end = time.perf_counter()
        wait_for_a_token_after(times, running, end)
        result["beside"] = {**rates(times, running, start, end), **gap_quantiles(times, running, start, end), **side}
        alone, beside = result["alone"], result["beside"]
        if alone["per_user_tokens_per_s_p50"] and beside["per_user_tokens_per_s_p50"] is not None:  # 0: a stall
            result["rate_ratio"] = beside["per_user_tokens_per_s_p50"] / alone["per_user_tokens_per_s_p50"]
        if alone["itl_p50_s"] and beside["itl_p99_s"]:
            result["itl_p99_over_alone_p50"] = beside["itl_p99_s"] / alone["itl_p50_s"]
    finally:
        for rid in running:
            engine.cancel(rid)
        times.wait(len(running), 300)
        engine.stop(drain=False, timeout=300)
    result["pages_back"] = pool.free_pages() == pool.total_pages() and side_pool.free_pages() == side_pool.total_pages()
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        # a long prompt of 16 chunks: its window holds several decode steps (one chunk is about one step here)
        args.running, args.running_prompt, args.long_prompt, args.alone_s = 4, 64, 2048, 0.5
        args.arrivals, args.running_max_tokens, args.chunks = 1, 2000, "128"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    torch.set_grad_enabled(False)
    report = {**provenance(argv, device), "args": vars(args), "settings": {}}
    report["command"] = report["command"].replace("decode_under_arrivals", "probes.decode_beside_prefill")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(TINY if args.quick else LLAMA_31_8B, args.layers, dtype, device, args.seed)
    hf_rocketkv.enable(model)
    config = (RocketKVConfig(prompt_budget=48, window_size=8, kernel_size=7, topk=4, page_size=4) if args.quick
              else RocketKVConfig()).replace(backend="triton" if device.type == "cuda" else "torch")
    pool = make_pool(model, argparse.Namespace(**{**vars(args), "arrivals": 0}), config, device)  # running only
    side_pool = KVBlockPool(model, max_gpu_bytes=pool.bytes_per_page * (args.long_prompt // args.page_size + 64) * 2,
                            page_size=args.page_size, kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype,
                            device=device)
    for chunk in (int(c) for c in args.chunks.split(",")):
        for priority in args.decode_priority.split(","):
            label = f"chunk{chunk}_{priority}"
            try:
                report["settings"][label] = run_setting(model, pool, side_pool, config, args, chunk, priority, device)
            except Exception:  # noqa: BLE001 - one setting's failure never loses the others
                report["settings"][label] = {"error": traceback.format_exc()}
            shown = report["settings"][label]
            print(label, json.dumps({k: shown.get(k) for k in ("rate_ratio", "itl_p99_over_alone_p50", "alone",
                                                               "beside", "error")}, default=str), flush=True)
            (out / "decode_beside_prefill.json").write_text(json.dumps(report, indent=2, default=str))
    return 0 if all("error" not in s for s in report["settings"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
