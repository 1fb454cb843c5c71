"""``hf-rocketkv eval``: every task x every method on the same samples; JSON, markdown and heat maps out.

For each sample the prompt is prefilled once (shared prefix, see eval/decode.py) and each method decodes from its
own cache. Results are rewritten after every sample, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import RocketKVConfig
from . import decode
from .methods import Method, build_methods
from .report import summarize, write_report
from .scoring import fidelity_metrics, score
from .settings import EvalSettings
from .tasks import get_task
from .tasks.base import FidelitySample, Sample, encode_prompt, span_token_positions

MIN_TAIL = 64  # tokens every method runs itself at the end of the prompt (>= any window_size we use)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _tail(methods: list[Method]) -> int:
    windows = [m.config.window_size for m in methods if m.config is not None]
    return max([MIN_TAIL, *windows])


def run_generation_sample(
    model, tokenizer, sample: Sample, methods: list[Method], settings: EvalSettings
) -> list[dict]:
    ids = encode_prompt(tokenizer, sample.prompt, settings.chat, sample.answer_prefix)
    spans = {  # needle tasks: which prompt tokens hold the needle sentence and its answer (stage-1 diagnostics)
        name: span_token_positions(tokenizer, sample.prompt, settings.chat, sample.answer_prefix, sample.meta[name])
        for name in ("needle", "key")
        if sample.meta.get(name)
    }
    input_ids = torch.tensor([ids], device=next(model.parameters()).device)
    prefix = decode.shared_prefix(model, input_ids, _tail(methods))
    eos = _eos_ids(model, tokenizer)
    records = []
    for method in methods:
        prefilled = decode.prefill(model, method, prefix, sample.max_new_tokens)
        kept = decode.kept_tokens_per_layer(prefilled.cache)
        nbytes = decode.cache_bytes(prefilled.cache)
        kept_spans = {name: decode.retention(prefilled.cache, positions) for name, positions in spans.items()}
        tokens, per_token = decode.greedy(model, prefilled, len(ids), sample.max_new_tokens, eos)
        prediction = tokenizer.decode(tokens, skip_special_tokens=True)
        scores = {m: score(m, prediction, sample.answers) for m in sample.metrics}
        records.append(
            {
                "task": sample.task,
                "index": sample.index,
                "length": sample.length,
                "depth": sample.depth,
                "prompt_tokens": len(ids),
                "method": method.name,
                "prediction": prediction,
                "answers": sample.answers,
                "metric": sample.metrics[0],
                "score": scores[sample.metrics[0]],
                "scores": scores,
                "kept_tokens_mean": sum(kept) / len(kept),
                "kept_tokens_min": min(kept),
                "kept_tokens_max": max(kept),
                "read_tokens_first_step": method.read_tokens(round(sum(kept) / len(kept)) + 1),
                "cache_bytes_after_prefill": nbytes,
                "shared_prefill_s": prefix.seconds,
                "method_prefill_s": prefilled.seconds,
                "decode_s_per_token": per_token,
                **{f"{name}_retention": value for name, value in kept_spans.items() if value is not None},
                **({"meta": sample.meta} if sample.meta else {}),
            }
        )
        del prefilled
    return records


def run_fidelity_sample(model, sample: FidelitySample, methods: list[Method], progress: bool = False) -> list[dict]:
    input_ids = torch.tensor([sample.context_ids], device=next(model.parameters()).device)
    prefix = decode.shared_prefix(model, input_ids, _tail(methods))
    start = len(sample.context_ids)
    target = torch.tensor(sample.continuation_ids)
    ordered = sorted(methods, key=lambda m: m.name != "full")  # the reference first
    if ordered[0].name != "full":
        ordered.insert(0, build_methods(["full"], RocketKVConfig())[0])
    reference = None
    records = []
    for method in ordered:
        prefilled = decode.prefill(model, method, prefix, len(target))
        kept = decode.kept_tokens_per_layer(prefilled.cache)  # after prefill, before the continuation is appended
        steps = list(
            tqdm(
                decode.teacher_forced_log_probs(model, prefilled, start, sample.continuation_ids),
                total=len(target),
                desc=f"fidelity {method.name}",
                unit="tok",
                leave=False,
                disable=not progress,
            )
        )
        log_probs = torch.stack(steps).cpu()  # [P, V]
        if reference is None:
            reference = log_probs
        # decode step j (1 <= j < P) feeds continuation token j - 1 onto the kept tokens: kept + j stored
        reads = [method.read_tokens(round(sum(kept) / len(kept)) + j) for j in range(1, len(target))] or [0]
        if method in methods:
            records.append(
                {
                    "task": sample.task,
                    "index": sample.index,
                    "method": method.name,
                    "context_tokens": start,
                    "positions": len(target),
                    **fidelity_metrics(reference, log_probs, target),  # top-1, KL(full || method), accuracy
                    "kept_tokens_mean": sum(kept) / len(kept),
                    "read_tokens_mean": sum(reads) / len(reads),  # per layer and KV head, over the decode steps
                    "read_tokens_max": max(reads),
                }
            )
        del prefilled, steps
    return records


def run_eval(
    model,
    tokenizer,
    config: RocketKVConfig,
    settings: EvalSettings,
    output: str | Path,
    *,
    model_name: str = "",
    command: str = "",
    progress: bool = True,
) -> dict:
    """Run ``settings`` on ``model``; writes results.json, results.md and heatmap_<task>.png into ``output``."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    methods = build_methods(settings.methods, config, settings.sink_tokens)
    tasks = [get_task(spec) for spec in settings.tasks]  # unknown names fail before any model work
    results = {
        "model": model_name,
        "command": command,
        "config": config.to_dict(),
        "eval": settings.to_dict(),
        "methods": [m.describe() for m in methods],
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": str(next(model.parameters()).device),
            "dtype": str(next(model.parameters()).dtype),
            "threads": torch.get_num_threads(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "records": [],
        "fidelity": [],
    }
    built = [(task, task.build(tokenizer, settings)) for task in tasks]
    total = sum(len(samples) for _, samples in built)
    bar = tqdm(total=total, desc="eval", unit="sample", disable=not progress)
    for task, samples in built:
        for sample in samples:
            length = getattr(sample, "length", None) or sample.meta.get("length")
            depth = getattr(sample, "depth", None)
            bar.set_postfix_str(
                f"{task.name} #{sample.index}"
                + (f" len={length}" if length else "")
                + (f" depth={depth}" if depth is not None else "")
            )
            if task.kind == "fidelity":
                results["fidelity"] += run_fidelity_sample(model, sample, methods, progress)
            else:
                results["records"] += run_generation_sample(model, tokenizer, sample, methods, settings)
            bar.update(1)
            results["summary"] = summarize(results)
            (output / "results.json").write_text(json.dumps(results, indent=1))
    bar.close()
    results["summary"] = summarize(results)
    results["environment"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (output / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, output, depth_tasks={t.name for t in tasks if t.uses_depth})
    return results
