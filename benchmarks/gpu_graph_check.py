"""GPU check of decode_runner="cuda_graphs" (integration/decode_graphs.py) against eager decode and torch.compile.

Llama-3.1-8B shapes (fewer layers by default), random bf16 weights. For each batch size: greedy tokens of eager decode,
of CUDA-graph decode (must be bit-identical: the same kernels, replayed) and of torch.compile decode (inductor; close,
not identical in bf16), with decode ms/token, the first call's wall time and the number of captures. Never stops at
the first failure; writes JSON to --out.

    PYTHONPATH=. python benchmarks/gpu_graph_check.py --layers 8 --context 4096 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig, enable
from hf_rocketkv.bench.decode import LLAMA_31_8B, StepClock, build_model


def generate(model, ids, config, new_tokens, compiled: bool):
    from transformers import LogitsProcessorList

    clock = StepClock(ids.device)
    cache = RocketKVCache(config)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    clock.start()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, disable_compile=not compiled,
        logits_processor=LogitsProcessorList([clock]),
    )
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    times = clock.seconds()
    steps = sorted(b - a for a, b in zip(times[3:], times[4:]))
    step = cache.hints.graphed_step
    return out[:, ids.shape[1]:], dict(
        wall_s=wall, ttft_s=times[0], ms_per_token=steps[len(steps) // 2] * 1e3 if steps else None,
        graph_replays=getattr(step, "replays", None),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", default="out")
    p.add_argument("--regions", action="store_true", help="also run cuda_graphs after hf_rocketkv.compile_regions")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(LLAMA_31_8B, args.layers, torch.bfloat16, torch.device("cuda"), 0)
    enable(model)
    base = RocketKVConfig(backend="triton")
    report = dict(args=vars(args), device=torch.cuda.get_device_name(), torch=torch.__version__, runs=[])
    for batch in args.batches:
        ids = torch.randint(3, LLAMA_31_8B["vocab_size"], (batch, args.context), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(batch))
        results = {}
        for name, config, compiled in (
            ("eager", base, False),
            ("cuda_graphs", base.replace(decode_runner="cuda_graphs"), True),
            ("cuda_graphs_again", base.replace(decode_runner="cuda_graphs"), True),
            ("torch_compile", base.replace(decode_runner="torch_compile"), True),
        ):
            try:
                tokens, timing = generate(model, ids, config, args.new_tokens, compiled)
                results[name] = (tokens, timing)
                entry = dict(batch=batch, runner=name, **timing)
                if "eager" in results and name != "eager":
                    entry["tokens_equal_eager"] = float((tokens == results["eager"][0]).float().mean())
                report["runs"].append(entry)
                print(json.dumps(entry), flush=True)
            except Exception as err:  # record and go on: one GPU run must tell everything
                entry = dict(batch=batch, runner=name, error=repr(err)[:500], trace=traceback.format_exc()[-3000:])
                report["runs"].append(entry)
                print(json.dumps(entry)[:2000], flush=True)
            (out / "gpu_graph_check.json").write_text(json.dumps(report, indent=1))
    if args.regions:
        from hf_rocketkv import compile_regions

        t0 = time.perf_counter()
        compile_regions(model)
        for batch in args.batches:
            ids = torch.randint(3, LLAMA_31_8B["vocab_size"], (batch, args.context), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(batch))
            for name in ("regions_first", "regions_again"):
                try:
                    _, timing = generate(model, ids, base.replace(decode_runner="cuda_graphs"), args.new_tokens, True)
                    entry = dict(batch=batch, runner=name, since_compile_regions_s=time.perf_counter() - t0, **timing)
                except Exception as err:
                    entry = dict(batch=batch, runner=name, error=repr(err)[:500], trace=traceback.format_exc()[-3000:])
                report["runs"].append(entry)
                print(json.dumps(entry)[:2000], flush=True)
                (out / "gpu_graph_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
