"""Prefix reuse, host onload, decode with and without a pool, and batch-64 memory with a pool, on a GPU.

    python -m benchmarks.bench_prefix_reuse --out $OUT            # H100: ~2-3 minutes
    python -m benchmarks.bench_prefix_reuse --quick --out out/q   # CPU smoke test (tiny model)

Llama-3.1-8B shapes (32 layers, 8 KV heads x 128), random bf16 weights, RocketKVConfig() defaults (budget 2048, topk
64, KT page 4, fp8 KT) with the Triton backend; a KVBlockPool of 16-token pages. Prompts: a 32k-token shared prefix
followed by 256 tokens of its own (suffixes A, B, C). Decode runs eagerly (disable_compile: an 8B compile would not
fit the time budget); the decode kernels themselves are compared under CUDA-graph replay in step 7.

Steps (each is recorded in the JSON even when it fails; a failure never stops the others):
  1. warm-up: a 2k-token request with and without a pool (Triton kernels compiled)
  2. no pool, prefix+B: cold TTFT, decode ms/token, the reference tokens of B
  3. no pool, prefix+C: the reference tokens of C
  4. pool, empty, prefix+A: cold TTFT with a pool, decode ms/token with a pool
  5. pool, prefix+B: the prefix is on the device -> TTFT, tokens == step 2 (target: <= 10% of step 4's TTFT)
  6. pool.evict() moves every cached page to pinned host memory; prefix+C: onloaded -> TTFT, tokens == step 3
     (target: <= 25% of the cold TTFT)
  7. one layer's decode (append + page selection + sparse attention), CUDA-graph replay, on the states of steps 2
     and 4: private pages vs pool pages (target: within 5%)
  8. batch 64 x (32k shared prefix + 256 own tokens) with a pool and prefill_batch_size=1: peak GiB (weights, pool,
     prefill; target <= 60 GiB), time to first token, tokens reused; plus the accounting for 64 distinct 32k prompts
Writes ``bench_prefix_reuse.json`` under --out (default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch
from transformers import LogitsProcessorList

import hf_rocketkv
from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.bench.decode import DROP_FIRST_STEPS, LLAMA_31_8B, TINY, StepClock, _time_ms, build_model

GIB = 2**30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def generate(model, ids: torch.Tensor, cache: RocketKVCache, new_tokens: int, **kwargs) -> dict:
    """One request; returns TTFT (seconds to the first token), decode ms/token (median), the new tokens, stats."""
    clock = StepClock(ids.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                         disable_compile=True, logits_processor=LogitsProcessorList([clock]), **kwargs)
    times = clock.seconds()
    gaps = sorted(b - a for a, b in zip(times[DROP_FIRST_STEPS:], times[DROP_FIRST_STEPS + 1:]))
    return dict(ttft_s=times[0], decode_ms_per_token=gaps[len(gaps) // 2] * 1e3 if gaps else None,
                tokens=out[:, ids.shape[1]:].tolist(), stats=cache.stats.as_dict())


def setup(device: torch.device, quick: bool, dtype: torch.dtype | None = None,
          layers: int | None = None) -> tuple[RocketKVConfig, torch.dtype, torch.nn.Module]:
    """The benchmark's config, dtype and model: Llama-3.1-8B shapes in bf16 on the GPU (Triton backend), or the tiny
    model in float32 with small budgets for a CPU smoke run (``quick``). ``dtype`` / ``layers`` override the model's
    dtype and decoder layers (float32 on the GPU checks token equality: bf16 random weights have near-tied logits).
    Shared with profile_prefix_hit.py and profile_prefill.py."""
    config = RocketKVConfig(backend="triton" if device.type == "cuda" else "torch")
    if quick:
        config = config.replace(prompt_budget=64, window_size=8, kernel_size=7, topk=8)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(TINY if quick else LLAMA_31_8B, layers, dtype, device, seed=0)
    hf_rocketkv.enable(model)
    return config, dtype, model


class Recorder:
    """Runs steps, records their results or their errors, and keeps to a time budget."""

    def __init__(self, budget_s: float):
        self.report: dict = {"steps": {}}
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def step(self, name: str, fn):
        if time.perf_counter() - self.start > self.budget_s:
            self.report["steps"][name] = {"status": "skipped: time budget"}
            return None
        t0 = time.perf_counter()
        try:
            result = fn()
            row = {"status": "ok", **(result if isinstance(result, dict) else {})}
        except Exception as err:  # noqa: BLE001 - record and go on to the next step
            result = None
            row = {"status": "error", "error": f"{type(err).__name__}: {err}"[:500],
                   "traceback": traceback.format_exc()[-2000:]}
        row["wall_s"] = round(time.perf_counter() - t0, 3)
        self.report["steps"][name] = {k: v for k, v in row.items() if k != "tokens"}
        print(json.dumps({name: self.report["steps"][name]}, default=str)[:1500], flush=True)
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU, small contexts (smoke test)")
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pool-gib", type=float, default=24.0, help="device pool of steps 4-7")
    parser.add_argument("--host-gib", type=float, default=8.0)
    parser.add_argument("--hit-repeats", type=int, default=4, help="extra prefix hits timed for the median TTFT")
    parser.add_argument("--budget-s", type=float, default=220.0, help="steps starting later are skipped")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="model and pool dtype (default: bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than Llama-3.1-8B's 32")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if args.quick:
        args.prefix, args.suffix, args.new_tokens, args.batch = 256, 32, 8, 4
        args.pool_gib, args.host_gib = 0.05, 0.05
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.budget_s)
    config, dtype, model = setup(device, args.quick, getattr(torch, args.dtype) if args.dtype else None, args.layers)
    rec.report["env"] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=str(device),
        name=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
        weights_gib=sum(p.numel() * p.element_size() for p in model.parameters()) / GIB, args=vars(args),
        config=config.to_dict(),
    )
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab, (1, args.prefix), generator=g)
    suffix = {name: torch.randint(3, vocab, (1, args.suffix), generator=g) for name in "ABC"}
    prompt = {name: torch.cat([prefix, s], dim=1).to(device) for name, s in suffix.items()}

    def new_pool(gib: float, host_gib: float = 0.0) -> KVBlockPool:
        return KVBlockPool(model.config, max_gpu_bytes=int(gib * GIB), host_bytes=int(host_gib * GIB),
                           page_size=args.page_size, dtype=dtype, kt_page_size=config.page_size,
                           kt_dtype=config.kt_cache_dtype, device=device)

    state: dict = {}

    def warm_up():
        ids = prompt["A"][:, -min(2048, prompt["A"].shape[1]):]
        generate(model, ids, RocketKVCache(config), 4)
        pool = new_pool(1.0 if not args.quick else 0.05)
        cache = RocketKVCache(config, pool=pool)
        generate(model, ids, cache, 4)
        cache.close()
        # the prefix-hit paths (gather from pool pages, then from host memory) compile their kernels here, not in
        # the timed steps 5 and 6: the same prefix with a different tail, once on the device and once onloaded
        other = torch.cat([ids[:, : ids.shape[1] // 2], ids[:, : ids.shape[1] - ids.shape[1] // 2].flip(1)], dim=1)
        for to_host in (False, True):
            if to_host:
                pool.evict()
            cache = RocketKVCache(config, pool=pool)
            generate(model, other, cache, 4)
            cache.close()
        return {}

    def reference(name):
        def run():
            cache = RocketKVCache(config)
            result = generate(model, prompt[name], cache, args.new_tokens)
            state[f"ref_{name}"] = result
            state[f"cache_ref_{name}"] = cache
            return result
        return run

    def pool_cold():
        state["pool"] = new_pool(args.pool_gib, args.host_gib)
        cache = RocketKVCache(config, pool=state["pool"])
        result = generate(model, prompt["A"], cache, args.new_tokens)
        state["cold"], state["cache_pool_A"] = result, cache
        return result

    def pool_hit(name, to_host: bool):
        def evict() -> tuple[int, float]:
            sync(device)
            t0 = time.perf_counter()
            evicted = state["pool"].evict()
            state["pool"].synchronize()
            return evicted, time.perf_counter() - t0

        def hit(ids: torch.Tensor, new_tokens: int) -> dict:
            cache = RocketKVCache(config, pool=state["pool"])
            result = generate(model, ids, cache, new_tokens)
            cache.close()
            return result

        def fresh_suffix(i: int) -> torch.Tensor:
            """The prefix + a suffix no request had (a repeat of this step's prompt would reuse its suffix pages)."""
            seed = 1000 + 100 * ord(name) + i
            own = torch.randint(3, vocab, (1, args.suffix), generator=torch.Generator().manual_seed(seed))
            return torch.cat([prefix, own], dim=1).to(device)

        def run():
            if to_host:
                evicted, evict_s = evict()
            result = hit(prompt[name], args.new_tokens)
            # one hit's TTFT varies by tens of ms between runs (host scheduling): the ratio uses the median of
            # --hit-repeats more hits (one new token each; from host memory, each after a fresh evict)
            runs, reused = [result["ttft_s"]], []
            for i in range(args.hit_repeats):
                if to_host:
                    evict()
                repeat = hit(fresh_suffix(i), 1)
                runs.append(repeat["ttft_s"])
                reused.append(repeat["stats"]["reused_tokens"])
            result["ttft_s_runs"] = [round(t, 4) for t in runs]
            result["repeats_reused_tokens"] = reused
            result["ttft_s_median"] = sorted(runs)[len(runs) // 2]
            cold = state.get("cold", {}).get("ttft_s")
            result["ttft_ratio_to_cold"] = result["ttft_s_median"] / cold if cold else None
            ref = state.get(f"ref_{name}")
            result["tokens_equal_cold_run"] = ref is not None and ref["tokens"] == result["tokens"]
            result["matching_leading_tokens"] = _leading(ref["tokens"][0], result["tokens"][0]) if ref else None
            if to_host:
                result.update(evicted_pages=evicted, evict_s=evict_s, pool_stats=state["pool"].stats().as_dict())
            return result
        return run

    def decode_kernels():
        rows = {}
        for label, key in (("private", "cache_ref_B"), ("pool", "cache_pool_A")):
            cache = state.get(key)
            if cache is None:
                rows[label] = "missing (its step failed)"
                continue
            layer = cache.layers[0]
            q = torch.randn(1, model.config.num_attention_heads, 1, layer.head_dim, device=device, dtype=dtype)
            k = torch.randn(1, layer.num_kv_heads, 1, layer.head_dim, device=device, dtype=dtype)
            def step():
                store = layer.store
                layer.ops.paged_append_token(store.k, store.v, store.kt, store.table, layer.positions, layer.lengths,
                                             layer.seen, k[:, :, 0], k[:, :, 0], layer.config.page_size)
                layer.lengths.sub_(1)  # the same state every call
                return layer.attend_decode(q, layer.head_dim**-0.5)

            eager_ms, graph_ms = _time_ms(step, device)
            rows[label] = dict(eager_ms=eager_ms, graph_ms=graph_ms, kept=int(layer.lengths.max()),
                               page_tokens=layer.store.page_tokens)
        if isinstance(rows.get("private"), dict) and isinstance(rows.get("pool"), dict):
            a, b = rows["private"]["graph_ms"], rows["pool"]["graph_ms"]
            rows["pool_over_private"] = b / a if a and b else None
        return rows

    def batch_memory():
        release_state(state)  # the earlier steps' caches and their 24 GiB pool: gone before this step's pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        allocated_before = allocated_gib(device)  # the weights (and whatever an earlier step still holds)
        n_new = 8
        sizing = new_pool(0.01)  # plan the pool from its own accounting
        per_row = sizing.pages_needed(args.prefix + args.suffix, n_new - 1, config)
        cached_prefix = args.prefix // args.page_size
        pages = args.batch * per_row.steady_state + per_row.prompt_pages + cached_prefix + 64
        pool = KVBlockPool(model.config, max_gpu_bytes=pages * sizing.bytes_per_page, page_size=args.page_size,
                           dtype=dtype, kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=device)
        pool.bind_all(device)
        allocated_with_pool = allocated_gib(device)
        ids = torch.cat([prefix.expand(args.batch, -1),
                         torch.randint(3, vocab, (args.batch, args.suffix), generator=g)], dim=1).to(device)
        cache = RocketKVCache(config.replace(prefill_batch_size=1), pool=pool)
        result = generate(model, ids, cache, n_new)
        result.pop("tokens")
        distinct = sizing.pages_needed([args.prefix + args.suffix] * args.batch, n_new - 1, config)
        peak = peak_gib(device)
        result.update(
            peak_gib=peak, pool_gib=pool.num_pages * pool.bytes_per_page / GIB, pool_pages=pool.num_pages,
            allocated_before_pool_gib=allocated_before,
            generate_transient_gib=peak - allocated_with_pool if peak is not None else None,
            pages_held=cache.stats.pages_held,
            accounting_64_distinct=dict(
                all_rows_at_once_gib=distinct.prefill_peak * sizing.bytes_per_page / GIB,
                row_groups_of_1_gib=(args.batch * per_row.steady_state + per_row.prompt_pages)
                * sizing.bytes_per_page / GIB,
            ),
        )
        cache.close()
        return result

    rec.step("1_warm_up", warm_up)
    rec.step("2_no_pool_cold_B", reference("B"))
    rec.step("3_no_pool_cold_C", reference("C"))
    rec.step("4_pool_cold_A", pool_cold)
    rec.step("5_pool_prefix_on_device_B", pool_hit("B", to_host=False))
    rec.step("6_pool_prefix_from_host_C", pool_hit("C", to_host=True))
    rec.step("7_decode_step_private_vs_pool", decode_kernels)
    rec.step(f"8_batch{args.batch}_shared_prefix_memory", batch_memory)
    steps = rec.report["steps"]
    rec.report["targets"] = dict(
        device_hit_ttft_ratio=steps.get("5_pool_prefix_on_device_B", {}).get("ttft_ratio_to_cold"),
        host_hit_ttft_ratio=steps.get("6_pool_prefix_from_host_C", {}).get("ttft_ratio_to_cold"),
        decode_pool_over_private=steps.get("7_decode_step_private_vs_pool", {}).get("pool_over_private"),
        decode_ms_per_token=dict(private=steps.get("2_no_pool_cold_B", {}).get("decode_ms_per_token"),
                                 pool=steps.get("4_pool_cold_A", {}).get("decode_ms_per_token")),
        batch_peak_gib=steps.get(f"8_batch{args.batch}_shared_prefix_memory", {}).get("peak_gib"),
    )
    rec.report["total_s"] = time.perf_counter() - rec.start
    (out_dir / "bench_prefix_reuse.json").write_text(json.dumps(rec.report, indent=2, default=str))
    print(json.dumps(rec.report["targets"], default=str), flush=True)


def allocated_gib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def release_state(state: dict) -> None:
    """Close every cache the earlier steps kept and drop them and their pool, then collect: step 8's peak must not
    include them. A function of its own, so no local variable of the caller still points at the last cache (a
    closed cache still holds its pool: before this, the loop variable kept step 4's 24 GiB pool alive through step
    8's generate(), 24 of the 27 GiB above weights + pool in its 70.0 GiB peak)."""
    for key in [k for k in state if k.startswith("cache")] + [k for k in state if k == "pool"]:
        state[key].close()  # the caches first: their pages go back to the pool; then the pool's host buffer
    state.clear()
    gc.collect()


def _leading(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
