"""Where one prompt's prefill of a hybrid model (gpt-oss, Gemma 3) spends its time, on a GPU, and what the attention
of its layers costs on each path.

    python -m benchmarks.probes.profile_hybrid_prefill --model gpt-oss-20b --prompt-len 8192 --out $OUT/prefill

Random bf16 weights of the published shapes (``benchmarks/hybrid_decode.py``). One prompt through a
``RocketKVCache(RocketKVConfig())`` forward under the config's fused paths (``logits_to_keep=1``: the batching
engine's prefill of one chunk, stage 1 included): the median of ``--repeats`` after a warm-up (CUDA events), then one under torch.profiler, by kind
of kernel (``profile_hybrid_step.kind_of``) with the top kernels. Then one layer's first-forward attention at the
model's shapes, timed per path: ``spans`` (``attend_in_spans`` + ``featured_attention``, what a layer with sinks
runs; SDPA under the span's mask for a plain layer, Gemma 3's) at several query blocks, a plain full-attention layer
as one causal SDPA call, and the model's full-attention layer through ``cudnn_causal_attention`` with its sinks
(``with_sinks``) where the model has sinks and no cap. Writes ``profile_hybrid_prefill.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import hf_rocketkv
from benchmarks.hybrid_decode import MODELS, build_model
from benchmarks.probes.engine_decode_profile import kernel_totals
from benchmarks.probes.profile_hybrid_step import kind_of
from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.integration.attention import attend_in_spans
from hf_rocketkv.integration.causal_prefill import cudnn_causal_attention
from hf_rocketkv.integration.fused_modeling import fused_modeling
from hf_rocketkv.selection.logit_features import LogitFeatures, featured_attention


def median_ms(fn, repeats: int, device: torch.device | None = None) -> float:
    """The median time of ``fn()`` in ms over ``repeats`` calls after one warm-up: CUDA events, or the wall clock
    where ``device`` is not a GPU (a ``--quick`` smoke on the CPU)."""
    fn()
    on_gpu = device is None or device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def by_kind(profiler) -> dict:
    """GPU busy ms, kernels, both by kind of kernel, and the top 25 kernels of one profiled call."""
    count, micros = kernel_totals(profiler)
    kinds_us, kinds_n = collections.Counter(), collections.Counter()
    for name, us in micros.items():
        kinds_us[kind_of(name)] += us
        kinds_n[kind_of(name)] += count[name]
    top = sorted(micros, key=micros.get, reverse=True)[:25]
    return dict(gpu_busy_ms=sum(micros.values()) / 1e3, kernels=sum(count.values()),
                by_kind={k: dict(ms=us / 1e3, kernels=kinds_n[k]) for k, us in kinds_us.most_common()},
                top=[dict(name=n[:120], kind=kind_of(n), calls=count[n], ms=micros[n] / 1e3) for n in top])


def prefill_profile(model, prompt_len: int, repeats: int, device) -> dict:
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (1, prompt_len), device=device)

    config = RocketKVConfig()

    def prefill():
        cache = RocketKVCache(config, model_config=model.config)
        with torch.no_grad(), fused_modeling(model, config):  # as the engine's prefill chunks run
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    ms = median_ms(prefill, repeats)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        prefill()
        torch.cuda.synchronize()
    return dict(prefill_ms=ms, profile=by_kind(prof), ops=by_op(prof))


def by_op(profiler, top: int = 40) -> list[dict]:
    """The aten ops with the most device time of their own, each with the model code that called it (the innermost
    frames of its stack outside torch)."""
    rows = []
    for avg in profiler.key_averages(group_by_stack_n=6):
        device_us = getattr(avg, "self_device_time_total", 0.0)
        if device_us <= 0:
            continue
        frames = [f for f in (avg.stack or []) if "torch/" not in f][:3]
        rows.append(dict(op=avg.key, calls=avg.count, device_ms=device_us / 1e3, stack=frames))
    return sorted(rows, key=lambda r: r["device_ms"], reverse=True)[:top]


def attention_paths(model, prompt_len: int, repeats: int, device) -> list[dict]:
    text = model.config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = text.sliding_window
    sinks = next((m.sinks.detach() for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)),
                 None)
    cap = getattr(text, "attn_logit_softcapping", None)
    features = LogitFeatures(softcap=cap, sinks=sinks)
    torch.manual_seed(0)
    q = torch.randn(1, heads, prompt_len, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, prompt_len, dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scaling = dim ** -0.5
    rows = []

    def attend(qq, kk, vv, mask):
        from hf_rocketkv.selection.logit_features import allowed_of
        if features.plain:  # what transformers' sdpa runs for a plain layer (Gemma 3): SDPA under the span's mask
            out = torch.nn.functional.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=None if mask is None else allowed_of(mask), is_causal=mask is None,
                scale=scaling, enable_gqa=True)
            return out.transpose(1, 2)
        return featured_attention(qq, kk, vv, None if mask is None else allowed_of(mask), scaling, features)

    for layer, span_window in (("full", None), ("sliding", window)):
        if features.plain and span_window is None:  # a plain full-attention layer: one causal SDPA call (flash)
            rows.append(dict(layer=layer, path="sdpa causal", ms=median_ms(lambda: attend(q, k, v, None), repeats)))
            continue
        mask = None
        if span_window is not None:
            i = torch.arange(prompt_len, device=device)
            allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - span_window)
            mask = torch.where(allowed, 0.0, float("-inf")).to(torch.bfloat16)[None, None]
        for block in (2048, 1024, 512, 256):
            if span_window is not None and block < span_window:
                continue
            ms = median_ms(lambda: attend_in_spans(attend, q, k, v, mask, span_window, block), repeats)
            rows.append(dict(layer=layer, path="spans", block=block, ms=ms))
    if sinks is not None and cap is None:
        def sink_cudnn():
            return cudnn_causal_attention(q, k, v, scaling, 0, sinks)

        ms = median_ms(sink_cudnn, repeats)
        ref = attend_in_spans(attend, q, k, v, None, None, 2048)
        err = (sink_cudnn().float() - ref.float()).abs().max().item()
        rows.append(dict(layer="full", path="cudnn+lse sinks", ms=ms, max_abs_diff_vs_spans=err))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="gpt-oss-20b")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    device = torch.device("cuda")
    model, _ = build_model(args.model, False, None, torch.bfloat16, device)
    hf_rocketkv.enable(model)
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
    report = dict(commit=commit, command="python -m benchmarks.probes.profile_hybrid_prefill " + " ".join(sys.argv[1:]),
                  model=args.model, prompt_len=args.prompt_len, device=torch.cuda.get_device_name(),
                  date=datetime.date.today().isoformat(), torch=torch.__version__,
                  prefill=prefill_profile(model, args.prompt_len, args.repeats, device),
                  attention=attention_paths(model, args.prompt_len, args.repeats, device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_hybrid_prefill.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(dict(prefill_ms=report["prefill"]["prefill_ms"], by_kind=report["prefill"]["profile"]["by_kind"],
                          attention=report["attention"]), indent=1))


if __name__ == "__main__":
    main()
