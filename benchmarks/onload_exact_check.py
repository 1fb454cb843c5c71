"""A prefix hit onloaded from host memory computes exactly what the same hit on the device computes (GPU check).

    PYTHONPATH=. python benchmarks/onload_exact_check.py --out $OUT

Llama-3.1-8B shapes with --layers layers and random weights, in float32 and bfloat16: a cold request fills a
KVBlockPool (with host memory); the same prefix with another tail runs once as a device hit, then again after
``pool.evict()`` moved the prefix pages to host memory (an onload hit). The oracle is the device hit: greedy tokens
and every step's logits must be bit-identical (the onloaded pages are the same bytes, so nothing may differ).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import hf_rocketkv
from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model

GIB = 2**30


def run(model, pool, config, ids, new_tokens):
    cache = RocketKVCache(config, pool=pool)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=True,
                         output_scores=True, return_dict_in_generate=True)
    stats = cache.stats.as_dict()
    cache.close()
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.scores).float().cpu(), stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    torch.set_grad_enabled(False)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "runs": {}}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(TINY if args.quick else LLAMA_31_8B, None if args.quick else args.layers, dtype, device,
                            seed=0)
        hf_rocketkv.enable(model)
        config = RocketKVConfig(backend="triton" if device.type == "cuda" else "torch")
        if args.quick:
            config = config.replace(prompt_budget=64, window_size=8, kernel_size=7, topk=8)
            args.prefix, args.suffix = 256, 32
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prefix = torch.randint(3, vocab, (1, args.prefix), generator=g)
        tail = [torch.randint(3, vocab, (1, args.suffix), generator=g) for _ in range(2)]
        cold = torch.cat([prefix, tail[0]], 1).to(device)
        ids = torch.cat([prefix, tail[1]], 1).to(device)

        def hit(to_host: bool):
            """A fresh pool: the cold request stores the prefix, then ``ids`` hits it (after an evict to host)."""
            pool = KVBlockPool(model.config, max_gpu_bytes=int((4 if not args.quick else 0.05) * GIB),
                               host_bytes=int((4 if not args.quick else 0.05) * GIB), page_size=16, dtype=dtype,
                               kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=device)
            run(model, pool, config, cold, 2)
            evicted = 0
            if to_host:
                evicted = pool.evict()
                pool.synchronize()
            return run(model, pool, config, ids, args.new_tokens) + (evicted,)

        dev_tokens, dev_scores, dev_stats, _ = hit(False)
        host_tokens, host_scores, host_stats, evicted = hit(True)
        result = {"evicted_pages": evicted, "device_hit": dev_stats, "host_hit": host_stats,
                  "tokens_equal": dev_tokens == host_tokens,
                  "logits_bit_equal": bool(torch.equal(dev_scores, host_scores)),
                  "max_abs_logit_diff": float((dev_scores - host_scores).abs().max())}
        report["runs"][str(dtype)] = result
        print(str(dtype), json.dumps(result), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "onload_exact_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
