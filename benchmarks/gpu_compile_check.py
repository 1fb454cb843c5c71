"""GPU check of the static-shape decode (issue 4): generate() auto-compiles RocketKV decode steps (CUDA graphs).

    PYTHONPATH=. python benchmarks/gpu_compile_check.py [--layers 2] [--context 4096]

Llama-3.1-8B layer shapes, random bf16 weights. For batch 1 and 4 (left-padded): eager RocketKV decode
(disable_compile=True) vs transformers' automatic compile (mode "reduce-overhead"), same tokens expected; counts
dynamo graphs and recompiles over two requests of the same shapes; times decode ms/token of both. Prints a JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._dynamo.utils as dynamo_utils
from transformers import LlamaConfig, LlamaForCausalLM

import hf_rocketkv
from hf_rocketkv import RocketKVCache, RocketKVConfig


class StepTimer:
    """A logits processor that records a timestamp per generated token (after a device sync)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores

    def ms_per_token(self, drop: int = 3) -> float:
        gaps = [b - a for a, b in zip(self.times[drop:], self.times[drop + 1 :])]
        gaps.sort()
        return 1000 * gaps[len(gaps) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=4096, num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, pad_token_id=0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=getattr(torch, args.dtype)).eval()
    hf_rocketkv.enable(model)
    rocket = RocketKVConfig(prompt_budget=2048, topk=64, page_size=4)
    results = []
    for batch in (1, 4):
        ids = torch.randint(3, config.vocab_size, (batch, args.context), device="cuda")
        mask = torch.ones_like(ids)
        if batch > 1:
            mask[1:, : args.context // 8] = 0  # left padding on the other rows
            ids[1:, : args.context // 8] = 0
        gen = dict(attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                   pad_token_id=0)
        timer = StepTimer()
        eager = model.generate(ids, past_key_values=RocketKVCache(rocket), disable_compile=True,
                               logits_processor=[timer], **gen)
        eager_ms = timer.ms_per_token()
        dynamo_utils.counters.clear()
        outs, times = [], []
        for _ in range(2):  # the second request of the same shapes must not recompile
            timer = StepTimer()
            outs.append(model.generate(ids, past_key_values=RocketKVCache(rocket), logits_processor=[timer], **gen))
            times.append(timer.ms_per_token())
        stats = dict(dynamo_utils.counters["stats"])
        row = dict(batch=batch, context=args.context, layers=args.layers,
                   same_tokens_first=bool(torch.equal(outs[0], eager)), same_tokens_second=bool(torch.equal(outs[1], eager)),
                   matching_token_fraction=float((outs[0] == eager).float().mean()),
                   unique_graphs=stats.get("unique_graphs"), recompiles=dict(dynamo_utils.counters["recompiles"]),
                   graph_breaks=dict(dynamo_utils.counters["graph_break"]),
                   eager_ms_per_token=eager_ms, compiled_ms_per_token=times[1])
        row["dtype"] = args.dtype
        row.update(deferred_stop(model, ids, gen, rocket))
        row.update(static_vs_dynamic(model, ids, gen))
        hf_rocketkv.enable(model)
        results.append(row)
        print(json.dumps(row), flush=True)


def deferred_stop(model, ids, gen, rocket) -> dict:
    """generate() with transformers' deferred stop check (RocketKVConfig.deferred_stop_check, default on CUDA) vs the
    per-step check: same tokens, and after an EOS stop (one extra step, undone by crop) the same cache state."""
    plain = rocket.replace(deferred_stop_check=False)
    reference = model.generate(ids, past_key_values=RocketKVCache(plain), **gen)
    deferred = model.generate(ids, past_key_values=RocketKVCache(rocket), **gen)
    eos = int(reference[0, ids.shape[1] + 5])  # row 0 stops at its 6th token
    stopped = {}
    for name, config in (("plain", plain), ("deferred", rocket)):
        cache = RocketKVCache(config)
        out = model.generate(ids, past_key_values=cache, **(gen | dict(eos_token_id=eos)))
        stopped[name] = (out, cache.get_seq_length(), cache.kept_tokens(0), cache.layers[0].lengths.clone())
    same_state = all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                     for a, b in zip(stopped["plain"], stopped["deferred"]))
    return dict(deferred_same_tokens=bool(torch.equal(reference, deferred)), deferred_eos_same_tokens_and_cache=same_state,
                eos_stop_length=int(stopped["plain"][0].shape[1]))


def static_vs_dynamic(model, ids, gen) -> dict:
    """What compilation alone does to greedy tokens: transformers' StaticCache+compile vs eager DynamicCache."""
    model.set_attn_implementation("sdpa")
    dynamic = model.generate(ids, disable_compile=True, **gen)
    static = model.generate(ids, cache_implementation="static", **gen)
    return dict(static_compile_vs_dynamic_eager_matching_fraction=float((static == dynamic).float().mean()))


if __name__ == "__main__":
    main()
