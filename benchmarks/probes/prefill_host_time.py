"""Host time of a pool-backed prefill, per function, without a profiler: is the engine's prefill host-bound?

    python -m benchmarks.probes.prefill_host_time --regions --out $OUT      # H100: about 1 minute
    python -m benchmarks.probes.prefill_host_time --quick --out out        # CPU smoke run

torch.profiler's Python tracing (``with_stack``) slows Python-heavy code several times over, so its picture of where
the host spends a prefill is skewed towards Python. Here each listed function is wrapped by a timer (about a
microsecond per call) and a prefill runs as the batching engine runs it (``profile_prefill.py``'s ``pooled``), with
no synchronisation inside: the wrappers' inclusive seconds are host seconds (launches are asynchronous), and
``host_return_s`` against ``total_s`` says how close the host comes to setting the pace.

Llama-3.1-8B shapes, random bf16 weights, RocketKVConfig() defaults on the Triton backend, a KVBlockPool of 16-token
pages; median over --repeats prefills after a warm-up. Writes ``prefill_host_time.json`` under --out.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import importlib
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

import hf_rocketkv

from benchmarks.probes.profile_prefill import pool_prefill, prefill_args, prefill_setup
from benchmarks.probes.profile_prefix_hit import sync

# (module, attribute path): each is timed inclusively; nested entries are also inside their callers' times.
TIMED = (
    ("hf_rocketkv.cache.cache", "RocketKVCache.begin_prefill"),
    ("hf_rocketkv.cache.cache", "RocketKVCache.finish_prefill"),
    ("hf_rocketkv.cache.cache", "RocketKVCache.update"),
    ("hf_rocketkv.integration.attention", "sdpa_attention_forward"),
    ("hf_rocketkv.cache.layer", "RocketKVLayer.observe_prefill"),
    ("hf_rocketkv.cache.layer", "RocketKVLayer.compress"),
    ("hf_rocketkv.policies.snapkv", "SnapKVPolicy.select"),
    ("hf_rocketkv.policies.snapkv", "SnapKVPolicy.score"),
    ("hf_rocketkv.cache.stage1", "store_prompt"),  # named where stage 1 imports them, so its calls are timed
    ("hf_rocketkv.cache.stage1", "compact"),
    ("hf_rocketkv.cache.compaction", "write_tokens"),
    ("hf_rocketkv.cache.paged_store", "PagedStore.write"),
    ("hf_rocketkv.kernels.window_scores", "window_scores_triton"),
    ("hf_rocketkv.kernels.kt_build", "build_kt_triton"),
    ("hf_rocketkv.memory.pool", "KVBlockPool.stats"),
    ("hf_rocketkv.memory.prefix_index", "page_hashes"),
    ("hf_rocketkv.memory.planner", "as_token_list"),
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer.forward"),
    ("transformers.models.llama.modeling_llama", "LlamaAttention.forward"),
    ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb"),
)


class Timers:
    """Inclusive host seconds and calls per wrapped function (while ``active``)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def reset(self):
        self.seconds.clear()
        self.calls.clear()


@contextlib.contextmanager
def patched(timers: Timers, targets=TIMED):
    """Every target replaced by its timed wrapper; the originals put back afterwards. A missing one is skipped."""
    undo, skipped = [], []
    for module_name, path in targets:
        try:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        except (ImportError, AttributeError, KeyError):
            skipped.append(f"{module_name}:{path}")
            continue
        setattr(owner, attr, timers.wrap(path, original))
        undo.append((owner, attr, original))
    try:
        yield skipped
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)


def cprofile_top(fn, rows: int = 40) -> dict:
    """Run ``fn()`` once under cProfile: the ``rows`` functions with the most own time and the ``rows`` hf_rocketkv
    functions with the most cumulative time, in ms (cProfile slows Python-heavy code: read the ranking, not the
    absolute values)."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        fn()
    finally:
        profile.disable()
    return stats_rows(profile, rows)


def function_name(key: tuple) -> str:
    """A cProfile key (file, line, name) as ``path:line(name)``, the path relative to site-packages or to the
    hf_rocketkv package."""
    file, line, name = key
    package = str(Path(hf_rocketkv.__file__).parent)
    where = f"{file.split('site-packages/')[-1].removeprefix(package + '/')}:{line}" if line else file
    return f"{where}({name})"


def stats_rows(profile: cProfile.Profile, rows: int = 40) -> dict:
    """A finished cProfile's ``rows`` functions with the most own time and ``rows`` hf_rocketkv functions with the
    most cumulative time, in ms."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    package = str(Path(hf_rocketkv.__file__).parent)

    def row(key, value) -> dict:
        return dict(function=function_name(key), calls=value[1], own_ms=round(value[2] * 1e3, 3),
                    cumulative_ms=round(value[3] * 1e3, 3))

    by_own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]
    ours = [kv for kv in stats.items() if kv[0][0].startswith(package)]
    by_cumulative = sorted(ours, key=lambda kv: -kv[1][3])[:rows]
    return {"by_own_time": [row(*kv) for kv in by_own], "hf_rocketkv_by_cumulative": [row(*kv) for kv in by_cumulative]}


def main() -> None:
    args = prefill_args(repeats=5)
    device, config, model, pool = prefill_setup(args)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def pooled() -> tuple[float, float]:
        ids = torch.randint(3, vocab, (1, args.prompt_len), generator=g).to(device)  # cold: no prefix hit
        sync(device)
        start = time.perf_counter()
        cache = pool_prefill(model, config, pool, ids)
        host = time.perf_counter() - start
        sync(device)
        total = time.perf_counter() - start
        cache.close()
        return host, total

    pooled()  # warm-up: Triton JIT, compiled regions
    plain = [pooled() for _ in range(args.repeats)]
    timers = Timers()
    with patched(timers) as skipped:
        pooled()
        timers.reset()
        runs = [pooled() for _ in range(args.repeats)]
    profiled = cprofile_top(pooled) if args.cprofile else None
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "prompt_len": args.prompt_len,
        "regions": args.regions, "repeats": args.repeats,
        "host_return_s": statistics.median(h for h, _ in plain), "total_s": statistics.median(t for _, t in plain),
        "timed_host_return_s": statistics.median(h for h, _ in runs),
        "timed_total_s": statistics.median(t for _, t in runs),
        "skipped": skipped,
        "host_ms_per_prefill": {name: round(1e3 * s / args.repeats, 3)
                                for name, s in sorted(timers.seconds.items(), key=lambda kv: -kv[1])},
        "calls_per_prefill": {name: timers.calls[name] // args.repeats for name in timers.calls},
        "cprofile": profiled,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_host_time.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
