"""``generate_batch`` twice on one model and pool, printing each call's output tokens/s as one JSON line.

    PYTHONPATH=<tree> python -m benchmarks.probes.engine_second_call --requests 32 --prompt-len 8192 --new-tokens 512

Llama-3.1-8B shapes, random bf16 weights, greedy with EOS ignored, a ``KVBlockPool`` of ``--pool-gib`` GiB; the
second call runs other random prompts of the same shape. It uses only names that every tree since the third wave
has (``hf_rocketkv.enable``, ``KVBlockPool``, ``generate_batch``, ``hf_rocketkv.bench.decode.build_model``), so
one device call can alternate an older tree with the current one (``scripts/tree_before_after.sh``).
"""

from __future__ import annotations

import argparse
import json

import torch


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--pool-gib", type=float, default=30.0)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)

    import hf_rocketkv
    from benchmarks.first_call import prompts, timed_call
    from hf_rocketkv import KVBlockPool
    from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model
    from hf_rocketkv.serving import SamplingParams

    model = build_model(LLAMA_31_8B, None, torch.bfloat16, torch.device("cuda"), 0)
    hf_rocketkv.enable(model)
    pool = KVBlockPool(model, max_gpu_bytes=int(args.pool_gib * 2**30))
    params = SamplingParams.greedy(args.new_tokens, ignore_eos=True)
    seconds = []
    for call in (1, 2):
        batch = prompts(args.requests, args.prompt_len, LLAMA_31_8B["vocab_size"], seed=call)
        seconds.append(timed_call(model, batch, pool, params, profile=False)[0])
    tokens = args.requests * args.new_tokens
    row = dict(label=args.label, workload=f"{args.requests} x {args.prompt_len} / {args.new_tokens}",
               seconds=seconds, first_call_tokens_per_s=tokens / seconds[0], tokens_per_s=tokens / seconds[1],
               peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    print("ENGINE " + json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
