"""Which Triton kernels compile during each request of a sequence (GPU only): a cold 8k + 256 request on a pool, then
prefix hits with max_new_tokens 32, 1, 1, 7, 100, 100. A kernel that compiles again for a new max_new_tokens shows up
under that request (Triton's in-memory cache misses, seen through ``triton.knobs.runtime.jit_cache_hook``).

    python -m benchmarks.probes.triton_compiles      # H100: about 40 s after the model is built

Prints one JSON object per request: wall and TTFT seconds, reused tokens, the compiled kernels' signatures.
"""

from __future__ import annotations

import json
import time

import torch
from triton import knobs

from hf_rocketkv import KVBlockPool, RocketKVCache

from benchmarks.bench_prefix_reuse import generate, setup

SEQUENCE = (("cold", 32), ("hit", 32), ("hit", 1), ("hit", 1), ("hit", 7), ("hit", 100), ("hit", 100))


def main() -> None:
    compiled: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["repr"][:400])  # returns None: compile goes on
    device = torch.device("cuda")
    torch.set_grad_enabled(False)
    config, dtype, model = setup(device, False)
    pool = KVBlockPool(model.config, max_gpu_bytes=8 << 30, page_size=16, dtype=dtype, kt_page_size=config.page_size,
                       kt_dtype=config.kt_cache_dtype, device=device)
    vocab = model.config.vocab_size
    prefix = torch.randint(3, vocab, (1, 8192), generator=torch.Generator().manual_seed(0))
    for seed, (phase, new_tokens) in enumerate(SEQUENCE, start=1):
        own = torch.randint(3, vocab, (1, 256), generator=torch.Generator().manual_seed(seed))  # a fresh suffix
        ids = torch.cat([prefix, own], dim=1).to(device)
        before = len(compiled)
        torch.cuda.synchronize()
        start = time.perf_counter()
        cache = RocketKVCache(config, pool=pool)
        result = generate(model, ids, cache, new_tokens)
        cache.close()
        torch.cuda.synchronize()
        print(json.dumps(dict(phase=phase, new_tokens=new_tokens, wall_s=round(time.perf_counter() - start, 3),
                              ttft_s=round(result["ttft_s"], 4), reused=result["stats"]["reused_tokens"],
                              compiled=compiled[before:])), flush=True)


if __name__ == "__main__":
    main()
