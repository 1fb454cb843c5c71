"""Host time of an EAGER decode step per function, on a GPU (target: eager decode <= 30 ms/token at batch 1).

    python -m benchmarks.probes.decode_host_time --out $OUT            # H100 / H200: about a minute
    python -m benchmarks.probes.decode_host_time --quick --out out     # CPU smoke run (tiny model)

Without CUDA graphs a decode step is host-bound: the GPU waits for the launches. generate() runs with
``disable_compile=True`` on RocketKVCache (Triton backend) and on DynamicCache (the model's own host cost), after a
warm-up call. Reported: ms/token of each (median gap between tokens, CUDA events), their difference per layer, and a
cProfile of ``--profile-steps`` decode steps of the RocketKV run (cProfile inflates Python-heavy code: read the
ranking and the shares, not the absolute values): the functions with the most own time, and the hf_rocketkv functions
with the most cumulative time. Writes ``decode_host_time.json`` under --out.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
from pathlib import Path

import torch
from transformers import LogitsProcessorList

import hf_rocketkv
from hf_rocketkv import RocketKVCache
from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, StepClock, build_model
from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.integration.registration import enable

from benchmarks.probes.prefill_host_time import function_name, stats_rows


class ProfileSteps:
    """Logits processor: cProfile on from decode step ``first`` for ``steps`` steps."""

    def __init__(self, profile: cProfile.Profile, first: int, steps: int):
        self.profile, self.first, self.steps, self.seen = profile, first, steps, 0

    def __call__(self, input_ids, scores):
        self.seen += 1
        if self.seen == self.first:
            self.profile.enable()
        elif self.seen == self.first + self.steps:
            self.profile.disable()
        return scores


def own_time_difference(rocket: cProfile.Profile, dynamic: cProfile.Profile, steps: int) -> list[dict]:
    """Per function, own time per step in the RocketKV run minus the DynamicCache run (same steps), largest first."""
    a, b = pstats.Stats(rocket).stats, pstats.Stats(dynamic).stats
    rows = []
    for key in set(a) | set(b):
        own_a, own_b = (a[key][2] if key in a else 0.0), (b[key][2] if key in b else 0.0)
        rows.append(dict(function=function_name(key),
                         ms_per_step=round((own_a - own_b) * 1e3 / steps, 3),
                         calls_rocketkv=(a[key][1] if key in a else 0) // steps,
                         calls_dynamic=(b[key][1] if key in b else 0) // steps))
    return sorted(rows, key=lambda r: -abs(r["ms_per_step"]))


def run(model, ids, cache, new_tokens: int, processors=()) -> float:
    clock = StepClock(ids.device)
    clock.start()
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, eos_token_id=None, disable_compile=True,
                  logits_processor=LogitsProcessorList([clock, *processors]))
    if cache is not None:
        enable(model)
        kwargs["cache"] = cache  # generate() takes cache= on every supported transformers once hf_rocketkv is imported
    else:
        model.set_attn_implementation("sdpa")
    model.generate(ids, **kwargs)
    times = clock.seconds()
    return statistics.median([b - a for a, b in zip(times, times[1:])][3:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three main rows")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as bench_decode: cuDNN re-plans per KV length when eager
    shapes = TINY if args.quick else LLAMA_31_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(shapes, args.layers, dtype, device, seed=0)
    layers = model.config.num_hidden_layers
    if args.quick:
        config = RocketKVConfig(prompt_budget=48, window_size=8, kernel_size=7, topk=4, page_size=4, backend="torch")
        args.context, args.new_tokens, args.profile_steps = 96, 12, 4
    else:
        config = RocketKVConfig(backend="triton")
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), device=device)
    for _ in range(2):  # warm-up: Triton compiles, cuBLAS plans, allocator
        run(model, ids, RocketKVCache(config), 8)
        run(model, ids, None, 8)
    # interleaved rounds: the device hosts drift within minutes, so each round measures every row back to back
    rounds = {"dynamic": [], "rocketkv": [], "rocketkv_rope_off": []}
    for _ in range(args.rounds):
        rounds["dynamic"].append(run(model, ids, None, args.new_tokens))
        rounds["rocketkv"].append(run(model, ids, RocketKVCache(config), args.new_tokens))
        rounds["rocketkv_rope_off"].append(run(model, ids, RocketKVCache(config.replace(fused_rope=False)),
                                               args.new_tokens))
    dynamic_ms, rocket_ms, rope_off_ms = (statistics.median(rounds[k]) for k in rounds)
    plain_ms = run(model, ids, RocketKVCache(config.replace(eager_layer_graphs=False)), args.new_tokens)
    profile = cProfile.Profile()
    run(model, ids, RocketKVCache(config), args.new_tokens, [ProfileSteps(profile, 4, args.profile_steps)])
    rows = stats_rows(profile, rows=40)
    dynamic_profile = cProfile.Profile()  # the same steps on DynamicCache: where RocketKV's extra host time is
    run(model, ids, None, args.new_tokens, [ProfileSteps(dynamic_profile, 4, args.profile_steps)])
    rows["own_time_difference"] = own_time_difference(profile, dynamic_profile, args.profile_steps)
    report = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, layers=layers, context=args.context,
                  eager_ms_per_token=dict(rocketkv=rocket_ms, rocketkv_without_layer_graphs=plain_ms,
                                          rocketkv_without_fused_rope=rope_off_ms, dynamic=dynamic_ms),
                  rounds=rounds,
                  rocketkv_extra_ms_per_layer=(rocket_ms - dynamic_ms) / layers, profiled_steps=args.profile_steps,
                  cprofile=rows)
    print("rounds (ms/token):", {k: [round(v, 2) for v in vals] for k, vals in rounds.items()})
    print(f"eager ms/token: RocketKV {rocket_ms:.2f} (fused_rope=False: {rope_off_ms:.2f}; "
          f"eager_layer_graphs=False: {plain_ms:.2f}), DynamicCache "
          f"{dynamic_ms:.2f}; RocketKV adds "
          f"{(rocket_ms - dynamic_ms) / layers * 1e3:.0f} us per layer ({layers} layers)")
    for r in rows["hf_rocketkv_by_cumulative"][:30]:
        print(f"  {r['cumulative_ms'] / args.profile_steps:8.3f} ms/step cum {r['own_ms'] / args.profile_steps:8.3f} "
              f"own {r['calls'] // args.profile_steps:5d} calls  {r['function']}")
    print("by own time:")
    for r in rows["by_own_time"][:30]:
        print(f"  {r['own_ms'] / args.profile_steps:8.3f} ms/step own {r['calls'] // args.profile_steps:5d} calls  "
              f"{r['function']}")
    print("own time per step, RocketKV minus DynamicCache (largest differences):")
    for r in rows["own_time_difference"][:25]:
        print(f"  {r['ms_per_step']:+8.3f} ms/step {r['calls_rocketkv']:5d} vs {r['calls_dynamic']:5d} calls  "
              f"{r['function']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_host_time.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
