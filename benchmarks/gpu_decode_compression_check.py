"""GPU check of decode-time compression (RocketKVConfig.decode_budget) with the Triton backend and both decode runners.

Llama-3.1-8B shapes (fewer layers), random bf16 weights, a long answer. For each batch size: greedy tokens of eager
decode, of decode_runner="cuda_graphs" (must equal eager: the compaction runs between replays, in place) and of
decode_runner="torch_compile" (inductor: close, not necessarily identical in bf16); the cache's capacity (must be
prompt_budget + decode_budget + decode_interval, rounded to pages, whatever --new-tokens is), stored tokens, bytes,
and decode ms/token with and without compression. Never stops at the first failure; writes JSON to --out.

    PYTHONPATH=. python benchmarks/gpu_decode_compression_check.py --layers 4 --context 4096 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig, enable
from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model


def generate(model, ids, config, new_tokens, compiled: bool):
    """Greedy tokens ``[B, new]`` and the run's measurements."""
    cache = RocketKVCache(config)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, disable_compile=not compiled)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    layer = cache.layers[0]
    return out[:, ids.shape[1]:], dict(
        wall_s=wall, capacity=layer.capacity, stored=layer.lengths.tolist(), memory_bytes=cache.memory_bytes(),
        ms_per_token=wall / new_tokens * 1e3, graph_replays=getattr(cache.hints.graphed_step, "replays", None),
    )


def check(model, batch: int, args) -> dict:
    ids = torch.randint(100, 30000, (batch, args.context), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(batch))
    base = RocketKVConfig(prompt_budget=args.prompt_budget, topk=args.topk, backend="triton",
                          decode_budget=args.decode_budget, decode_interval=args.decode_interval)
    record = {"batch": batch}
    runs = {
        "eager": (base, False),
        "cuda_graphs": (base.replace(decode_runner="cuda_graphs"), True),
        "torch_compile": (base.replace(decode_runner="torch_compile"), True),
        "uncompressed_eager": (base.replace(decode_budget=None), False),
    }
    tokens = {}
    for name, (config, compiled) in runs.items():
        try:
            tokens[name], record[name] = generate(model, ids, config, args.new_tokens, compiled)
        except Exception as err:  # keep going: every run is recorded
            record[name] = {"error": repr(err), "traceback": traceback.format_exc()}
    bound = base.prompt_budget + base.decode_budget + base.decode_interval
    if "eager" in tokens:
        record["capacity_bound"] = bound
        record["capacity_ok"] = record["eager"]["capacity"] <= bound + 16  # pages of the private store
        for name in ("cuda_graphs", "torch_compile", "uncompressed_eager"):
            if name in tokens:
                record[f"{name}_equal_eager"] = bool(torch.equal(tokens[name], tokens["eager"]))
                record[f"{name}_agreement"] = float((tokens[name] == tokens["eager"]).float().mean())
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-budget", type=int, default=2048)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--decode-budget", type=int, default=256)
    p.add_argument("--decode-interval", type=int, default=64)
    p.add_argument("--out", default="out")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(LLAMA_31_8B, args.layers, torch.bfloat16, torch.device("cuda"), 0)
    enable(model)
    records = [check(model, batch, args) for batch in args.batches]
    text = json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(), "records": records}, indent=1)
    (out / "gpu_decode_compression_check.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
