"""What a packed engine step costs against the forwards it replaces: a prompt chunk's forward alone plus a captured
decode step (``BatchingConfig.packed_steps``, docs/benchmarks-serving.md "Packed steps").

    python -m benchmarks.probes.packed_step_profile --out $OUT        # Llama-3.1-8B shapes, --layers 8, one GPU
    python -m benchmarks.probes.packed_step_profile --quick           # tiny model on the CPU: the script's logic

One model and pool; for each mode (alternating, packed) an engine is warmed up (its decode graphs captured), then
``--rows`` requests of ``--short`` prompt tokens start decoding and ``--long`` prompts of ``--long-len`` tokens arrive
(chunks of ``--chunk`` tokens). Every model forward that runs eagerly (a chunk alone, a packed step) is timed on the
device with CUDA events around it (forward pre- and post-hooks, attached after the warm-up: elapsed time, so a
forward whose launches outrun its kernels shows the host's time); the decode steps that replay a graph are the
engine's own step times (``BatchingStats.step_ms``, host wall time of launch to tokens read). The first eager
forward of each kind is also profiled (``torch.profiler``): device time by kernel name, its 12 largest, and the
kernel count; device time well under the elapsed time means the forward waited on its launches. Writes
``packed_step_profile.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch


class ForwardTimer:
    """Forward pre/post hooks: device ms of every eager forward by kind, and one profile per kind."""

    def __init__(self, model, packed_kind):
        self.kind_of = packed_kind
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.shapes: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.profiles: dict[str, dict] = {}
        self._open = None
        # attached after the engine's warm-up and removed before the next one: a hook's event sync inside a graph
        # capture would invalidate it (the engine then decodes eagerly)
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if isinstance(cache, self.kind_of):
            kind, shape = "packed", (cache.rows, ids.shape[1] - cache.rows)
        elif "logits_to_keep" in kwargs:
            kind, shape = "chunk_alone", (0, ids.shape[1])
        else:
            kind, shape = "decode_eager", (ids.shape[0], 0)
        profiler = None
        if kind not in self.profiles and ids.device.type == "cuda" and shape[1] > 1:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        start = torch.cuda.Event(enable_timing=True) if ids.device.type == "cuda" else None
        if start is not None:
            start.record()
        self._open = (kind, shape, start, profiler, time.perf_counter())

    def _post(self, module, args, kwargs, output):
        kind, shape, start, profiler, host = self._open
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - host) * 1e3
        if profiler is not None:
            torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            self.profiles[kind] = summarize(profiler, shape)
        self.ms[kind].append(ms)
        self.shapes[kind].append(shape)


def summarize(profiler, shape) -> dict:
    by_name: dict[str, float] = defaultdict(float)
    count = 0
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name[:80]] += event.device_time_total / 1e3
            count += 1
    top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
    return {"shape_rows_tokens": shape, "kernels": count, "device_ms": sum(by_name.values()),
            "top_ms": [[name, round(ms, 3)] for name, ms in top]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--short", type=int, default=1024)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    import hf_rocketkv
    from hf_rocketkv import KVBlockPool
    from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
    from hf_rocketkv.cache import PackedStepCache
    from hf_rocketkv.serving.batching.engine import BatchingEngine
    from hf_rocketkv.serving.batching.scheduler import BatchingConfig
    from hf_rocketkv.serving.engines.interface import EngineRequest
    from hf_rocketkv.serving.sampling import SamplingParams

    if args.quick:
        args.rows, args.short, args.long, args.long_len, args.chunk, args.new_tokens = 3, 40, 1, 96, 32, 12
    device = torch.device("cpu" if args.quick else "cuda")
    model = build_model(TINY if args.quick else LLAMA_31_8B, None if args.quick else args.layers,
                        torch.float32 if args.quick else torch.bfloat16, device, 0)
    hf_rocketkv.enable(model)
    pool = KVBlockPool(model, max_gpu_bytes=int((0.05 if args.quick else 20) * 2**30))
    profiles: dict[str, dict] = {}
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "args": vars(args), "modes": {}}
    for mode in ("alternating", "packed"):
        batching = BatchingConfig(max_running=args.rows + args.long, packed_steps=mode == "packed",
                                  prefill_chunk_tokens=args.chunk, prefill_token_budget=args.chunk)
        engine = BatchingEngine(model, None, pool, batching)
        engine.warm_up(max_new_tokens=args.new_tokens)
        timer = ForwardTimer(model, PackedStepCache)
        done = {}
        engine.start(lambda event: done.__setitem__(event.request_id, True) if event.finish_reason else None)
        params = SamplingParams.greedy(args.new_tokens, ignore_eos=True)

        def submit(name, length):
            ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
            engine.submit(EngineRequest(name, tuple(ids), params, frozenset()))

        try:
            for i in range(args.rows):
                submit(f"s{i}", args.short)
            while engine.stats().decode_steps < 4:
                time.sleep(0.01)
            steps_before = len(engine.stats().step_ms)
            for i in range(args.long):
                submit(f"l{i}", args.long_len)
            while len(done) < args.rows + args.long:
                time.sleep(0.01)
        finally:
            engine.stop(timeout=120)
            timer.remove()
        profiles.update({f"{mode}_{kind}": profile for kind, profile in timer.profiles.items()})
        stats = engine.stats()
        step_ms = list(stats.step_ms)[steps_before:]
        report["modes"][mode] = {
            "eager_forward_ms": {kind: {"count": len(v), "median": statistics.median(v), "shapes": timer.shapes[kind][:4]}
                                 for kind, v in timer.ms.items()},
            "engine_step_ms_median": statistics.median(step_ms) if step_ms else None,
            "decode_steps": stats.decode_steps, "packed_steps": stats.packed_steps,
            "decode_graphs_in_use": engine.graphs_in_use,
        }
        print(mode, json.dumps(report["modes"][mode]), flush=True)
    report["profiles"] = profiles
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "packed_step_profile.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
