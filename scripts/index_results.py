"""Write results/index.md: one row per raw result file of results/, one per evaluation run folder of results/eval/,
one per GPU test run of results/gpu_tests/, each with its device, date, commit, command and what it measures.

    python scripts/index_results.py            # rewrites results/index.md
    python scripts/index_results.py --check    # exit 1 if results/index.md is not what it would write

Each field is read, in this order, from the file itself (the ``device`` / ``date`` / ``commit`` / ``command``
fields many JSON results hold, at the top or under ``env`` / ``meta`` / ``environment``; a log's
``=== step (limit Ns): COMMAND`` first line; a note's "commit abc1234"), then from the file name
(``<device>_<YYYY-MM-DD>_...``), then from git: a file whose measured commit is unknown says "added in <commit>",
the commit that first added it (under benchmarks/results/ or docs/results/, where the files lived before results/).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
EARLIER_HOMES = {"benchmarks/results/": "results/", "docs/results/": "results/eval/"}
NAME = re.compile(r"^(?P<device>h100|h200|cpu)(?:x(?P<gpus>\d+))?_(?P<date>\d{4}-\d{2}-\d{2})_?(?P<rest>.*)$")
COMMIT_IN_TEXT = re.compile(r"\bcommit[\s:=\"']+([0-9a-f]{7,40})\b")
STEP_LINE = re.compile(r"^=== (?P<step>\S+) \(limit \d+s\): (?P<command>.+)$")
EVAL_FILES = ("results.json", "sweep.json", "kvpress_results.json")

# what a result measures, by the name of the run (device, date and run-order tags like "s4_" removed): first match
WHAT = [
    (r"^fidelity_guard", "the recommended setting's top-1 agreement on python_reference.txt windows and the multi-key "
                         "needle: the floor of tests/eval/test_fidelity_guard.py (benchmarks/fidelity_guard.py)"),
    (r"^fidelity_study", "fidelity study: dense layers, budget schedules, page sizes, stage-2 options "
                         "(benchmarks/fidelity_study.py; _kvpress: kvpress presses on the same windows)"),
    (r"^start_time", "import, --help and a command-line mistake, each in a fresh interpreter (benchmarks/start_time.py)"),
    (r"^test_suite_times", "wall time of the test suite: the default command and CI's full runs"),
    (r"^fused_norm", "decode ms/token with the fused RMSNorm (hf_rocketkv.bench.decode)"),
    (r"^gemm_floor", "a decode step's weight GEMMs against the memory floor (benchmarks/probes/gemm_floor.py)"),
    (r"^load_(chunks|concurrent|curve)", "batching engine under Poisson arrivals: tokens/s, ITL and TTFT p50/p99 "
                                         "(benchmarks/batching_throughput.py)"),
    (r"^peak_64x32k", "peak GiB of generate_batch 64 x 32k with a fixed or the default pool (benchmarks/peak_64x32k.py)"),
    (r"^decode_attention_launches", "kernel launches per decode step per attention module by layer kind, CPU, Triton "
                                    "interpreter (benchmarks/probes/launch_counts.py --decode-attention)"),
    (r"profile_gemma3_step", "one hybrid decode step by kind of kernel (benchmarks/probes/profile_hybrid_step.py)"),
    (r"^profile_b1|^profile_chunked", "profile of a decode step or of a chunked prefill's chunks (benchmarks/probes/)"),
    (r"causal_prefill_probes", "cuDNN causal prefill attention: graph build times and shapes (a probe script)"),
    (r"^split_", "the default decode (rocketkv-graphs) before the package split (commit 0386f3e) and after it, "
                 "side by side on one GPU in one device call: decode ms/token, prefill s, peak GiB"),
    (r"_tests|^kernel_tests", "pytest log of GPU tests on that machine"),
    (r"^packed_step_profile", "a packed engine step against a chunk forward alone: elapsed and device time, kernels "
                              "(benchmarks/probes/packed_step_profile.py)"),
    (r"^packed_steps", "generate_batch with packed engine steps against alternating ones, side by side in one "
                       "process: output tokens/s per workload (benchmarks/packed_steps.py)"),
    (r"^decode_under_arrivals", "per-user decode rate of running requests while long prompts arrive, per "
                                "chunked-prefill setting (benchmarks/decode_under_arrivals.py)"),
    (r"^gpu_kernel_check", "Triton ops against their PyTorch references at Llama-3.1-8B shapes, and per-op times "
                           "at 2k-100k tokens (now tests/gpu/test_kernels_large_shapes_gpu.py and "
                           "benchmarks/probes/decode_ops_scaling.py)"),
    (r"compile_check", "generate()'s compiled decode against eager decode: same tokens, recompiles, ms/token (now "
                       "tests/gpu/test_compiled_decode_gpu.py)"),
    (r"^gpu_graph_check|^graph_regions", "CUDA-graph and torch.compile decode against eager: tokens equal, "
                                         "ms/token, first-call time (now tests/gpu/test_decode_graphs_gpu.py)"),
    (r"^decode_compression", "decode-time compression: CUDA-graph tokens against eager, capacity bound, ms/token "
                             "(now tests/gpu/test_decode_compression_gpu.py)"),
    (r"^onload_exact", "prefix hit onloaded from host memory against the device hit, bit for bit (now "
                       "tests/gpu/test_prefix_onload_gpu.py)"),
    (r"^pool_gpu_check", "host offload: bit-exact round trips, offload / onload GB/s, overlap with compute "
                         "(now tests/gpu/test_pool_offload_gpu.py and benchmarks/probes/offload_bandwidth.py)"),
    (r"^tp_verify", "tensor parallel on 2 GPUs against 1, step level: kept positions, selected pages, logits "
                    "(now tests/gpu/test_tensor_parallel_gpu.py)"),
    (r"^lockstep", "batching engine under tensor parallelism against 1 GPU: tokens/s, TTFT, same events on every "
                   "rank (benchmarks/tp_serving_throughput.py)"),
    (r"^tp_(speed|profile)", "tensor-parallel TTFT and decode ms/token against 1 GPU (benchmarks/tp_speed.py)"),
    (r"batching|mixed_curve|fp8_vs_bf16_fixed", "batching engine: output tokens/s, TTFT p50/p99, ms per decode step "
                                                "(benchmarks/batching_throughput.py)"),
    (r"engine_prefill", "profile of one prefill inside the batching engine"),
    (r"^first_call", "generate_batch's first call against its second, from a fresh process (benchmarks/first_call.py)"),
    (r"cudnn_graph", "cuDNN's attention graph builds per input layout (a probe script, in the file)"),
    (r"serve_\d+_streams", "the documented hf-rocketkv serve command under concurrent streams: wall time, first "
                           "tokens, texts (benchmarks/serve_streams.py)"),
    (r"^bench_kernels", "decode kernel timings and their sanity checks (benchmarks/probes/bench_kernels.py)"),
    (r"^bench_fp8_append", "decode append on fp8 against bf16 pool pages, device time "
                           "(benchmarks/probes/bench_fp8_append.py)"),
    (r"^tune_", "launch-parameter sweep of the decode kernels (benchmarks/probes/tune_decode_kernels.py)"),
    (r"^decode_host_time", "host time of an eager decode step per function (benchmarks/probes/decode_host_time.py)"),
    (r"^eager_layer_time", "host microseconds of one layer's eager decode step by part "
                           "(benchmarks/probes/eager_layer_time.py)"),
    (r"^eager_", "eager decode time per token (a note with its method)"),
    (r"^launch_overhead", "host microseconds per eager call of the decode ops against a bare Triton launch "
                          "(benchmarks/probes/launch_overhead.py)"),
    (r"^prefill_(host_time|cprofile)", "host time of a pool-backed prefill per function "
                                       "(benchmarks/probes/prefill_host_time.py)"),
    (r"^profile_prefill", "where a cold prefill's time goes (benchmarks/probes/profile_prefill.py)"),
    (r"^profile_prefix_hit", "where a prefix hit's time to first token goes (benchmarks/probes/profile_prefix_hit.py)"),
    (r"^profile_(graph|b64|pool)", "device time of a CUDA-graph decode step per kernel "
                                   "(benchmarks/probes/profile_graph_step.py)"),
    (r"^profile_(decode_step|b1_8k)", "where a compiled decode step spends its time "
                                      "(benchmarks/probes/profile_decode_step.py)"),
    (r"prefix_(reuse|equal)", "prefix reuse, host onload, decode with a pool, batch-64 memory "
                              "(benchmarks/bench_prefix_reuse.py)"),
    (r"^sync_sites", "host-device synchronisations by call site (benchmarks/probes/sync_sites.py)"),
    (r"^triton_compiles", "Triton kernels compiled per request (benchmarks/probes/triton_compiles.py)"),
    (r"^long_prefill", "peak GiB and time of a 128k prefill, chunked and not (benchmarks/probes/long_prefill_memory.py)"),
    (r"^workload", "a mixed workload of generate() calls per cache (hf-rocketkv bench --workload)"),
    (r"decode|^bench_b\d|^firstrun|^repeat_static|^before_deferred|^query_offset",
     "decode ms/token, prefill s and peak GiB per cache (the decode benchmark, hf_rocketkv.bench.decode)"),
]


def git_added() -> dict[str, tuple[str, str]]:
    """results-relative path -> (short commit, date) of the commit that first added the file, wherever it lived."""
    try:
        log = subprocess.run(["git", "log", "--diff-filter=A", "--name-only", "--format=@%h %ad", "--date=short",
                              "--", "benchmarks/results", "docs/results", "results"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    added: dict[str, tuple[str, str]] = {}
    commit = None
    for line in log.splitlines():
        if line.startswith("@"):
            commit = tuple(line[1:].split(" ", 1))
        elif line.strip() and commit is not None:
            path = line.strip()
            for old, new in EARLIER_HOMES.items():
                if path.startswith(old):
                    path = new + path[len(old):]
                    break
            added[path.removeprefix("results/")] = commit  # newest first: the last one seen is the first add
    return added


def short_device(name: str) -> str:
    for gpu in ("H100", "H200", "A100", "L40S"):
        if gpu in name.upper():
            return gpu
    return "CPU" if name.strip().lower().startswith("cpu") else name


def fields_of(data) -> dict:
    """device / date / commit / command found in a JSON result (top level or one level down)."""
    found: dict = {}
    places = [data] if isinstance(data, dict) else [data[0]] if isinstance(data, list) and data else []
    if isinstance(data, dict):
        places += [data[k] for k in ("env", "meta", "environment") if isinstance(data.get(k), dict)]
    for place in places:
        if not isinstance(place, dict):
            continue
        for key, target in (("device", "device"), ("date", "date"), ("started", "date"), ("commit", "commit"),
                            ("command", "command"), ("argv", "command")):
            value = place.get(key)
            if value and target not in found and isinstance(value, (str, list)):
                found[target] = " ".join(map(str, value)) if isinstance(value, list) else value
    return found


def read_head(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.read(4000)


def describe_file(path: Path, added: dict) -> dict:
    rel = path.relative_to(RESULTS).as_posix()
    head = read_head(path)
    row: dict = {}
    first = head.splitlines()[0] if head else ""
    step = STEP_LINE.match(first)
    if step:
        row["command"] = step["command"]
    if path.suffix == ".json":
        try:
            row |= {k: v for k, v in fields_of(json.loads(path.read_text())).items() if k not in row}
        except ValueError:
            pass
    else:  # jsonl and logs: the first JSON line
        for line in head.splitlines()[:3]:
            if line.startswith("{"):
                try:
                    row |= {k: v for k, v in fields_of(json.loads(line)).items() if k not in row}
                except ValueError:
                    pass
                break
    if "commit" not in row and (match := COMMIT_IN_TEXT.search(head)):
        row["commit"] = match.group(1)
    name = NAME.match(path.stem)
    rest = name["rest"] if name else path.stem
    rest = re.sub(r"^s\d+_", "", rest)
    if step:
        rest = step["step"] if not rest else rest
    if name and (not row.get("device") or row["device"].lower().startswith("cuda")):  # "cuda" names no GPU
        row["device"] = name["device"].upper()
    if name and name["gpus"]:
        row["device"] = f"{name['gpus']}x {short_device(row['device'])}"
    if "date" not in row and name:
        row["date"] = name["date"]
    if path.suffix == ".md" and first.startswith("#"):
        what = first.lstrip("#").strip()
    elif path.suffix in (".md", ".txt") and not step and first and not first.startswith("{"):
        what = first.strip()[:160]
    else:
        what = next((text for pattern, text in WHAT if re.search(pattern, rest)), "-")
    return finish(rel, row, what, added)


def describe_eval(folder: Path, added: dict) -> dict:
    """One evaluation run: its results.json / sweep.json / kvpress_results.json."""
    rel = folder.relative_to(RESULTS).as_posix() + "/"
    main = next(folder / name for name in EVAL_FILES if (folder / name).is_file())
    data = json.loads(main.read_text())
    row = fields_of(data)
    header = data.get("header", "") if isinstance(data, dict) else ""
    if header:  # "Accuracy sweep, 2026-11-23, device cpu, ..." / "kvpress 0.5.5, ..., 2026-11-27, ..."
        if (date := re.search(r"\d{4}-\d{2}-\d{2}", header)) and "date" not in row:
            row["date"] = date.group(0)
        if (device := re.search(r"device (\w+)", header)) and "device" not in row:
            row["device"] = device.group(1)
        if "kvpress" in header:
            row.setdefault("device", "cpu" if "+cpu" in header else "-")
    if main.name == "sweep.json":
        tasks = data.get("args", {}).get("tasks", [])
        ran = set(tasks) | ({"needle"} if "niah" in tasks else set())  # the header describes both tasks' settings
        parts = [p.strip() for p in header.split(";")[1:] if p.strip().split(":")[0] in ran]
        what = f"accuracy sweep: {'; '.join(parts)}"
        row.setdefault("command", "python -m benchmarks.accuracy_sweep (args in sweep.json)")
    elif main.name == "kvpress_results.json":
        what = f"kvpress presses on the fidelity texts: {header}"
        row.setdefault("command", "python -m benchmarks.kvpress_fidelity run")
    else:
        settings = data.get("eval", {})
        what = (f"hf-rocketkv eval {', '.join(settings.get('tasks', []))} on {data.get('model') or 'SmolLM2'}: "
                f"{', '.join(settings.get('methods', []))}")
    first_file = min((p.relative_to(RESULTS).as_posix() for p in folder.rglob("*") if p.is_file()),
                     key=lambda p: added.get(p, ("~", "~"))[1])
    return finish(rel, row, what, added, git_path=first_file)


def describe_gpu_tests(path: Path, added: dict) -> dict:
    record = json.loads(path.read_text())
    row = {k: record.get(k) for k in ("device", "date", "commit", "command") if record.get(k)}
    if record.get("gpu_count", 1) > 1:
        row["device"] = f"{record['gpu_count']}x {short_device(row.get('device', '?'))}"
    what = (f"GPU tests: {record.get('passed', 0)} passed, {record.get('failed', 0)} failed, "
            f"{record.get('skipped', 0)} skipped, {record.get('error', 0)} errors")
    return finish(path.relative_to(RESULTS).as_posix(), row, what, added)


def describe_gpu_log(path: Path, added: dict) -> dict:
    """A pytest log of GPU tests, named ``<device>_<date>_<commit>_<what>.log``."""
    parts = path.stem.split("_", 3)
    row = {"device": parts[0], "date": parts[1] if len(parts) > 1 else "-", "commit": parts[2] if len(parts) > 2 else "-"}
    what = f"pytest log of GPU tests: {parts[3].replace('_', ' ')}" if len(parts) > 3 else "pytest log of GPU tests"
    return finish(path.relative_to(RESULTS).as_posix(), row, what, added)


def first_added(rel: str) -> tuple[str, str] | None:
    """(commit, date) of the commit that added ``results/<rel>``, following renames (one git call per file)."""
    try:
        log = subprocess.run(["git", "log", "--follow", "--diff-filter=A", "--format=%h %ad", "--date=short", "--",
                              f"results/{rel}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    lines = log.split("\n")
    lines = [line for line in lines if line.strip()]
    return tuple(lines[-1].split(" ", 1)) if lines else None


def finish(rel: str, row: dict, what: str, added: dict, git_path: str | None = None) -> dict:
    commit_added = added.get(git_path or rel) or first_added(git_path or rel)
    commit = row.get("commit") or (f"added in {commit_added[0]}" if commit_added else "-")
    date = row.get("date") or (commit_added[1] if commit_added else "-")
    device = row.get("device")
    return {"path": rel, "device": short_device(device) if device and "x " not in device else (device or "-"),
            "date": str(date)[:10], "commit": commit, "command": row.get("command") or "-", "what": what}


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict]) -> list[str]:
    lines = ["| path | device | date | commit | command | what it is |", "|---|---|---|---|---|---|"]
    for r in rows:
        command = f"`{cell(r['command'])}`" if r["command"] != "-" else "-"
        lines.append(f"| [{cell(r['path'])}]({r['path']}) | {cell(r['device'])} | {r['date']} | {cell(r['commit'])} "
                     f"| {command} | {cell(r['what'])} |")
    return lines


def render() -> str:
    added = git_added()
    files = sorted(p for p in RESULTS.iterdir() if p.is_file() and p.name != "index.md")
    evals = sorted({p.parent for name in EVAL_FILES for p in (RESULTS / "eval").rglob(name)})
    evals = [f for f in evals if not any(other in f.parents for other in evals)]  # a sweep's task folders: its own
    gpu_tests = sorted(p for p in (RESULTS / "gpu_tests").iterdir() if p.is_file()) if (RESULTS / "gpu_tests").is_dir() else []
    out = ["# Raw results", "",
           "Every measurement kept in this repository, one row per file (evaluations: one row per run folder): only "
           "files that README.md, docs/, CHANGELOG.md, the tests, the code or the scripts cite are kept. "
           "Generated by `python scripts/index_results.py` from the files themselves, their names and git; "
           "\"added in <commit>\" means the file does not record the commit it measured. Commands are as they ran "
           "then: several scripts have since moved (benchmarks/README.md lists today's, tests/gpu/ holds the "
           "former GPU checks).", "",
           f"## GPU and CPU measurements ({len(files)} files)", ""]
    out += table([describe_file(p, added) for p in files])
    out += ["", f"## Evaluations: results/eval/ ({len(evals)} runs)", ""]
    out += table([describe_eval(f, added) for f in evals])
    out += ["", f"## GPU test runs: results/gpu_tests/ ({len(gpu_tests)} runs, `bash scripts/gpu_tests.sh`)", ""]
    out += table([describe_gpu_tests(p, added) if p.suffix == ".json" else describe_gpu_log(p, added)
                  for p in gpu_tests]) if gpu_tests else ["(none yet)"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with results/index.md instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    index = RESULTS / "index.md"
    if args.check:
        current = index.read_text() if index.exists() else ""
        print("results/index.md is up to date" if current == text else "results/index.md is stale: regenerate it")
        return 0 if current == text else 1
    index.write_text(text)
    print(f"wrote {index.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
