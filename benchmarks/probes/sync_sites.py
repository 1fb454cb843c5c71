"""Every host-device synchronisation on the prefill, prefix-hit and decode paths, counted by call site (GPU only).

    python -m benchmarks.probes.sync_sites --out $OUT --layers 2

``torch.cuda.set_sync_debug_mode("warn")`` makes each synchronising call (``.item()``, ``.tolist()``, ``nonzero``,
``torch.equal``, a pageable host-to-device copy) raise a warning; this script turns each warning into its innermost
hf_rocketkv stack frames and counts them per phase: a cold prefill on a ``KVBlockPool``, a prefix hit, and three
decode steps. Llama-3.1-8B shapes (``--layers`` of them: per-layer sites repeat once per layer), random weights.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

import hf_rocketkv
from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model

GIB = 2**30


def site_of(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames in hf_rocketkv (or the benchmark), as 'file:line func' joined by ' < '."""
    ours = [f for f in stack if "hf_rocketkv" in f.filename and "sync_sites" not in f.filename]
    frames = ours[-3:][::-1]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames) or "outside hf_rocketkv"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffix", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sync_sites.py needs a GPU (sync debug mode is CUDA's)")
        sys.exit(2)
    device = torch.device("cuda")
    torch.set_grad_enabled(False)
    model = build_model(LLAMA_31_8B, args.layers, torch.bfloat16, device, seed=0)
    hf_rocketkv.enable(model)
    config = RocketKVConfig(backend="triton")
    pool = KVBlockPool(model.config, max_gpu_bytes=4 * GIB, page_size=16, dtype=torch.bfloat16,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=device)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefix = torch.randint(3, vocab, (1, args.prefix), generator=g)

    def prompt():
        return torch.cat([prefix, torch.randint(3, vocab, (1, args.suffix), generator=g)], 1).to(device)

    def request(ids, new_tokens: int):
        cache = RocketKVCache(config, pool=pool)
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                       do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=True)
        cache.close()

    phases = {"cold_prefill": lambda: request(prompt(), 1), "prefix_hit_prefill": lambda: request(prompt(), 1),
              "hit_prefill_plus_3_decode_steps": lambda: request(prompt(), 4)}
    other = torch.randint(3, vocab, (1, args.prefix + args.suffix), generator=g).to(device)
    request(other, 4)  # warm-up (Triton JIT, allocator) on another prompt: the first phase is a cold prefill
    request(torch.cat([other[:, : args.prefix], prompt()[:, args.prefix:]], 1), 4)  # and the hit path's JIT
    report: dict = {"layers": args.layers, "prefix": args.prefix, "suffix": args.suffix, "phases": {}}
    for name, fn in phases.items():
        counts: collections.Counter = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
            counts[site_of(traceback.extract_stack()[:-1])] += 1

        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        report["phases"][name] = {"total": sum(counts.values()), "sites": counts.most_common()}
        print(f"=== {name}: {sum(counts.values())} syncs")
        for site, n in counts.most_common(40):
            print(f"{n:5d}  {site}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_sites.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
