"""GPU check and timings of the decode kernels: select_pages (old radix vs new sort), top_pages, append_token (vs
the old multi-op write), page_scores, sparse attention and a whole layer step (decode_attention + append).

    python -m benchmarks.probes.bench_kernels [--out DIR] [--quick] [--budget-s 150]   (< 3 min on an H100)
    python -m benchmarks.probes.bench_kernels --cpu-smoke                 (logic check, Triton interpreter)

Shapes: Llama-3.1-8B attention per layer (Hkv 8, G 4, D 128, bf16 K/V, fp8 KT), page 4, topk 64, topr 128, batch
1/4/32/64 x kept tokens 2,300 / 8,200 (ragged rows: up to 37 tokens fewer). Writes ``bench_kernels.json`` under
--out (default $OUT or ./out) after every shape and prints tables. Every section is guarded: a failure is recorded
and the run goes on; shapes not started within --budget-s seconds are skipped (recorded), so the run ends in time.

Timings, microseconds, median over many samples with CUDA events:
    graph_us   a CUDA graph of REPS back-to-back calls replayed (what a compiled decode step sees), per call
    eager_us   one eager call between two events (launch latency included)
    host_us    back-to-back eager calls, wall time per call (the host-bound cost eager decode pays)
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # logic check of this script on a CPU (tiny shapes, Triton interpreter)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import json
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch

from hf_rocketkv.kernels.append_token import append_token_torch, append_token_triton  # noqa: E402
from hf_rocketkv.kernels.kt_update import update_kt_triton  # noqa: E402
from hf_rocketkv.kernels.page_scores import page_scores_triton  # noqa: E402
from hf_rocketkv.kernels.select_pages import select_pages_launch, select_plan, top_pages_launch  # noqa: E402
from hf_rocketkv.kernels.sparse_decode_attention import (  # noqa: E402
    sparse_decode_attention_torch,
    sparse_decode_attention_triton,
)
from hf_rocketkv.selection import stage2_pages as s2  # noqa: E402

HKV, G, D, PAGE, TOPK, TOPR = 8, 4, 128, 4, 64, 128
KT_DTYPE = torch.float8_e5m2
RESULTS: dict = {"meta": {}, "correctness": [], "timing": [], "errors": []}
SMOKE = "--cpu-smoke" in sys.argv
DEV = torch.device("cpu" if SMOKE else "cuda")
REPS, REPLAYS, EAGER_ITERS = 10, 25, 30


def record(kind: str, **row) -> None:
    RESULTS[kind].append(row)
    print(kind[:4], json.dumps(row), flush=True)


def guarded(what: str, fn, *args, **kwargs):
    """Run one section; on failure record the error and go on (one GPU run must give every answer it can)."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - report and continue
        record("errors", what=what, error=repr(err)[:400], trace=traceback.format_exc()[-1500:])
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        return None


# ------------------------------------------------------------------------------------------------ timing
def _event():
    return torch.cuda.Event(enable_timing=True)


def time_graph(fn, reps: int = REPS, replays: int = REPLAYS) -> float:
    """Median microseconds per call of ``fn`` replayed as a CUDA graph of ``reps`` calls (``replays`` samples)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = _event(), _event()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(samples)


def time_eager(fn) -> tuple[float, float]:
    """(median event-timed microseconds of one eager call, host wall microseconds per back-to-back call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(EAGER_ITERS):
        start, end = _event(), _event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    t0 = time.perf_counter()
    for _ in range(EAGER_ITERS):
        fn()
    torch.cuda.synchronize()
    return statistics.median(samples), (time.perf_counter() - t0) * 1e6 / EAGER_ITERS


def measure(name: str, shape: dict, fn, graph: bool = True, eager: bool = True, reset=None, **extra) -> None:
    """Time ``fn`` (graph and/or eager); ``reset`` restores mutated state between the phases (outside timing)."""
    row = dict(op=name, **shape, **extra)
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        row["smoke_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        record("timing", **row)
        return
    if graph:
        try:
            row["graph_us"] = round(time_graph(fn), 2)
        except Exception as err:  # noqa: BLE001
            row["graph_error"] = repr(err)[:200]
            torch.cuda.synchronize()
        if reset:
            reset()
    if eager:
        row["eager_us"], row["host_us"] = (round(x, 2) for x in time_eager(fn))
        if reset:
            reset()
    record("timing", **row)


# ------------------------------------------------------------------------------------------------ state
class State:
    """One layer's decode state: K/V, positions, fp8 KT, ragged lengths, a query and the new token."""

    def __init__(self, batch: int, kept: int, gen: torch.Generator, headroom: int):
        capacity = -(-(kept + headroom) // PAGE) * PAGE
        kw = dict(device=DEV, generator=gen)
        self.keys = torch.randn(batch, HKV, capacity, D, dtype=torch.bfloat16, **kw)
        self.values = torch.randn(batch, HKV, capacity, D, dtype=torch.bfloat16, **kw)
        self.positions = torch.full((batch, HKV, capacity), -1, dtype=torch.int32, device=DEV)
        lengths = kept - torch.randint(0, 38, (batch,), **kw)
        lengths[0] = kept
        self.lengths0 = lengths
        self.lengths = lengths.clone()
        self.kt = s2.build_kt(self.keys, self.lengths, PAGE, KT_DTYPE)
        self.seen = torch.tensor(kept + 100, device=DEV)
        self.q = torch.randn(batch, HKV, G, D, dtype=torch.bfloat16, **kw) * 2
        self.k_new = torch.randn(batch, HKV, 1, D, dtype=torch.bfloat16, **kw)[:, :, 0]
        self.v_new = torch.randn(batch, HKV, 1, D, dtype=torch.bfloat16, **kw)[:, :, 0]
        self.scale = D**-0.5

    def reset(self) -> None:
        self.lengths.copy_(self.lengths0)


def old_append(st: State) -> None:
    """RocketKVLayer._append_one's writes before append_token (Triton update_kt)."""
    rows = torch.arange(st.keys.shape[0], device=DEV)
    slot = st.lengths
    st.keys[rows, :, slot] = st.k_new
    st.values[rows, :, slot] = st.v_new
    st.positions[rows, :, slot] = (st.seen - 1).to(torch.int32)
    update_kt_triton(st.kt, st.k_new, slot, PAGE)
    st.lengths.add_(1)


def new_append(st: State) -> None:
    append_token_triton(st.keys, st.values, st.positions, st.kt, st.lengths, st.seen, st.k_new, st.v_new, PAGE)


def legacy_select():
    from benchmarks.probes import legacy_select_pages

    return legacy_select_pages.select_pages_triton


def old_attention(st: State):
    n_pages = s2.num_pages(st.lengths, PAGE)
    probs = page_scores_triton(st.q, st.kt, n_pages, TOPR)
    idx, valid = legacy_select()(probs, n_pages, TOPK)
    return sparse_decode_attention_triton(st.q, st.keys, st.values, idx, valid, st.lengths, PAGE, st.scale)


def new_attention(st: State, **knobs):
    idx, valid = top_pages_launch(st.q, st.kt, st.lengths, PAGE, TOPR, TOPK, **knobs)
    return sparse_decode_attention_triton(st.q, st.keys, st.values, idx, valid, st.lengths, PAGE, st.scale)


# ------------------------------------------------------------------------------------------------ correctness
def same_sets(idx, valid, want_idx, want_valid) -> bool:
    big = torch.iinfo(torch.long).max
    a = torch.where(valid, idx, big).sort(-1).values
    b = torch.where(want_valid, want_idx, big).sort(-1).values
    return bool(torch.equal(a, b) and torch.equal(valid.sum(-1), want_valid.sum(-1)))


def check_correctness(st: State, shape: dict) -> None:
    n_pages = s2.num_pages(st.lengths, PAGE)
    probs = page_scores_triton(st.q, st.kt, n_pages, TOPR)
    probs_ref = s2.page_scores(st.q, st.kt, n_pages, TOPR)
    record("correctness", op="page_scores", **shape, rel=float((probs - probs_ref).norm() / probs_ref.norm()))
    want = s2.select_pages(probs, n_pages, TOPK)
    for tl_sort in (True, False):
        for chunk in ((None, 256) if tl_sort else (None,)):
            for sink, recent in ((0, 1), (4, 16)):
                got = select_pages_launch(probs, n_pages, TOPK, sink, recent, chunk=chunk, use_tl_sort=tl_sort)
                w = want if (sink, recent) == (0, 1) else s2.select_pages(probs, n_pages, TOPK, sink, recent)
                record("correctness", op="select_pages", **shape, tl_sort=tl_sort, chunk=chunk, sink=sink,
                       recent=recent, exact=bool(torch.equal(got[0], w[0]) and torch.equal(got[1], w[1])))
    per_head = st.lengths[:, None].expand(-1, HKV).clone()
    per_head[:, 1::2] -= 5  # ragged heads
    n_ph = s2.num_pages(per_head, PAGE)
    probs_ph = page_scores_triton(st.q, st.kt, n_ph, TOPR)
    got = select_pages_launch(probs_ph, n_ph, TOPK)
    w = s2.select_pages(probs_ph, n_ph, TOPK)
    record("correctness", op="select_pages_per_head", **shape, exact=bool(torch.equal(got[0], w[0])))
    top = top_pages_launch(st.q, st.kt, st.lengths, PAGE, TOPR, TOPK)
    legacy = legacy_select()(probs, n_pages, TOPK)
    record("correctness", op="top_pages", **shape, same_sets_as_scores_then_select=same_sets(*top, *want),
           legacy_same_sets=same_sets(*legacy, *want))
    out = sparse_decode_attention_triton(st.q, st.keys, st.values, *top, st.lengths, PAGE, st.scale)
    out_ref = sparse_decode_attention_torch(st.q, st.keys, st.values, *top, st.lengths, PAGE, st.scale)
    record("correctness", op="sparse_decode_attention", **shape,
           rel=float((out.float() - out_ref.float()).norm() / out_ref.float().norm()))
    # append_token: 3 tokens, Triton vs the reference, bit for bit; then the state goes back
    snap = [t.clone() for t in (st.keys, st.values, st.positions, st.kt, st.lengths)]
    ref_state = [t.clone() for t in snap]
    for _ in range(3):
        st.seen += 1
        new_append(st)
        append_token_torch(*ref_state, st.seen, st.k_new, st.v_new, PAGE)
    mine = (st.keys, st.values, st.positions, st.kt, st.lengths)
    record("correctness", op="append_token", **shape,
           exact=all(torch.equal(a.float(), b.float()) for a, b in zip(mine, ref_state)))
    for t, s in zip(mine, snap):
        t.copy_(s)


def check_compile() -> None:
    """append_token + top_pages + sparse attention inside torch.compile(fullgraph=True) == eager, and the compiled
    step does not copy the K/V buffers (functionalised in-place ops must be re-inplaced)."""
    from hf_rocketkv.kernels.triton_ops import TRITON_OPS as T

    gen = torch.Generator(device=DEV).manual_seed(5)
    st = State(4, 2300, gen, 64)

    def step(keys, values, positions, kt, lengths, seen, q, k_new, v_new):
        T.append_token(keys, values, positions, kt, lengths, seen, k_new, v_new, PAGE)
        idx, valid = T.top_pages(q, kt, lengths, PAGE, TOPR, TOPK)
        return T.sparse_decode_attention(q, keys, values, idx, valid, lengths, PAGE, D**-0.5)

    args = [st.keys, st.values, st.positions, st.kt, st.lengths, st.seen, st.q, st.k_new, st.v_new]
    eager_args = [a.clone() for a in args]
    want = step(*eager_args)
    compiled = torch.compile(step, fullgraph=True)
    compiled(*[a.clone() for a in args])  # the first call compiles
    work = [a.clone() for a in args]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = compiled(*work)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    kv_bytes = 2 * st.keys.numel() * st.keys.element_size()
    record("correctness", op="compiled_step", equal_to_eager=bool(torch.equal(got, want)),
           state_equal=all(torch.equal(a.float(), b.float()) for a, b in zip(work[:5], eager_args[:5])),
           peak_extra_bytes=int(extra), kv_bytes=int(kv_bytes), kv_copied=bool(extra >= kv_bytes // 2))


# ------------------------------------------------------------------------------------------------ timings
def time_shape(st: State, shape: dict, quick: bool) -> None:
    n_pages = s2.num_pages(st.lengths, PAGE)
    probs = page_scores_triton(st.q, st.kt, n_pages, TOPR)
    np_total = st.kt.shape[2]
    measure("page_scores", shape, lambda: page_scores_triton(st.q, st.kt, n_pages, TOPR))
    measure("select_old_radix", shape, lambda: legacy_select()(probs, n_pages, TOPK))
    chunks = (512, 1024, 4096) if quick else (256, 512, 1024, 2048, 4096)
    seen_plans = []
    for chunk in chunks:
        plan = select_plan(np_total, TOPK, chunk)
        if plan in seen_plans:
            continue  # a larger chunk than the row: the same launches as the previous one
        seen_plans.append(plan)
        for tl_sort in ((True, False) if chunk == 1024 or plan["num_chunks"] == 1 else (True,)):
            measure("select_new", shape, lambda c=chunk, t=tl_sort: select_pages_launch(probs, n_pages, TOPK, chunk=c,
                                                                                       use_tl_sort=t),
                    chunk=chunk, tl_sort=tl_sort, plan=plan)
    for chunk in (512, 1024, 4096):
        measure("top_pages", shape, lambda c=chunk: top_pages_launch(st.q, st.kt, st.lengths, PAGE, TOPR, TOPK, chunk=c),
                chunk=chunk)
    # stage2_score="head_bound": two dot products per page tile instead of one (the default chunk)
    measure("top_pages_head_bound", shape,
            lambda: top_pages_launch(st.q, st.kt, st.lengths, PAGE, TOPR, TOPK, per_head_bound=True))
    idx, valid = top_pages_launch(st.q, st.kt, st.lengths, PAGE, TOPR, TOPK)
    measure("sparse_attention", shape,
            lambda: sparse_decode_attention_triton(st.q, st.keys, st.values, idx, valid, st.lengths, PAGE, st.scale))
    measure("append_old_multi_op", shape, lambda: old_append(st), reset=st.reset)
    measure("append_token", shape, lambda: new_append(st), reset=st.reset)
    st.reset()
    measure("attention_old", shape, lambda: old_attention(st))
    measure("attention_new", shape, lambda: new_attention(st))
    measure("layer_old", shape, lambda: (old_append(st), old_attention(st)), reset=st.reset)
    measure("layer_new", shape, lambda: (new_append(st), new_attention(st)), reset=st.reset)
    st.reset()


def summary() -> None:
    rows = [r for r in RESULTS["timing"] if "graph_us" in r or "smoke_ms" in r]
    print("\n== timings (us per call: graph replay / eager events / eager host) ==")
    print(f"{'op':<22}{'batch':>6}{'kept':>6}  {'variant':<28}{'graph':>9}{'eager':>9}{'host':>9}")
    for r in rows:
        variant = ",".join(f"{k}={r[k]}" for k in ("chunk", "tl_sort") if k in r)
        print(f"{r['op']:<22}{r['batch']:>6}{r['kept']:>6}  {variant:<28}{r.get('graph_us', r.get('smoke_ms', '')):>9}"
              f"{r.get('eager_us', ''):>9}{r.get('host_us', ''):>9}")
    bad = [r for r in RESULTS["correctness"] if r.get("exact") is False or r.get("equal_to_eager") is False
           or r.get("same_sets_as_scores_then_select") is False or r.get("kv_copied") is True]
    print(f"\n== correctness: {len(RESULTS['correctness'])} checks, {len(bad)} failed; errors: {len(RESULTS['errors'])}")
    for r in bad:
        print("FAILED", json.dumps(r))
    for r in RESULTS["errors"]:
        print("ERROR", r["what"], r["error"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--quick", action="store_true", help="fewer select variants")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip the remaining shapes after this")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    RESULTS["meta"] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
        device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter smoke)",
        torch=torch.__version__, triton=triton.__version__, shapes=dict(HKV=HKV, G=G, D=D, page=PAGE, topk=TOPK,
                                                                        topr=TOPR, kt=str(KT_DTYPE)),
        reps=REPS, replays=REPLAYS, eager_iters=EAGER_ITERS,
    )
    started = time.perf_counter()
    shapes = [(2, 40)] if SMOKE else [(b, kept) for kept in (2300, 8200) for b in (1, 4, 32, 64)]
    gen = torch.Generator(device=DEV).manual_seed(0)
    for i, (batch, kept) in enumerate(shapes):
        shape = dict(batch=batch, kept=kept)
        if time.perf_counter() - started > args.budget_s:
            record("errors", what=f"skipped {shape}", error=f"time budget of {args.budget_s} s spent")
            continue
        # headroom for every append the timings make (graph warm-up + capture + replays, eager phases)
        st = guarded(f"state {shape}", State, batch, kept, gen, 64 if SMOKE else 2048)
        if st is not None:
            guarded(f"correctness {shape}", check_correctness, st, shape)
            guarded(f"timing {shape}", time_shape, st, shape, args.quick)
            del st
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
            if i == 3:  # after the 2,300-token shapes: the compiled step (inductor compile, ~20-40 s)
                guarded("compile check", check_compile)
        RESULTS["meta"]["elapsed_s"] = round(time.perf_counter() - started, 1)
        (out_dir / "bench_kernels.json").write_text(json.dumps(RESULTS, indent=1))
    RESULTS["meta"]["elapsed_s"] = round(time.perf_counter() - started, 1)
    (out_dir / "bench_kernels.json").write_text(json.dumps(RESULTS, indent=1))
    summary()
    return 0


if __name__ == "__main__":
    sys.exit(main())
