"""Stage 2 fused (``stage2_kernel="fused"``, one op) against split (page selection, then sparse attention), on a GPU.

    python -m benchmarks.fused_decode --out $OUT               # about 2 minutes on an H100
    python -m benchmarks.fused_decode --quick --out out/fd     # CPU logic check (Triton interpreter, tiny shapes)

Three parts, written to ``fused_decode.json`` under --out after every point:

op      one Llama-3.1-8B layer's stage 2 (8 KV heads, 4 query heads each, head_dim 128, bf16 K/V, fp8 KT, page 4,
        topk 64, topr 128) over the state stage 1 leaves (2,048 kept tokens + 16 generated per row, rows up to 37
        tokens shorter), at batch 1, 32 and 64, on the cache's private layout (pages of one KT page, an identity
        table) and on 16-token pool pages (bf16, and fp8 with per-page scales): microseconds per call as CUDA-graph
        replays, Triton launches per call, and the largest |fused - split| over the outputs (the kernels' tests
        check each against PyTorch; this checks them against each other on the GPU's own compiler).
step    whole decode steps of the random-weight Llama-3.1-8B through generate() and the default runner
        (decode_runner="cuda_graphs"), per setting: ms/token (median over the steps after the capture) and, from
        a profiler window over a few replays, kernels per step and the device time of RocketKV's Triton kernels.
        Points: batch 1 x 32k, 32 x 8k, 64 x 8k prompts (stage 1 keeps 2,048 tokens of each row, so the decode
        step's stage-2 work is the op part's).

sweep   (with the time left) the fused op's knobs: splits x token tile x warps at batch 1, 32, 64 (private layout),
        and with one split the scoring pass inside the kernel (the default) or as its own launch.

Points not started within --budget-s seconds are skipped (recorded as such), so the run ends in time.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

OPS_POINTS = ((1, "private"), (1, "pool"), (1, "pool-fp8"), (32, "private"), (32, "pool"), (64, "private"),
              (64, "pool"))
STEP_POINTS = ((1, 32768), (32, 8192), (64, 8192))
SETTINGS = ("split", "fused")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out/fused_decode"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    parser.add_argument("--budget-s", type=float, default=170.0, help="no new point starts after this many seconds")
    parser.add_argument("--skip-step", action="store_true", help="the op part only")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="with --quick: also the fused op's knob sweep")
    return parser.parse_args(argv)


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.quick:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch

from benchmarks.probes.bench_kernels import time_graph
from hf_rocketkv.kernels import launch as launch_module
from hf_rocketkv.kernels.dispatch import get_ops
from hf_rocketkv.selection import stage2_pages as s2


class Report:
    def __init__(self, out: Path, env: dict):
        self.path, self.data = out / "fused_decode.json", dict(env, op=[], step=[], sweep=[], skipped=[])
        out.mkdir(parents=True, exist_ok=True)

    def add(self, part: str, row: dict) -> None:
        self.data[part].append(row)
        print(json.dumps(row), flush=True)
        self.path.write_text(json.dumps(self.data, indent=1))


# ------------------------------------------------------------------------------------------------ op part
def layer_state(batch: int, layout: str, quick: bool, device: torch.device, seed: int = 0) -> dict:
    """One layer's paged store after stage 1: K/V, KT (built over each row's tokens), table, lengths, query."""
    g = torch.Generator().manual_seed(seed)
    heads, group, dim, kt_page = (2, 4, 32, 4) if quick else (8, 4, 128, 4)
    kept, slots = (64 + 4, 96) if quick else (2048 + 16, 2048 + 256)
    page_tokens = kt_page if layout == "private" else 16  # a cache without a pool: one KT page per page
    per_row = slots // page_tokens
    num_pool = batch * per_row
    lengths = torch.tensor([kept - int(x) for x in torch.randint(0, 38 if not quick else 5, (batch,), generator=g)])
    keys = torch.randn(batch, heads, slots, dim, generator=g)
    keys = torch.where((torch.arange(slots) < lengths[:, None, None])[..., None], keys, 0.0)
    values = torch.randn(batch, heads, slots, dim, generator=g)
    order = torch.randperm(num_pool, generator=g) if layout != "private" else torch.arange(num_pool)
    table = order.view(batch, per_row).to(torch.int32)
    to_pool = table.reshape(-1).long()

    def pooled(x):  # [B, Hkv, slots, *rest] -> [N, Hkv, page_tokens, *rest] through the table
        x = x.reshape(batch, heads, per_row, -1, *x.shape[3:]).movedim(2, 1).reshape(num_pool, heads, -1,
                                                                                      *x.shape[3:])
        out = torch.empty_like(x)
        out[to_pool] = x
        return out

    kt = s2.build_kt(keys.to(torch.bfloat16), lengths, kt_page, torch.float8_e5m2)  # [B, Hkv, slots // KP, 2, D]
    state = {"q": torch.randn(batch, heads, group, dim, generator=g).to(torch.bfloat16), "kt": pooled(kt),
                 "table": table, "lengths": lengths, "kt_page": kt_page, "topk": 16 if quick else 64, "topr": dim,
                 "scaling": dim**-0.5, "k_scale": None, "v_scale": None}
    if layout == "pool-fp8":
        scales = []
        for name, x in (("k", keys), ("v", values)):
            pages = pooled(x)
            scale = pages.abs().amax(dim=(1, 2, 3)).clamp(min=1e-6) / 448.0
            state[name] = (pages / scale[:, None, None, None]).to(torch.float8_e4m3fn)
            scales.append(scale.float())
        state["k_scale"], state["v_scale"] = scales
    else:
        state["k"], state["v"] = pooled(keys).to(torch.bfloat16), pooled(values).to(torch.bfloat16)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def stage2_call(ops, st: dict, setting: str):
    """The stage-2 op(s) ``cache/stage2.py`` runs for ``setting`` on this state (no forced sink, the newest page)."""
    common = (st["kt_page"], st["topr"], st["topk"])
    if setting == "fused":
        return lambda: ops.paged_fused_decode(st["q"], st["kt"], st["k"], st["v"], st["table"], st["lengths"],
                                              *common, st["scaling"], k_scale=st["k_scale"], v_scale=st["v_scale"])

    def split():
        idx, valid = ops.paged_top_pages(st["q"], st["kt"], st["table"], st["lengths"], *common)
        return ops.paged_sparse_decode_attention(st["q"], st["k"], st["v"], st["table"], idx, valid, st["lengths"],
                                                 st["kt_page"], st["scaling"], k_scale=st["k_scale"],
                                                 v_scale=st["v_scale"])
    return split


def triton_launches(fn) -> int:
    """Triton kernel launches of one call of ``fn`` (every RocketKV kernel launches through ``TritonLaunch``)."""
    count = [0]
    original = launch_module.TritonLaunch.__getitem__

    def counting(self, grid):
        count[0] += 1
        return original(self, grid)

    launch_module.TritonLaunch.__getitem__ = counting
    try:
        fn()
    finally:
        launch_module.TritonLaunch.__getitem__ = original
    return count[0]


def time_us(fn, device: torch.device, reps: int = 20, replays: int = 30) -> float:
    """Median microseconds per call: a CUDA graph of ``reps`` calls replayed (host clock on CPU, one call)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return time_graph(fn, reps, replays)


def op_part(report: Report, device: torch.device, quick: bool, deadline: float) -> None:
    ops = get_ops("triton", device)
    for batch, layout in OPS_POINTS:
        batch = min(batch, 3) if quick else batch  # the interpreter runs a program at a time
        if time.perf_counter() > deadline:
            report.data["skipped"].append(f"op b{batch} {layout}: over --budget-s")
            continue
        st = layer_state(batch, layout, quick, device)
        outputs, row = {}, {"batch": batch, "layout": layout, "kept_tokens": int(st["lengths"].max()),
                                "kt_pages_per_row": st["table"].shape[1] * st["kt"].shape[2]}
        for setting in SETTINGS:
            fn = stage2_call(ops, st, setting)
            outputs[setting] = fn().float()
            row[f"{setting}_launches"] = triton_launches(fn)
            row[f"{setting}_us"] = time_us(fn, device)
        row["max_abs_diff"] = (outputs["fused"] - outputs["split"]).abs().max().item()
        row["speedup"] = row["split_us"] / row["fused_us"]
        report.add("op", row)


def sweep_part(report: Report, device: torch.device, quick: bool, deadline: float) -> None:
    """The fused op's launch knobs (splits of the select-and-attend kernel, its token tile, its warps) on the
    private layout, for tuning ``fused_splits`` and the tile defaults; each variant checked against the default."""
    from hf_rocketkv.kernels.fused_decode import fused_decode_launch

    for batch in ((1, 2) if quick else (1, 32, 64)):
        st = layer_state(batch, "private", quick, device)
        args = (st["q"], st["kt"], st["k"], st["v"], st["table"], st["lengths"], st["kt_page"], st["topr"],
                st["topk"], st["scaling"])
        want = fused_decode_launch(*args).float()
        splits = (2, 4, 8, 16) if batch == 1 else (1, 2)
        # with one split: the scoring pass inside the kernel (True) or its own launch (False)
        variants = [(n, bn, w, n == 1 or None) for n in splits for bn in (32, 64, 128) for w in (4, 8)]
        variants += [(1, bn, w, False) for bn in (64, 128) for w in (4, 8)]
        for num_splits, block_n, num_warps, one_launch in variants:
            if time.perf_counter() > deadline:
                report.data["skipped"].append(f"sweep b{batch}: over --budget-s")
                return

            def fn(args=args, num_splits=num_splits, block_n=block_n, num_warps=num_warps, one_launch=one_launch):
                return fused_decode_launch(*args, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                                           one_launch=one_launch)
            diff = (fn().float() - want).abs().max().item()
            report.add("sweep", {"batch": batch, "num_splits": num_splits, "block_n": block_n, "num_warps": num_warps,
                                 "one_launch": one_launch is True,
                                 "us": time_us(fn, device), "max_abs_diff": diff})


# ------------------------------------------------------------------------------------------------ step part
def step_part(report: Report, device: torch.device, quick: bool, new_tokens: int, deadline: float) -> None:
    from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model, warm_up
    from hf_rocketkv.config import RocketKVConfig

    model = build_model(TINY if quick else LLAMA_31_8B, None, torch.float32 if quick else torch.bfloat16, device,
                        seed=0)
    base = RocketKVConfig(backend="triton", decode_runner="cuda_graphs", prefill_batch_size=8)
    if quick:
        base = base.replace(prompt_budget=64, window_size=8, kernel_size=7, topk=8)
    warm_up(model, ["rocketkv"], base, device)
    points = ((1, 256), (2, 128)) if quick else STEP_POINTS
    for batch, context in points:
        tokens = {}
        for setting in SETTINGS:
            if time.perf_counter() > deadline:
                report.data["skipped"].append(f"step b{batch} x {context} {setting}: over --budget-s")
                continue
            ids = torch.randint(3, model.config.vocab_size, (batch, context), device=device,
                                generator=torch.Generator(device).manual_seed(batch))
            rocket = base.replace(stage2_kernel=setting, prefill_batch_size=min(batch, 8))
            steps = 6 if quick else new_tokens
            row = {"batch": batch, "context": context, "setting": setting, "new_tokens": steps}
            ms, table, out = one_step_run(model, ids, rocket, steps, device)
            tokens[setting] = out
            row.update(ms_per_token=ms, **table)
            if len(tokens) == 2:
                row["tokens_equal_split"] = bool(torch.equal(tokens["fused"], tokens["split"]))
            report.add("step", row)
            torch.cuda.empty_cache() if device.type == "cuda" else None


def one_step_run(model, ids, rocket, new_tokens: int, device: torch.device):
    """(median ms per decode step after the capture, kernel table of a profiler window or {}, the tokens)."""
    from transformers import LogitsProcessorList

    from hf_rocketkv import RocketKVCache
    from hf_rocketkv.bench.decode import StepClock
    from hf_rocketkv.integration import compat
    from hf_rocketkv.integration.registration import enable

    processors, profiler, window, steps = [StepClock(device)], None, None, 4
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        from benchmarks.probes.profile_graph_step import ProfileWindow

        profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        window = ProfileWindow(profiler, first=new_tokens - steps - 2, steps=steps)
        processors.append(window)
    enable(model)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **compat.cache_kwargs(RocketKVCache(rocket)),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                         logits_processor=LogitsProcessorList(processors))
    times = processors[0].seconds()
    end = new_tokens - steps - 3 if profiler is not None else None  # before the profiled steps
    gaps = [b - a for a, b in itertools.pairwise(times)][2 if device.type != "cuda" else 4:end]  # after the capture
    table = {}
    if profiler is not None:
        from benchmarks.probes.profile_graph_step import kernel_table

        full = kernel_table(profiler, steps)
        table = {"kernels_per_step": full["kernels_per_step"], "gpu_busy_ms_per_step": full["gpu_busy_ms_per_step"],
                     "rocketkv_triton_ms_per_step": full["families_ms_per_step"].get("rocketkv triton", 0.0),
                     "top_kernels": full["top_kernels"][:12]}
    return statistics.median(gaps) * 1e3 if gaps else None, table, out.cpu()


def main(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        print("no GPU: run with --quick for the CPU logic check", file=sys.stderr)
        return 2
    start = time.perf_counter()
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
               "torch": torch.__version__, "quick": args.quick}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    report = Report(Path(args.out), env)
    op_part(report, device, args.quick, start + args.budget_s)
    if not args.skip_step:
        step_part(report, device, args.quick, args.new_tokens, start + args.budget_s)
    if not args.quick or args.sweep:  # with the time left
        sweep_part(report, device, args.quick, start + args.budget_s)
    report.data["seconds"] = time.perf_counter() - start
    report.path.write_text(json.dumps(report.data, indent=1))
    print(f"wrote {report.path} in {report.data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
