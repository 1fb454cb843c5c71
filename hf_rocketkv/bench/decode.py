"""Decode benchmark: Llama-3.1-8B-shaped model with RANDOM weights, DynamicCache vs StaticCache+compile vs RocketKV.

    python -m hf_rocketkv.bench.decode                    # the full grid on one GPU (bf16)
    python -m hf_rocketkv.bench.decode --quick            # tiny CPU smoke run (seconds)
    hf-rocketkv bench --config default --batch 1 4 --context 8192 32768 --layers 8

Rows (``--caches``), all in one process on the same model:
    dynamic           transformers DynamicCache, eager, sdpa attention
    static-compile    ``generate(cache_implementation="static")``, which torch.compiles the decode step on CUDA
                      (transformers' CompileConfig: mode "reduce-overhead", i.e. CUDA graphs)
    rocketkv          RocketKVCache (``--config``'s RocketKVConfig, backend "triton" on CUDA), eager decode
    rocketkv-graphs   RocketKVCache, generate's compiled-decode path with decode_runner="cuda_graphs" (the default on
                      CUDA: each request's eager decode step captured as a CUDA graph, no torch.compile)
    rocketkv-compile  RocketKVCache, generate's compiled-decode path with decode_runner="torch_compile"
    rocketkv-graphs-pool      rocketkv-graphs on the pages of a KVBlockPool (model-dtype pages of 16 tokens, sized
                              for the run's prefill peak) instead of the cache's private buffers
    rocketkv-graphs-pool-fp8  the same on fp8 (e4m3) pool pages with per-page scales
    rocketkv-rope-off, rocketkv-graphs-rope-off  rocketkv / rocketkv-graphs with ``fused_rope=False``
                              (transformers' ten-launch RoPE in decode steps), for the side-by-side comparison
    rocketkv-norm-off, rocketkv-graphs-norm-off  rocketkv / rocketkv-graphs with ``fused_norm=False``
                              (transformers' RMSNorm modules in decode steps), for the side-by-side comparison
    rocketkv-adakv, rocketkv-graphs-adakv        rocketkv / rocketkv-graphs with ``stage1="adakv"``
for every batch size x context (prompt tokens). A point that cannot fit in GPU memory is skipped with the estimate
that says so (weights + KV cache + prefill activations), and an out-of-memory error is recorded, not raised.

Before any timing, one short eager generate per cache kind absorbs one-time costs (CUDA initialisation, the JIT
compilation of the Triton kernels). Columns: decode ms/token (median time between consecutive generated tokens,
from CUDA events recorded per token without a sync; first steps dropped: they include compilation), tokens/s
(batch / that time), prefill seconds (generate's first forward), peak GiB (torch.cuda.max_memory_allocated), attention step (one layer, timed separately on the cache state left by the run,
eager and as a CUDA-graph replay: sdpa over the full K/V for the dense caches, RocketKV's page scoring + top-k +
sparse attention for RocketKV), the bytes that step must read and its achieved GB/s, and decode time relative to
DynamicCache. PyTorch's cuDNN attention backend is switched off unless --allow-cudnn-sdpa (see that flag).
Writes ``decode_bench.json`` and ``decode_bench.png`` (decode ms/token vs context, one line per cache, one panel
per batch size) under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..integration import compat
from . import fit
from .fit import LLAMA_31_8B, TINY  # noqa: F401  (the shapes, imported from here by the scripts and tests)
from .options import CACHES, decode_grid, decode_parser, parse

POOL_PAGE_SIZE = 16  # tokens per pool page in the pool rows (KVBlockPool's default)
DROP_FIRST_STEPS = 3  # decode steps left out of the median (compilation, CUDA-graph capture, allocator warm-up)


@dataclasses.dataclass
class Row:
    cache: str
    batch: int
    context: int
    status: str = "ok"
    new_tokens: int = 0
    decode_ms_per_token: float | None = None
    tokens_per_s: float | None = None
    prefill_s: float | None = None
    peak_gib: float | None = None
    attn_ms: float | None = None
    attn_graph_ms: float | None = None
    attn_bytes: int | None = None
    attn_GBps: float | None = None
    attn_graph_GBps: float | None = None
    ratio_vs_dynamic: float | None = None
    estimate_gib: float | None = None
    prefill_rows: str | None = None  # generate()'s line when it prefilled in row groups it chose from the free memory

    def skip(self, need: int, allowed: float) -> None:
        """Not run: its estimate (``need`` bytes) is above ``allowed`` bytes."""
        self.estimate_gib = need / 2**30
        self.status = f"skipped: needs ~{need / 2**30:.0f} GiB > {allowed / 2**30:.0f} GiB"

    def record(self, result: dict, attention: tuple[tuple[float, float | None], int]) -> None:
        """What a run measured: ``run_generate``'s result (step timings, peak, the prefill rows' line) and
        ``attention_step``'s ``((eager ms, graph ms), bytes)``; then the rates derived from them (``fill_rates``)."""
        fields = {field.name for field in dataclasses.fields(self)}
        unknown = set(result) - fields
        if unknown:
            raise ValueError(f"Row.record: no column named {sorted(unknown)}")
        for name, value in result.items():
            setattr(self, name, value)
        (self.attn_ms, self.attn_graph_ms), self.attn_bytes = attention
        self.fill_rates()

    def fail(self, status: str) -> None:
        self.status = status

    def fill_rates(self) -> None:
        """The columns derived from the timings: ``tokens_per_s`` (the batch's rows each get a token per decode step:
        batch / step time) and the attention step's read bandwidth ``attn_GBps`` / ``attn_graph_GBps``
        (``attn_bytes`` per eager / CUDA-graph step time, 1 GB = 1e9 bytes). Columns without a timing stay None."""
        if self.decode_ms_per_token:
            self.tokens_per_s = self.batch * 1e3 / self.decode_ms_per_token
        if self.attn_ms:
            self.attn_GBps = self.attn_bytes / (self.attn_ms * 1e-3) / 1e9
        if self.attn_graph_ms:
            self.attn_graph_GBps = self.attn_bytes / (self.attn_graph_ms * 1e-3) / 1e9

    def compare_with(self, dynamic_ms: float | None) -> None:
        """``ratio_vs_dynamic``: this row's decode time over DynamicCache's at the same batch and context."""
        if dynamic_ms and self.decode_ms_per_token:
            self.ratio_vs_dynamic = self.decode_ms_per_token / dynamic_ms


# ------------------------------------------------------------------------------------------------ setup
def build_parser() -> argparse.ArgumentParser:
    """The options (bench/options.py: read and checked without torch)."""
    return decode_parser()


def resolve(args) -> dict[str, Any]:
    quick = args.quick
    device = torch.device(args.device or ("cpu" if quick or not torch.cuda.is_available() else "cuda"))
    return dict(
        device=device,
        dtype=getattr(torch, fit.bench_dtype(args, device.type)),
        model=dict(TINY if quick else LLAMA_31_8B),
        **decode_grid(args),
    )


def free_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes free on ``device`` before the model is built, the device in words): the CUDA device's free memory,
    or the host's available memory (fit.host_available_bytes) on the CPU; (None, ...) elsewhere."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        available, source = fit.host_available_bytes()
        return available, f"the CPU ({source})"
    return None, str(device)


def rocket_config(args, quick: bool, device: torch.device):
    from ..config import RocketKVConfig

    if args.config is not None:
        from ..eval.settings import load_run_config

        config = load_run_config(args.config).rocket
    elif quick:
        config = RocketKVConfig(prompt_budget=48, window_size=8, kernel_size=7, topk=4, page_size=4)
    else:
        config = RocketKVConfig()
    if args.prefill_batch_size is not None:
        config = config.replace(prefill_batch_size=args.prefill_batch_size)
    # the kernels under test on CUDA; the reference on CPU (the Triton interpreter would take minutes)
    return config.replace(backend="triton" if device.type == "cuda" else "torch")


def build_model(model_kwargs: dict, layers: int | None, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(model_kwargs)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    config = LlamaConfig(**kwargs, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = compat.model_from_config(LlamaForCausalLM, config, dtype=dtype)
    return model.eval()


# ------------------------------------------------------------------------------------------------ memory estimate
def estimate_bytes(cache: str, batch: int, context: int, new_tokens: int, model, rocket) -> int:
    """Weights + KV cache + prefill activations (a deliberately rough upper estimate, used only to skip points):
    the model's own weights plus fit.state_bytes of its shapes."""
    elem = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    return weights + fit.state_bytes(fit.Shapes.of(model.config), elem, cache, batch, context, new_tokens,
                                     rocket.prompt_budget, rocket.prefill_batch_size)


# ------------------------------------------------------------------------------------------------ one run
class StepClock:
    """A logits processor that timestamps every generated token without synchronising the device.

    On CUDA it records a CUDA event per token (read back after generate(): a sync per token would stall the GPU
    between steps and hide what generate() itself does); elsewhere it reads the host clock.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.times: list[float] = []
        self.start()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()

    def __call__(self, input_ids, scores):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.times.append(time.perf_counter())
        return scores

    def seconds(self) -> list[float]:
        """Time of each generated token since ``start()``."""
        if self.cuda:
            torch.cuda.synchronize()
            return [self.start_event.elapsed_time(event) / 1e3 for event in self.events]
        return [t - self.t0 for t in self.times]


def run_generate(model, cache: str, ids: torch.Tensor, new_tokens: int, rocket, profile: bool = False,
                 cudnn_for_static: bool = False) -> tuple[dict, Any]:
    from transformers import LogitsProcessorList

    from ..cache import RocketKVCache
    from ..integration.registration import enable

    device = ids.device
    clock = StepClock(device)
    cudnn_default = torch.backends.cuda.cudnn_sdp_enabled()
    kwargs: dict[str, Any] = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
        logits_processor=LogitsProcessorList([clock]), return_dict_in_generate=True,
    )
    if cache.startswith("rocketkv"):
        enable(model)
        pool = pool_for_row(model, cache, rocket, ids.shape[0], ids.shape[1], new_tokens)
        past = RocketKVCache(rocket_for_row(rocket, cache), pool=pool)
        kwargs.update(compat.cache_kwargs(past))
        kwargs["disable_compile"] = cache in ("rocketkv", "rocketkv-rope-off", "rocketkv-norm-off", "rocketkv-adakv")
    else:
        model.set_attn_implementation("sdpa")
        if cache == "static-compile":
            kwargs["cache_implementation"] = "static"
            if device.type == "cuda" and cudnn_for_static:
                # captured in a CUDA graph, cuDNN's per-call planning is paid once: its fastest attention is fair here
                torch.backends.cuda.enable_cudnn_sdp(True)
        else:
            kwargs.update(compat.cache_kwargs(None))
            kwargs["disable_compile"] = True
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    profiler = _profiler(device) if profile else None
    clock.start()
    try:
        with LibraryLines() as lines:
            if profiler is not None:
                with profiler:
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            else:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    finally:
        model.set_attn_implementation("sdpa")
        if device.type == "cuda" and cudnn_for_static:
            torch.backends.cuda.enable_cudnn_sdp(cudnn_default)
    if profiler is not None:
        print(f"--- profile: {cache} batch {ids.shape[0]} context {ids.shape[1]} (prefill + {new_tokens} tokens)")
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    result = dict(
        step_timings(clock.seconds()),
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        prefill_rows=next((line for line in lines.messages if "prefill of" in line), None),
    )
    return result, compat.output_cache(out)


class LibraryLines(logging.Handler):
    """The ``hf_rocketkv`` logger's INFO lines during a block (generate()'s automatic row groups say how they split
    the batch there), kept in ``messages`` and printed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.logger = logging.getLogger("hf_rocketkv")
        self.previous_level = logging.NOTSET

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        print(record.getMessage(), flush=True)

    def __enter__(self) -> LibraryLines:
        self.previous_level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.previous_level)


def step_timings(times: list[float]) -> dict:
    """The timing columns of one run from ``times``, each generated token's time in seconds since the call
    (``StepClock.seconds``): ``prefill_s`` the first token's (prefill and its sampling: TTFT), ``decode_ms_per_token``
    the median gap between consecutive tokens in ms, without the first ``DROP_FIRST_STEPS`` gaps when more than
    ``DROP_FIRST_STEPS + 2`` remain (None with one token), ``new_tokens`` the tokens timed."""
    steps = [b - a for a, b in zip(times, times[1:])]
    steady = steps[DROP_FIRST_STEPS:] if len(steps) > DROP_FIRST_STEPS + 2 else steps
    return dict(
        prefill_s=times[0] if times else None,
        decode_ms_per_token=statistics.median(steady) * 1e3 if steady else None,
        new_tokens=len(times),
    )


def rocket_for_row(rocket, cache: str):
    """The RocketKVConfig of a benchmark row: rocketkv-graphs / rocketkv-compile pick the decode runner; a
    ``-rope-off`` row turns ``fused_rope`` off, a ``-norm-off`` row ``fused_norm``; an ``-adakv`` row sets
    ``stage1="adakv"`` (per-head budgets)."""
    if cache.endswith("-rope-off"):
        rocket = rocket.replace(fused_rope=False)
    if cache.endswith("-norm-off"):
        rocket = rocket.replace(fused_norm=False)
    if cache.endswith("-adakv"):
        rocket = rocket.replace(stage1="adakv")
    if cache.startswith("rocketkv-graphs"):
        return rocket.replace(decode_runner="cuda_graphs")
    if cache == "rocketkv-compile":
        return rocket.replace(decode_runner="torch_compile")
    return rocket


def pool_for_row(model, cache: str, rocket, batch: int, context: int, new_tokens: int):
    """The KVBlockPool of a pool row (None for the others): exactly the pages the run's prefill peak needs."""
    if "-pool" not in cache:
        return None
    from ..memory import KVBlockPool

    dtype = torch.float8_e4m3fn if cache.endswith("-fp8") else None  # None: the model's dtype
    device = next(model.parameters()).device

    def make(nbytes: int, **extra) -> KVBlockPool:
        return KVBlockPool(model.config, max_gpu_bytes=nbytes, page_size=POOL_PAGE_SIZE, dtype=dtype,
                           kt_page_size=rocket.page_size, kt_dtype=rocket.kt_cache_dtype, device=device, **extra)

    probe = make(1 << 30)  # lazily allocated: only its page bytes and its accounting are read
    needed = probe.pages_needed([context] * batch, new_tokens, rocket)
    if probe.has_sliding_layers:  # a hybrid model: the rows' sliding-window slots too (docs/memory.md, "Layer kinds")
        return make(needed.prefill_peak_bytes, sliding_slots=needed.slots)
    return make(needed.prefill_peak * probe.bytes_per_page)


def _profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def warm_up(model, caches: list[str], rocket, device: torch.device) -> None:
    """One short eager generate per cache kind before any timing, so prefill seconds (TTFT) exclude one-time costs:
    CUDA/cuBLAS initialisation and the JIT compilation of RocketKV's Triton kernels (~2 s on the first call)."""
    from ..cache import RocketKVCache
    from ..integration.registration import enable

    ids = torch.randint(3, model.config.vocab_size, (1, rocket.prompt_budget + 2 * rocket.window_size), device=device)
    kwargs = dict(max_new_tokens=2, do_sample=False, eos_token_id=None, disable_compile=True,
                  attention_mask=torch.ones_like(ids))
    if any(cache.startswith("rocketkv") for cache in caches):
        enable(model)
        model.generate(ids, **compat.cache_kwargs(RocketKVCache(rocket)), **kwargs)
    model.set_attn_implementation("sdpa")
    model.generate(ids, **kwargs)
    _free(device)


# ------------------------------------------------------------------------------------------------ attention step
def _time_ms(fn, device: torch.device) -> tuple[float, float | None]:
    """(eager ms, CUDA-graph replay ms or None): eager includes the launch overhead, the replay is the GPU work."""
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        eager = do_bench(fn, warmup=10, rep=50, return_mode="median")
        try:
            graph = do_bench_cudagraph(fn, rep=30, return_mode="median")
        except Exception:  # noqa: BLE001 - an op that cannot be captured: eager only
            graph = None
        return eager, graph
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3, None


def attention_step(cache_name: str, past, model) -> tuple[tuple[float, float | None], int]:
    """((eager ms, graph ms), bytes to read) of ONE layer's decode attention on the state left in layer 0."""
    import torch.nn.functional as F

    cfg = model.config
    layer = past.layers[0]
    if cache_name.endswith(("-pool", "-pool-fp8")):
        return (None, None), None  # pool pages: the generate() rows above time them; the private layout is timed here
    keys, values = layer.keys, layer.values
    batch, _, _, head_dim = keys.shape
    q = torch.randn(batch, cfg.num_attention_heads, 1, head_dim, device=keys.device, dtype=keys.dtype)
    elem = keys.element_size()
    q_out_bytes = 2 * q.numel() * elem
    if cache_name.startswith("rocketkv"):
        from ..cache import decode_read_bytes

        scaling = head_dim**-0.5
        ms = _time_ms(lambda: layer.attend_decode(q, scaling), keys.device)
        return ms, decode_read_bytes(layer, q) + q_out_bytes
    if cache_name == "static-compile":
        # the static cache attends over its whole buffer with a mask (what the compiled step reads)
        length = int(past.get_seq_length())
        mask = (torch.arange(keys.shape[2], device=keys.device) < length)[None, None, None, :]
        ms = _time_ms(lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True),
                      keys.device)
        return ms, 2 * keys.numel() * elem + q_out_bytes
    ms = _time_ms(lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True), keys.device)
    return ms, 2 * keys.numel() * elem + q_out_bytes


# ------------------------------------------------------------------------------------------------ main
def run(argv: list[str] | None = None) -> dict:
    args = parse(build_parser(), argv)
    setup = resolve(args)
    device, dtype = setup["device"], setup["dtype"]
    import hf_rocketkv  # noqa: F401  registers the rocketkv attention

    if device.type == "cuda" and not args.allow_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    rocket = rocket_config(args, args.quick, device)
    free, where = free_memory(device)
    # before the model is built: a run that cannot fit is refused with the estimate, not killed by the kernel
    fit.check_bench(args, workload=False, device_type=device.type, available=free, where=where,
                    prompt_budget=rocket.prompt_budget, prefill_batch_size=rocket.prefill_batch_size)
    model = build_model(setup["model"], args.layers, dtype, device, args.seed)
    # points are skipped above memory_fraction of the GPU's memory, or on the CPU of the host memory free at start
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else free
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=_device_name(device),
        torch=torch.__version__, python=platform.python_version(), dtype=str(dtype),
        layers=model.config.num_hidden_layers, model=setup["model"] | ({"num_hidden_layers": args.layers} if args.layers else {}),
        rocketkv=rocket.to_dict(), new_tokens=setup["new_tokens"], total_gib=total / 2**30 if total else None,
        cudnn_sdpa=bool(device.type != "cuda" or args.allow_cudnn_sdpa),
        cudnn_for_static=bool(args.cudnn_for_static),
    )
    try:
        import transformers

        env["transformers"] = transformers.__version__
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(env), flush=True)
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(args.seed)
    warm_up(model, setup["caches"], rocket, device)
    for batch in setup["batch"]:
        for context in setup["context"]:
            ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen).to(device)
            for cache in setup["caches"]:
                need = estimate_bytes(cache, batch, context, setup["new_tokens"], model, rocket)
                row = Row(cache=cache, batch=batch, context=context, estimate_gib=need / 2**30)
                if total is not None and need > args.memory_fraction * total:
                    row.skip(need, args.memory_fraction * total)
                    rows.append(row)
                    print(_line(row), flush=True)
                    continue
                past = None
                try:
                    result, past = run_generate(model, cache, ids, setup["new_tokens"], rocket, args.profile,
                                                args.cudnn_for_static)
                    row.record(result, attention_step(cache, past, model))
                except torch.cuda.OutOfMemoryError:
                    row.fail("out of memory")
                except Exception as err:  # noqa: BLE001 - one bad point must not lose the others
                    row.fail(f"error: {type(err).__name__}: {str(err)[:300]}")
                del past
                _free(device)
                rows.append(row)
                print(_line(row), flush=True)
    _ratios(rows)
    report = dict(env=env, rows=[dataclasses.asdict(r) for r in rows])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode_bench.json").write_text(json.dumps(report, indent=1))
    print(markdown(rows))
    if not args.no_plot:
        plot(rows, out_dir / "decode_bench.png", env)
    print(f"wrote {out_dir / 'decode_bench.json'}" + ("" if args.no_plot else f" and {out_dir / 'decode_bench.png'}"))
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; a run that cannot fit in memory is refused in two lines, exit status 2."""
    try:
        run(argv)
    except fit.WontFit as err:
        print(f"hf-rocketkv bench: error: {err}", file=sys.stderr)
        return 2
    return 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ratios(rows: list[Row]) -> None:
    dense = {(r.batch, r.context): r.decode_ms_per_token for r in rows if r.cache == "dynamic" and r.decode_ms_per_token}
    for r in rows:
        r.compare_with(dense.get((r.batch, r.context)))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _line(r: Row) -> str:
    return (f"{r.cache:16s} B={r.batch:<3d} ctx={r.context:<7d} {r.status:10.60s} decode {_fmt(r.decode_ms_per_token, '.2f')} "
            f"ms/tok, prefill {_fmt(r.prefill_s, '.2f')} s, peak {_fmt(r.peak_gib, '.1f')} GiB, attn "
            f"{_fmt(r.attn_ms, '.4f')} ms = {_fmt(r.attn_GBps, '.0f')} GB/s")


def markdown(rows: list[Row]) -> str:
    head = ("| cache | batch | context | status | decode ms/token | tokens/s | prefill s | peak GiB | attn step ms "
            "(1 layer, eager / graph) | attn GB/s (eager / graph) | vs dynamic |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r.cache} | {r.batch} | {r.context} | {r.status} | {_fmt(r.decode_ms_per_token, '.2f')} | "
            f"{_fmt(r.tokens_per_s, '.1f')} | {_fmt(r.prefill_s, '.2f')} | {_fmt(r.peak_gib, '.1f')} | "
            f"{_fmt(r.attn_ms, '.4f')} / {_fmt(r.attn_graph_ms, '.4f')} | {_fmt(r.attn_GBps, '.0f')} / "
            f"{_fmt(r.attn_graph_GBps, '.0f')} | {_fmt(r.ratio_vs_dynamic, '.2f')} |"
        )
    return "\n".join(lines)


def context_label(tokens: int) -> str:
    """Tick label of a context length: 96 -> "96", 8192 -> "8k", 100000 -> "100k"."""
    for unit in (1024, 1000):
        if tokens >= unit and tokens % unit == 0:
            return f"{tokens // unit}k"
    return str(tokens)


def plot(rows: list[Row], path: Path, env: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    batches = sorted({r.batch for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for cache in CACHES:
            pts = sorted((r.context, r.decode_ms_per_token) for r in rows
                         if r.batch == batch and r.cache == cache and r.decode_ms_per_token)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cache)
        contexts = sorted({r.context for r in rows if r.batch == batch})
        ax.set_xscale("log")
        # ticks at the measured contexts, labelled in tokens (a log axis alone labels powers like 2^7 between them)
        ax.set_xticks(contexts, [context_label(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (prompt tokens, log scale)")
        ax.set_ylabel("decode ms / token")
        ax.set_title(f"batch {batch}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{env['device']}, {env['layers']} layers, {env['dtype']}, {env['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
