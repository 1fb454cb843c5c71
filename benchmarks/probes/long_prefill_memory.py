"""Does a batch-1 prefill of 128k tokens fit on one GPU, with and without generate's chunked prefill?

    python -m benchmarks.probes.long_prefill_memory --context 128000 --chunk 8192 --out out/long

Llama-3.1-8B shapes, random bf16 weights, RocketKVConfig() defaults (budget 2048, topk 64, page 4). For each mode
(RocketKV with prefill_chunk_size, RocketKV in one forward, and DynamicCache with the same chunks for reference):
peak GiB (torch.cuda.max_memory_allocated), prefill seconds, decode ms/token (compiled decode for RocketKV), kept
tokens per KV head. An out-of-memory error is recorded, not raised. Prints and writes JSON lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from transformers import LogitsProcessorList

import hf_rocketkv
from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.bench.decode import LLAMA_31_8B, StepClock, build_model


def run_mode(model, mode: str, ids: torch.Tensor, chunk: int, new_tokens: int) -> dict:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=0, attention_mask=torch.ones_like(ids))
    if mode.endswith("chunked"):
        kwargs["prefill_chunk_size"] = chunk
    cache = None
    if mode.startswith("rocketkv"):
        hf_rocketkv.enable(model)
        cache = RocketKVCache(RocketKVConfig(backend="triton"))
        kwargs["cache"] = cache  # generate() takes cache= on every supported transformers once hf_rocketkv is imported
    else:
        model.set_attn_implementation("sdpa")
        kwargs["disable_compile"] = True
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    row = dict(mode=mode, context=ids.shape[1], chunk=chunk if mode.endswith("chunked") else None)
    clock = StepClock(ids.device)
    try:
        model.generate(ids, logits_processor=LogitsProcessorList([clock]), **kwargs)
        times = clock.seconds()
        gaps = sorted(b - a for a, b in zip(times[3:], times[4:]))
        row.update(status="ok", prefill_s=times[0], decode_ms_per_token=gaps[len(gaps) // 2] * 1e3)
        if cache is not None:
            row["kept_tokens_per_kv_head"] = int(cache.kept_tokens(0).max())
            row["cache_gib"] = cache.memory_bytes() / 2**30
    except torch.cuda.OutOfMemoryError as err:
        row.update(status="out of memory", error=str(err)[:200])
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    model.set_attn_implementation("sdpa")
    del cache
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=128_000)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["rocketkv-chunked", "rocketkv", "dynamic-chunked"])
    parser.add_argument("--out", default="out/long_prefill")
    args = parser.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(LLAMA_31_8B, None, torch.bfloat16, torch.device("cuda"), seed=0)
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=torch.cuda.get_device_name(),
               total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30, torch=torch.__version__,
               weights_gib=sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30)
    print(json.dumps(env), flush=True)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), device="cuda")
    with (out / "long_prefill.jsonl").open("w") as f:
        f.write(json.dumps(env) + "\n")
        for mode in args.modes:
            row = run_mode(model, mode, ids, args.chunk, args.new_tokens)
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
