"""transformers' continuous batching behind the steps of benchmarks/batching_throughput.py (``--engine transformers``),
and ``--engine both``: the mixed rates on it after hf_rocketkv's engine, same arrivals and prompts, one curve each.

Arrivals, prompt lengths and prompt tokens of a rate come from ``random.Random(seed + rate * 1000)`` in
``step_mixed``, so both engines see the same requests at the same offsets from the step's start.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import torch

from benchmarks.batching_steps import (
    EngineRun,
    Recorder,
    run_plan,
    step_mixed,
    step_warmup,
)
from hf_rocketkv.serving.engines.interface import EngineEvent, EngineRequest


class TransformersEngine:
    """transformers' continuous batching (``model.init_continuous_batching``) behind the two calls the steps use,
    ``submit(EngineRequest)`` and the events of each new token: requests stream, a reader thread turns each output
    into the tokens it added. Greedy; EOS is not ignored (transformers has no such switch; random weights almost
    never emit it within a few hundred tokens, and the report counts the tokens really produced)."""

    def __init__(self, model, max_new_tokens: int, sink):
        from transformers import GenerationConfig

        from hf_rocketkv.serving.outputs import FinishReason

        self.finished_reason = FinishReason.LENGTH
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=2)
        self.manager = model.init_continuous_batching(generation_config=config)
        self.manager.start()
        self.sink = sink
        self.seen: dict[str, int] = {}
        self.running = True
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def submit(self, request: EngineRequest) -> None:
        self.seen[request.request_id] = 0
        self.manager.add_request(list(request.prompt_ids), request_id=request.request_id,
                                 max_new_tokens=request.params.max_tokens, streaming=True)

    def cancel(self, request_id: str) -> None:
        self.manager.cancel_request(request_id)

    def _read(self) -> None:
        while self.running:
            output = self.manager.get_result(timeout=0.1)
            if output is None:
                continue
            rid = output.request_id
            done = self.seen.get(rid, 0)
            new = list(output.generated_tokens[done:])
            self.seen[rid] = done + len(new)
            finished = output.is_finished() or output.error is not None
            self.sink(EngineEvent(rid, tuple(new), self.finished_reason if finished else None, output.error))

    def stop(self) -> None:
        self.running = False
        self.manager.stop(block=True, timeout=120)


class TransformersEngineRun(EngineRun):
    """The same steps on transformers' continuous batching (``--engine transformers``)."""

    def start(self, warm_up: bool = True) -> dict | None:
        started = time.perf_counter()
        self.engine = TransformersEngine(self.model, self.warm_tokens, self._sink)
        return {"seconds": time.perf_counter() - started}

    def run(self, body) -> dict:
        if self.engine is None:
            self.start()
        recorder = Recorder()
        self.recorder = recorder
        try:
            start = time.perf_counter()
            body(self.engine, recorder)
            end = time.perf_counter()
        finally:
            self._cancel_unfinished(recorder)
            self.recorder = None
        return recorder.summary(start, end)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def run_transformers_side(model, config, args, vocab: int, rates: list[float], new_tokens: int, save) -> dict:
    """The warm-up and every mixed rate on transformers' continuous batching, the model back on sdpa attention and
    hf_rocketkv's engine and pool freed first (transformers sizes its cache from the free memory)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    model.set_attn_implementation("sdpa")
    steps: dict = {}
    engine_run = TransformersEngineRun(model, None, config, args, warm_tokens=new_tokens)
    plan = [("warmup", lambda: step_warmup(engine_run, args, vocab))]
    plan += [(f"mixed_rate_{rate:g}", lambda rate=rate: step_mixed(engine_run, args, vocab, rate)) for rate in rates]
    def after(name: str) -> None:
        print(f"transformers/{name}", {k: v for k, v in steps[name].items() if k != "errors"}, flush=True)
        save()

    try:
        run_plan(plan, steps, after)
    finally:
        engine_run.close()
    return steps


def plot_both(report: dict, out: Path) -> dict:
    """``mixed_curve.png``: output tokens/s per GPU against per-user tokens/s (median), one line per engine; returns
    the points, ``{engine: [(rate, per_user_p50, per_gpu)]}``."""
    from benchmarks.plot_mixed_curve import plot, points_of

    curves = {"hf_rocketkv BatchingEngine": points_of(report["steps"]),
              "transformers continuous batching": points_of(report["transformers_steps"])}
    try:
        plot(curves, f"mixed workload on {report['env']['device']}", out)
    except ImportError as err:  # matplotlib missing: the points are in the JSON all the same
        print(f"no plot ({err})")
    return curves
