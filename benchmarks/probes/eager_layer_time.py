"""Host microseconds of ONE decoder layer's eager decode step, split into its parts, on a GPU.

    python -m benchmarks.probes.eager_layer_time --out $OUT

decode_host_time.py ranks functions with cProfile, which inflates Python-heavy code; this times the parts without a
profiler, each called ``--calls`` times back to back on one layer (Llama-3.1-8B shapes, batch 1, a prompt of
``--context`` tokens prefilled into a RocketKVCache, the Triton backend; the GPU work per call is tiny, so the loop
is bound by the host):

    attention forward, RocketKV / DynamicCache   LlamaAttention.forward of a one-token step (projections, RoPE,
                                                 cache.update, the attention function, o_proj); RocketKV with
                                                 eager_layer_graphs off and on
    cache.update, RocketKV / DynamicCache        only the cache's update of that step (RocketKV: the append)
    attention function (rocketkv / sdpa)         only the attention interface call (RocketKV: top pages + sparse)
    ops                                          the three decode ops called directly
Writes ``eager_layer_time.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_rocketkv import RocketKVCache
from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model
from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.integration.attention import rocketkv_attention
from hf_rocketkv.integration.registration import enable

from benchmarks.probes.launch_overhead import per_call_us
from hf_rocketkv.integration.compat import cache_kwargs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--cprofile", action="store_true", help="also print a cProfile of 100 RocketKV forwards")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = build_model(LLAMA_31_8B, 1, torch.bfloat16, dev, seed=0)
    attn = model.model.layers[0].self_attn
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), device=dev)
    rotary = model.model.rotary_emb
    hidden = torch.randn((1, 1, model.config.hidden_size), device=dev, dtype=torch.bfloat16)
    position = torch.full((1, 1), args.context, device=dev, dtype=torch.long)
    cos_sin = rotary(hidden, position)
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, 128
    q = torch.randn((1, heads, 1, dim), device=dev, dtype=torch.bfloat16)
    k1 = torch.randn((1, kv_heads, 1, dim), device=dev, dtype=torch.bfloat16)
    rows = {}

    # RocketKV, with eager_layer_graphs off (every launch from Python) and on (default: per-layer CUDA graphs). Every
    # timed update appends a token: room for all of them from the start, as generate() gives (hints.max_length),
    # else the eager store would grow (gather and copy) as it fills
    enable(model)
    for graphs in (False, True):
        tag = "graphs on" if graphs else "graphs off"
        cache = RocketKVCache(RocketKVConfig(backend="triton", eager_layer_graphs=graphs))
        cache.hints.max_length = args.context + 4 * args.calls + 64
        with torch.no_grad():
            model(ids, **cache_kwargs(cache), use_cache=True)
        layer = cache.layers[0]

        def rocket_forward():
            with torch.no_grad():
                attn(hidden, cos_sin, attention_mask=None, past_key_values=cache)

        def rocket_update():
            key, _ = cache.update(k1, k1, 0)
            layer.attention_ran()
            return key

        key_handle = rocket_update()

        def rocket_attention():
            rocketkv_attention(attn, q, key_handle, key_handle, None, scaling=dim**-0.5)

        rows[f"attention forward, RocketKV ({tag})"] = per_call_us(rocket_forward, args.calls)
        if args.cprofile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(100):
                rocket_forward()
            torch.cuda.synchronize()
            profile.disable()
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
        rows[f"cache.update, RocketKV (append; {tag})"] = per_call_us(rocket_update, args.calls)
        rows[f"attention function rocketkv (top pages + sparse attention; {tag})"] = per_call_us(
            rocket_attention, args.calls)
    ops, store, config = layer.ops, layer.store, layer.config
    qg = q.reshape(1, kv_heads, heads // kv_heads, dim)
    idx, valid = ops.paged_top_pages(qg, store.kt, store.table, layer.lengths, config.page_size, config.topr,
                                     config.topk)
    rows["op paged_top_pages"] = per_call_us(lambda: ops.paged_top_pages(
        qg, store.kt, store.table, layer.lengths, config.page_size, config.topr, config.topk), args.calls)
    rows["op paged_sparse_decode_attention"] = per_call_us(lambda: ops.paged_sparse_decode_attention(
        qg, store.k, store.v, store.table, idx, valid, layer.lengths, config.page_size, dim**-0.5), args.calls)
    rows["op paged_append_token"] = per_call_us(lambda: ops.paged_append_token(
        store.k, store.v, store.kt, store.table, layer.positions, layer.lengths, layer.seen, k1[:, :, 0],
        k1[:, :, 0], config.page_size, k_scale=None, v_scale=None), args.calls)
    rows["aten add_ (one launch)"] = per_call_us(lambda: layer.seen.add_(0), args.calls)
    del cache

    # DynamicCache + sdpa
    model.set_attn_implementation("sdpa")
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_kwargs(dynamic), use_cache=True)

    def dynamic_forward():
        with torch.no_grad():
            attn(hidden, cos_sin, attention_mask=None, past_key_values=dynamic)

    rows["attention forward, DynamicCache + sdpa"] = per_call_us(dynamic_forward, min(args.calls, 100))
    keys, values = dynamic.update(k1, k1, 0)
    rows["cache.update, DynamicCache (torch.cat)"] = per_call_us(lambda: dynamic.update(k1, k1, 0), 100)
    keys, values = dynamic.layers[0].keys, dynamic.layers[0].values
    rows["attention function sdpa"] = per_call_us(
        lambda: sdpa_attention_forward(attn, q, keys, values, None, scaling=dim**-0.5), args.calls)
    rows = {name: round(us, 2) for name, us in rows.items()}
    for name, us in rows.items():
        print(f"{us:9.2f} us  {name}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name(), context=args.context, us_per_call=rows)
    (out / "eager_layer_time.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
