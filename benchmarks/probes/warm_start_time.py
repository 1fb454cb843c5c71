"""Cold vs warm process: first generate() time with and without saved compile artifacts.

    python -m benchmarks.probes.warm_start_time --out $OUT [--regions] [--layers 32]

Three fresh processes on the same random Llama-3.1-8B-shaped model (batch 1, 4k prompt, 32 new tokens): (1) cold, with
an empty cache folder, which also warms up and saves the artifacts (hf_rocketkv.warmup); (2) warm: a new process that
calls hf_rocketkv.use_compile_cache(folder) first; (3) the same warm process's second call (nothing left to compile).
Reported: wall time of each first call and of a steady call, so "compile work" = first call - steady call.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
import hf_rocketkv
from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model
cache_dir, mode, regions, layers = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
found = hf_rocketkv.use_compile_cache(cache_dir)
model = build_model(LLAMA_31_8B, layers, torch.bfloat16, torch.device("cuda"), 0)
hf_rocketkv.enable(model)
if regions:
    hf_rocketkv.compile_regions(model)
config = RocketKVConfig(backend="triton")
ids = torch.randint(3, 128000, (1, 4096), device="cuda")
def call():
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=RocketKVCache(config),
                       max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize(); return time.perf_counter() - t0
first = call(); second = call()
saved = hf_rocketkv.warmup(model, config, cache_dir=cache_dir, batch_sizes=(1,), prompt_tokens=4096) if mode == "cold" else None
print(json.dumps(dict(mode=mode, regions=regions, first_call_s=first, second_call_s=second,
                      compile_work_s=first - second, found=found,
                      artifact_bytes=None if saved is None else saved["artifact_bytes"])))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out")
    p.add_argument("--regions", action="store_true")
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("cold", "warm"):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CHILD, folder, mode, "1" if args.regions else "0",
                                   str(args.layers)], capture_output=True, text=True, timeout=400)
            line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            entry = json.loads(line[-1]) if line else dict(mode=mode, error=done.stderr[-3000:])
            entry["process_s"] = time.perf_counter() - t0
            results.append(entry)
            print(json.dumps(entry), flush=True)
            (out / "warm_start_time.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
