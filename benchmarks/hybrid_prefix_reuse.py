"""Prefix reuse on models with sliding-window layers: time to first token of a cold prompt against a prefix hit.

    python -m benchmarks.hybrid_prefix_reuse --out $OUT                      # both models, 32k prefix, one H100
    python -m benchmarks.hybrid_prefix_reuse --quick --out out/hybrid_hit    # tiny shapes on the CPU (seconds)

A hit of ``P`` tokens takes the full-attention layers' K/V from the pool's pages and runs the model again over the
prefix's last ``R = sum of the sliding windows`` tokens to rebuild the sliding layers' windows (docs/memory.md,
"Prefix reuse by replay"), so a hit computes ``suffix + min(P, R)`` tokens instead of ``P + suffix``: gpt-oss-20b
(12 sliding layers of 128) replays 1,536 tokens, Gemma-3-12B (40 of 1,024) 40,960, more than a 32k prefix, so there a
hit recomputes the whole prompt and saves nothing but the full-attention layers' page writes.

Models (random bf16 weights, the published configs' shapes): those of benchmarks/hybrid_decode.py. Per model, one
process, RocketKVConfig() defaults, a ``KVBlockPool(model)`` of ``--pool-gib``:
    cold     prefix + suffix A into the empty pool (its full pages join the prefix index)
    hit      prefix + suffix B: the prefix's pages are hit (``reused_tokens``), ``computed_tokens`` counted
    cold_b   prefix + suffix B into a second, empty pool: the hit's reference (its first ``--new-tokens`` greedy
             tokens are compared; bf16 sums over other lengths may flip a near tie, so the agreement is reported)
Columns: ``ttft_s`` (generate() of one token, synchronised), ``reused_tokens``, ``computed_tokens``, ``hit_over_cold``,
``first_logits_vs_cold_b`` (the hit's first-step logits against the cold reference's: largest difference, relative
to the logits' spread, and the rank of the cold token among the hit's logits). Random bf16 weights give nearly flat
logits, so greedy tokens flip at rounding; ``--dtype float32 --layers N`` shows the hit's exactness on real shapes.
Writes ``hybrid_prefix_reuse.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import time
from pathlib import Path

import torch

import hf_rocketkv
from benchmarks.hybrid_decode import MODELS, build_model
from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.integration import compat
from hf_rocketkv.memory.layer_kinds import replay_tokens, sliding_windows


def _generate(model, ids: torch.Tensor, cache: RocketKVCache, new_tokens: int):
    """Seconds of one generate() call (synchronised), its new tokens ``[1, n]`` and first step's logits ``[V]``."""
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True, **compat.cache_kwargs(cache))
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    return time.perf_counter() - started, out.sequences[:, ids.shape[1]:], out.logits[0][0].float()


def _logits_gap(hit: torch.Tensor, cold: torch.Tensor) -> dict:
    """How far the hit's first-step logits are from the cold run's: the largest difference relative to the cold
    logits' spread, and where the cold run's token ranks among the hit's logits (0: the same greedy token)."""
    spread = (cold.max() - cold.min()).item()
    rank = int((hit > hit[cold.argmax()]).sum())
    top2 = cold.topk(2).values
    return {"max_abs_diff": (hit - cold).abs().max().item(), "relative_to_spread": (hit - cold).abs().max().item()
            / spread, "cold_top1_rank_in_hit": rank, "cold_top1_top2_gap": (top2[0] - top2[1]).item()}


def run_model(name: str, args, device: torch.device, dtype: torch.dtype, rocket: RocketKVConfig) -> dict:
    model, _ = build_model(name, args.quick, args.layers, dtype, device)
    hf_rocketkv.enable(model)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab, (1, args.prefix), generator=generator)
    suffix_a, suffix_b = (torch.randint(3, vocab, (1, args.suffix), generator=generator) for _ in range(2))
    prompt_a = torch.cat([prefix, suffix_a], dim=1).to(device)
    prompt_b = torch.cat([prefix, suffix_b], dim=1).to(device)
    pool_bytes = int(args.pool_gib * 2**30)
    warm = RocketKVCache(rocket, pool=KVBlockPool(model, max_gpu_bytes=pool_bytes))
    _generate(model, prompt_a[:, : rocket.prompt_budget + 4 * rocket.window_size], warm, 2)  # JIT, cuBLAS
    warm.close()
    rows, logits = {}, {}
    pool = KVBlockPool(model, max_gpu_bytes=pool_bytes)
    for label, ids in (("cold", prompt_a), ("hit", prompt_b)):
        cache = RocketKVCache(rocket, pool=pool)
        ttft, _, _ = _generate(model, ids, cache, 1)
        stats = cache.stats
        rows[label] = {"ttft_s": ttft, "reused_tokens": stats.reused_tokens, "computed_tokens": stats.computed_tokens}
        cache.close()
    again = RocketKVCache(rocket, pool=pool)  # the prefix is still cached: a second hit, its tokens and logits
    _, tokens, logits["hit"] = _generate(model, prompt_b, again, args.new_tokens)
    rows["hit"]["tokens"] = tokens[0].tolist()
    again.close()
    reference = RocketKVCache(rocket, pool=KVBlockPool(model, max_gpu_bytes=pool_bytes))
    ttft_b, tokens_b, logits["cold_b"] = _generate(model, prompt_b, reference, args.new_tokens)
    reference.close()
    rows["cold_b"] = {"generate_s": ttft_b, "tokens": tokens_b[0].tolist()}
    hit_tokens = rows["hit"]["tokens"]
    windows = sliding_windows(model.config)
    report = {
        "layers": model.config.num_hidden_layers,
        "sliding_layers": sum(w is not None for w in windows),
        "replay_tokens": replay_tokens(windows),
        "rows": rows,
        "hit_over_cold": rows["hit"]["ttft_s"] / rows["cold"]["ttft_s"],
        "first_logits_vs_cold_b": _logits_gap(logits["hit"], logits["cold_b"]),
        "tokens_equal_to_cold_b": sum(a == b for a, b in zip(hit_tokens, rows["cold_b"]["tokens"])) / len(hit_tokens),
    }
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--prefix", type=int, default=32768, help="shared prefix tokens (default 32768)")
    parser.add_argument("--suffix", type=int, default=256, help="each prompt's own tokens after the prefix")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared with the cold reference")
    parser.add_argument("--pool-gib", type=float, default=8.0)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers of each model")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="weights and K/V (default bfloat16 on CUDA; float32 shows the hit's exactness)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, fp32, CPU: checks the logic in seconds")
    parser.add_argument("--out", default="out/hybrid_prefix_reuse")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else getattr(torch, args.dtype or "bfloat16")
    if args.quick:
        args.prefix, args.suffix, args.pool_gib = 200, 24, 0.01
    rocket = RocketKVConfig(prompt_budget=32, window_size=8, topk=4) if args.quick else RocketKVConfig()
    report = {
        "benchmark": "hybrid_prefix_reuse", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__, "dtype": str(dtype),
        "prefix": args.prefix, "suffix": args.suffix, "layers_override": args.layers, "quick": args.quick,
        "models": {},
    }
    for name in args.models:
        report["models"][name] = run_model(name, args, device, dtype, rocket)
        summary = {k: v for k, v in report["models"][name].items() if k != "rows"}
        print(json.dumps({"model": name, **summary,
                          **{f"{k}_ttft_s": v.get("ttft_s") for k, v in report["models"][name]["rows"].items()}}),
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_prefix_reuse.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'hybrid_prefix_reuse.json'}")
    return report


if __name__ == "__main__":
    main()
