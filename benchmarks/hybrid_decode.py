"""Hybrid models (sliding-window + global layers) at long context: DynamicCache vs StaticCache+compile vs RocketKV.

    python -m benchmarks.hybrid_decode --out $OUT                         # both models, 32k prompt, one H100
    python -m benchmarks.hybrid_decode --models gpt-oss-20b --out $OUT    # one model (about 3 minutes)
    python -m benchmarks.hybrid_decode --context 100000 --out $OUT        # the 100k point
    python -m benchmarks.hybrid_decode --quick --out out/hybrid           # tiny shapes on the CPU (seconds)

Models, random bf16 weights (nothing is downloaded), the published configs' shapes:
    gpt-oss-20b   24 layers alternating sliding (window 128) / full, 64 query / 8 KV heads of 64, learned sinks,
                  MoE (32 experts, top 4); transformers has no sdpa for it (sinks): the dense rows run "eager"
    gemma-3-12b   48 layers, five sliding (window 1024) per full one, 16 query / 8 KV heads of 256; "sdpa"
``--layers N`` keeps the first N layers of the pattern (memory or time; the JSON says so).

Rows, one process, the same model and prompt (batch 1):
    dynamic          transformers' default cache for hybrid models (DynamicCache: DynamicSlidingWindowLayer for the
                     sliding layers), eager decode
    static-compile   ``cache_implementation="static"`` (transformers' static hybrid layers), decode compiled by
                     generate (CompileConfig "reduce-overhead": CUDA graphs); CUDA only, skipped with the reason else
    rocketkv         RocketKVCache(RocketKVConfig()) defaults (budget 2048, topk 64 pages of 4, fp8 KT) through the
                     default decode runner (each request's decode step captured as a CUDA graph)
    rocketkv-eager   the same, every decode step eager (generate(disable_compile=True)): what the graphs save
    rocketkv-compile the same with ``decode_runner="torch_compile"`` (the decode step compiled by inductor, one graph
                     per batch bucket; its compilation is in the row's ``wall_s`` and first gaps, not the median)
    rocketkv-experts-off / rocketkv-mlp-off / rocketkv-qkv-off / rocketkv-residual-off  the defaults with
                     ``fused_experts=False`` / ``fused_mlp=False`` / ``fused_qkv=False`` / ``fused_residual=False``
                     (transformers' own experts / gated-MLP / attention / decoder-layer forward in the decode step);
                     opt-in, as rocketkv-compile
    rocketkv-stop-sync the defaults with ``deferred_stop_check=False``: generate() reads the stop flag on the host
                     after every step (what it does for other caches on CUDA); opt-in
The dense rows of gpt-oss prefill in chunks of ``--dense-prefill-chunk`` tokens (generate's prefill_chunk_size; with
the static cache generate compiles the chunk's forward too): transformers' eager attention would otherwise hold
64 x 32k x 32k logits at once (1024: ~13 GiB of them per chunk). Gemma 3's dense rows (sdpa) prefill in one forward
unless ``--dense-prefill-chunk`` is given (at 100k one forward's sliding mask alone is 18.6 GiB).
RocketKV prefills in one forward (sinks through PyTorch's SDPA, ``selection/logit_features.sink_attention``).

Columns: ``ttft_s`` (generate's first token: prefill, stage 1 and the first sampling), ``decode_ms_per_token``
(median gap between consecutive tokens from CUDA events, the first ``DROP_FIRST_STEPS`` gaps left out: capture and
compilation), ``peak_gib`` (torch.cuda.max_memory_allocated during the call), ``kv_bytes`` (every tensor of the
request's cache after the call: K/V, and for RocketKV its KT pages, positions and lengths) split into
``kv_bytes_global`` / ``kv_bytes_sliding``; ``ratios`` per model: dynamic / rocketkv decode time, rocketkv / dynamic
KV bytes, and the same against static-compile. Writes ``hybrid_decode.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

import hf_rocketkv
from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.bench.decode import DROP_FIRST_STEPS, StepClock, step_timings
from hf_rocketkv.integration import compat
from hf_rocketkv.integration.call_state import call_state

CACHES = ("dynamic", "static-compile", "rocketkv", "rocketkv-eager", "rocketkv-compile", "rocketkv-experts-off",
          "rocketkv-mlp-off", "rocketkv-qkv-off", "rocketkv-residual-off", "rocketkv-stop-sync")
# rows run only when asked (--caches)
OPT_IN = ("rocketkv-compile", "rocketkv-experts-off", "rocketkv-mlp-off", "rocketkv-qkv-off", "rocketkv-residual-off",
          "rocketkv-stop-sync")


def gpt_oss_20b(quick: bool) -> tuple:
    from transformers import GptOssConfig, GptOssForCausalLM

    shapes = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                  num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072)
    if quick:
        shapes.update(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)
    return GptOssConfig, GptOssForCausalLM, shapes, "eager"


def gemma_3_12b(quick: bool) -> tuple:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    shapes = dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                  sliding_window=1024, max_position_embeddings=131072)
    if quick:
        shapes.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16)
    return Gemma3TextConfig, Gemma3ForCausalLM, shapes, "sdpa"


def llama_3_1_8b(quick: bool) -> tuple:
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072)
    if quick:
        shapes.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    return LlamaConfig, LlamaForCausalLM, shapes, "sdpa"


MODELS = {"gpt-oss-20b": gpt_oss_20b, "gemma-3-12b": gemma_3_12b}
REFERENCE_MODELS = {"llama-3.1-8b": llama_3_1_8b}  # not hybrid: the probes' side-by-side reference (build_model)


def build_model(name: str, quick: bool, layers: int | None, dtype: torch.dtype, device: torch.device):
    """The model with random weights (seed 0) on ``device``, and the attention its dense rows use."""
    config_cls, model_cls, shapes, dense_attention = {**MODELS, **REFERENCE_MODELS}[name](quick)
    config = config_cls(**shapes, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if layers is not None:
        if layers < 1 or layers > config.num_hidden_layers:
            raise ValueError(f"--layers must be in 1..{config.num_hidden_layers} for {name}, got {layers}")
        kinds = list(config.layer_types[:layers])
        if "full_attention" not in kinds:
            raise ValueError(f"--layers {layers}: {name}'s first {layers} layers are all sliding; RocketKV would "
                             f"compress nothing (its first full-attention layer is layer "
                             f"{config.layer_types.index('full_attention')})")
        config.num_hidden_layers, config.layer_types = layers, kinds
    config._attn_implementation = dense_attention
    torch.manual_seed(0)
    with torch.device(device):
        model = compat.model_from_config(model_cls, config, dtype=dtype).eval()
    with torch.no_grad():
        for module in model.modules():  # gpt-oss creates its sinks uninitialised
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)
    return model, dense_attention


def kv_bytes(cache) -> dict:
    """Bytes of every tensor the request's cache holds, split by layer kind."""
    split = {"global": 0, "sliding": 0}
    for layer in cache.layers:
        if hasattr(layer, "memory_bytes"):  # RocketKV layers: K/V, KT, positions, lengths
            nbytes = layer.memory_bytes()
        else:
            nbytes = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
        split["sliding" if getattr(layer, "is_sliding", False) else "global"] += nbytes
    return dict(kv_bytes=split["global"] + split["sliding"], kv_bytes_global=split["global"],
                kv_bytes_sliding=split["sliding"])


def run_row(model, dense_attention: str, cache_kind: str, ids: torch.Tensor, new_tokens: int, chunk: int | None,
            rocket: RocketKVConfig, rocket_chunk: int | None = None, chunk_sdpa: bool = False) -> dict:
    device = ids.device
    row = dict(cache=cache_kind, context=ids.shape[1], batch=ids.shape[0])
    if cache_kind == "static-compile" and device.type != "cuda":
        return dict(row, status="skipped", reason="generate() compiles the static cache's decode step on CUDA only")
    clock = StepClock(device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=0, attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([clock]),
                  return_dict_in_generate=True)
    cache = None
    if cache_kind.startswith("rocketkv"):
        hf_rocketkv.enable(model)
        if cache_kind == "rocketkv-compile":
            rocket = rocket.replace(decode_runner="torch_compile")
        if cache_kind == "rocketkv-experts-off":  # transformers' own MoE experts forward (fused_experts=False)
            rocket = rocket.replace(fused_experts=False)
        if cache_kind == "rocketkv-mlp-off":  # transformers' own gated MLP forward (fused_mlp=False)
            rocket = rocket.replace(fused_mlp=False)
        if cache_kind == "rocketkv-qkv-off":  # three q/k/v projections (fused_qkv=False)
            rocket = rocket.replace(fused_qkv=False)
        if cache_kind == "rocketkv-residual-off":  # transformers' own residual adds and norms (fused_residual=False)
            rocket = rocket.replace(fused_residual=False)
        if cache_kind == "rocketkv-stop-sync":  # generate()'s per-step stop-flag read (deferred_stop_check=False)
            rocket = rocket.replace(deferred_stop_check=False)
        cache = RocketKVCache(rocket)
        kwargs.update(compat.cache_kwargs(cache))
        kwargs["disable_compile"] = cache_kind == "rocketkv-eager"
        if rocket_chunk is not None:  # RocketKV's chunked prefill: stage 1 once the last chunk is in
            kwargs["prefill_chunk_size"] = rocket_chunk
            row["prefill_chunk"] = rocket_chunk
    else:
        model.set_attn_implementation(dense_attention)
        if chunk is not None and (dense_attention == "eager" or chunk_sdpa):  # sdpa: 32k in one forward
            kwargs["prefill_chunk_size"] = chunk
            row["prefill_chunk"] = chunk
        if cache_kind == "static-compile":
            kwargs["cache_implementation"] = "static"
        else:
            kwargs["disable_compile"] = True
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        with torch.no_grad():
            clock.start()
            out = model.generate(ids, **kwargs)
    except torch.OutOfMemoryError as err:
        return dict(row, status="oom", error=str(err).splitlines()[0])
    except Exception as err:  # noqa: BLE001 - a row that cannot run is recorded, the others still run
        first_line = str(err).splitlines()[0] if str(err) else ""
        return dict(row, status="error", error=f"{type(err).__name__}: {first_line}")
    finally:
        model.set_attn_implementation(dense_attention)
    timings = step_timings(clock.seconds())
    row.update(status="ok", ttft_s=timings["prefill_s"], decode_ms_per_token=timings["decode_ms_per_token"],
               new_tokens=timings["new_tokens"], wall_s=time.perf_counter() - started,
               peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               **kv_bytes(compat.output_cache(out)))
    if cache is not None:
        step = call_state(cache).graphed_step
        row["decode_runner"] = ("torch_compile" if cache_kind == "rocketkv-compile"
                                else "cuda_graphs" if step is not None and step.replays else "eager")
    return row


def ratios(rows: list[dict]) -> dict:
    by = {r["cache"]: r for r in rows if r.get("status") == "ok"}
    rocket, out = by.get("rocketkv"), {}
    for base in ("dynamic", "static-compile"):
        if rocket is None or base not in by:
            continue
        if by[base]["decode_ms_per_token"] and rocket["decode_ms_per_token"]:
            out[f"decode_speedup_vs_{base}"] = by[base]["decode_ms_per_token"] / rocket["decode_ms_per_token"]
        out[f"kv_bytes_fraction_of_{base}"] = rocket["kv_bytes"] / by[base]["kv_bytes"]
        out[f"ttft_ratio_vs_{base}"] = rocket["ttft_s"] / by[base]["ttft_s"]
    return out


def warm_up(model, dense_attention: str, rocket: RocketKVConfig, device: torch.device) -> None:
    """One short generate per kind before timing: CUDA/cuBLAS initialisation and the Triton kernels' JIT."""
    ids = torch.randint(3, model.config.vocab_size, (1, rocket.prompt_budget + 4 * rocket.window_size), device=device)
    for kind in ("dynamic", "rocketkv"):
        run_row(model, dense_attention, kind, ids, 3, None, rocket)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=[c for c in CACHES if c not in OPT_IN])
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens (default 32768; try 100000)")
    parser.add_argument("--new-tokens", type=int, default=32 + DROP_FIRST_STEPS + 1,
                        help=f"generated tokens per row ({DROP_FIRST_STEPS} warm-up gaps are left out of the median)")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers of each model")
    parser.add_argument("--dense-prefill-chunk", type=int, default=None,
                        help="prefill_chunk_size of the dense rows (default: gpt-oss' eager rows only, the power of "
                             "two that keeps one chunk's logits near 4 GiB, 1024 at 32k, 256 at 100k; given, Gemma's "
                             "sdpa rows too, e.g. 8192 at 100k, where one forward's sliding mask is 18.6 GiB; "
                             "0: one forward)")
    parser.add_argument("--rocketkv-prefill-chunk", type=int, default=None,
                        help="prefill_chunk_size of the RocketKV rows (default: one forward; e.g. 8192 at 100k, "
                             "where transformers' sliding-window mask of one forward is 10 GB)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, fp32, CPU: checks the logic in seconds")
    parser.add_argument("--out", default="out/hybrid_decode")
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    context = 96 if args.quick else args.context
    rocket = RocketKVConfig(prompt_budget=32, window_size=8, topk=4) if args.quick else RocketKVConfig()
    if args.dense_prefill_chunk is None:  # 64 query heads x chunk x context bf16 logits near 4 GiB
        chunk = 1 << max(5, (4 * 2**30 // (64 * context * 2)).bit_length() - 1)
    else:
        chunk = args.dense_prefill_chunk or None
    if args.quick and chunk is not None:
        chunk = 32
    report = dict(
        benchmark="hybrid_decode", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, transformers=__import__("transformers").__version__, dtype=str(dtype),
        context=context, batch=1, new_tokens=args.new_tokens, layers_override=args.layers, quick=args.quick,
        rocketkv_config=rocket.to_dict() if hasattr(rocket, "to_dict") else repr(rocket), models={},
    )
    for name in args.models:
        model, dense_attention = build_model(name, args.quick, args.layers, dtype, device)
        warm_up(model, dense_attention, rocket, device)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(3, model.config.vocab_size, (1, context), generator=generator).to(device)
        rows = []
        for kind in args.caches:
            row = run_row(model, dense_attention, kind, ids, args.new_tokens, chunk, rocket,
                          args.rocketkv_prefill_chunk, chunk_sdpa=bool(args.dense_prefill_chunk))
            print(json.dumps(dict(model=name, **row)), flush=True)
            rows.append(row)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["models"][name] = dict(
            layers=model.config.num_hidden_layers, layer_types=list(model.config.layer_types),
            sliding_window=model.config.sliding_window, dense_attention=dense_attention,
            params_b=sum(p.numel() for p in model.parameters()) / 1e9, rows=rows, ratios=ratios(rows))
        print(json.dumps(dict(model=name, ratios=report["models"][name]["ratios"])), flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_decode.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'hybrid_decode.json'}")
    return report


if __name__ == "__main__":
    main()
