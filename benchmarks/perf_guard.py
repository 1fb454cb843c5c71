"""A performance guard that can fail: the headline cases beside their baselines in ONE process, each case's ratio
judged against a floor recorded in ``benchmarks/perf_floors.json``.

    bash scripts/perf_guard.sh                                   # on a GPU: both cases, then the verdict
    python -m benchmarks.perf_guard --quick --out out/pg        # CPU: tiny shapes, the script's logic (not judged)
    python -m benchmarks.perf_guard --judge FILE [--device nvidia-h200]  # judge a measurements file only (dry run)

Cases (``CASES``):

  decode_bs1_32k   decode ms/token at batch 1 x 32k, Llama-3.1-8B shapes, random bf16 weights, 64 new tokens:
                   RocketKV with its defaults (``rocketkv-graphs``) beside StaticCache + torch.compile
                   (``static-compile``, cuDNN attention on for it), one ``hf_rocketkv.bench.decode`` run, the command
                   of record ``python -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 --caches
                   rocketkv-graphs static-compile --cudnn-for-static``. Ratio: the speed-up, static ms / RocketKV ms.
  engine_32x8k     ``generate_batch`` of 32 prompts x 8,192 tokens / 512 new tokens (greedy, EOS ignored) on a 30 GiB
                   ``KVBlockPool``: output tokens/s of the second call (the first compiles the Triton kernels and
                   captures the graphs). Ratio: this / the same case in the previous result file of this device (the
                   newest ``<device>_*.json`` under ``--previous-dir``, default the output folder), or / the floor
                   file's value of record when there is none.

  hybrid_gemma3_32k  decode ms/token at batch 1 x 32k, Gemma-3-12B shapes (48 layers, 40 of them sliding), random
                   bf16 weights, through ``model.generate()``: RocketKV with its defaults beside StaticCache +
                   torch.compile, one ``benchmarks.hybrid_decode`` run (``python -m benchmarks.hybrid_decode --models
                   gemma-3-12b --caches rocketkv static-compile``; about 200 s, most of it compiling the static
                   cache's step). Ratio: the speed-up, static ms / RocketKV ms. ``--quick`` compares with
                   DynamicCache instead (the static cache compiles on CUDA only).

A case passes when its ratio is at least its floor: ``value_of_record x (1 - tolerance)`` for a speed-up,
``1 - tolerance`` against the previous result; the tolerance is the device noise the floor file records. A speed-up
case whose floor also records ``rocketkv_ms_of_record`` fails too when RocketKV's ms/token exceed it by more than the
tolerance: a baseline that ran slow (a compile that fell back) cannot hide a slower RocketKV behind a high ratio. Each case
prints one line, ``ok`` or ``FAIL`` with the numbers; the exit status is 1 when any case fails (a case that could not
be measured fails too), 0 otherwise, also when the device has no floors (every case then prints ``not judged``).

The result file is written like the GPU suite's: ``<out>/<device-slug>_<UTC date>_<commit>.json`` (``--out``
default ``results/perf_guard``; ``--commit`` default ``$COMMIT``, else ``git rev-parse --short HEAD``), with the
environment, each case's measurements and verdict. ``--quick`` runs both cases at tiny shapes on the CPU
(``hf_rocketkv.bench.decode --quick`` shapes; 4 prompts x 96 / 8 new tokens): a check of the script, whose numbers
mean nothing, judged against no floor (the floor file holds GPU kinds only).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = Path(__file__).resolve().parent / "perf_floors.json"
CASES = ("decode_bs1_32k", "engine_32x8k", "hybrid_gemma3_32k")
SPEEDUP_CASES = {"decode_bs1_32k": "RocketKV", "hybrid_gemma3_32k": "RocketKV on Gemma-3-12B"}
DECODE_ARGS = ["--batch", "1", "--context", "32768", "--new-tokens", "64", "--caches", "rocketkv-graphs",
               "static-compile", "--cudnn-for-static", "--no-plot"]
QUICK_DECODE_ARGS = ["--quick", "--batch", "1", "--context", "96", "--caches", "rocketkv-graphs", "static-compile",
                     "--no-plot"]
HYBRID_ARGS = ["--models", "gemma-3-12b", "--caches", "rocketkv", "static-compile"]
QUICK_HYBRID_ARGS = ["--quick", "--models", "gemma-3-12b", "--caches", "rocketkv", "dynamic", "--new-tokens", "8"]
ENGINE = dict(requests=32, prompt_len=8192, new_tokens=512, pool_gib=30.0)
QUICK_ENGINE = dict(requests=4, prompt_len=96, new_tokens=8, pool_gib=0.05)
EXACT = 1e-9  # a ratio equal to its floor up to float rounding (3.0 x 0.9 is 2.7000000000000006) passes


# ------------------------------------------------------------------------------------------------ the verdict
@dataclasses.dataclass
class Verdict:
    case: str
    status: str  # "ok", "FAIL" or "not judged"
    ratio: float | None
    floor: float | None
    line: str


def device_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200`` (as scripts/gpu_test_summary.py names the GPU suite's files)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def load_floors(path: Path = FLOORS) -> dict:
    """The floor file, checked: every case of a device has a positive value of record and a tolerance in [0, 1)."""
    floors = json.loads(Path(path).read_text())
    for device, cases in floors["devices"].items():
        for case, floor in cases.items():
            if case not in CASES:
                raise ValueError(f"{path}: device {device!r} has a floor for unknown case {case!r} (cases: {CASES})")
            if not floor.get("value_of_record", 0) > 0 or not 0 <= floor.get("tolerance", -1) < 1:
                raise ValueError(f"{path}: {device}/{case} needs value_of_record > 0 and tolerance in [0, 1), got "
                                 f"{floor}")
            if "rocketkv_ms_of_record" in floor and not floor["rocketkv_ms_of_record"] > 0:
                raise ValueError(f"{path}: {device}/{case} rocketkv_ms_of_record must be > 0, got "
                                 f"{floor['rocketkv_ms_of_record']}")
            for key in ("metric", "source"):
                if not floor.get(key):
                    raise ValueError(f"{path}: {device}/{case} must say its {key}")
    return floors


def judge_decode(measured: dict | None, floor: dict | None, case: str = "decode_bs1_32k") -> Verdict:
    """A speed-up case (``SPEEDUP_CASES``): the baseline's ms/token over RocketKV's against its floor."""
    if not measured or measured.get("error") or not measured.get("ratio"):
        why = (measured or {}).get("error") or "no measurement"
        return Verdict(case, "FAIL", None, None, f"FAIL {case}: {why}")
    baseline = measured.get("baseline", "StaticCache+compile")
    numbers = (f"speed-up {measured['ratio']:.2f}x ({baseline} {measured['baseline_ms']:.2f} ms / "
               f"{SPEEDUP_CASES[case]} {measured['rocketkv_ms']:.2f} ms per token)")
    if floor is None:
        return Verdict(case, "not judged", measured["ratio"], None, f"not judged {case}: {numbers}; no floor recorded "
                                                                    f"for this device")
    lowest = floor["value_of_record"] * (1 - floor["tolerance"])
    status = "ok" if measured["ratio"] >= lowest - EXACT else "FAIL"
    line = (f"{numbers}, floor {lowest:.2f}x ({floor['value_of_record']:.2f}x of record less "
            f"{floor['tolerance']:.0%})")
    if "rocketkv_ms_of_record" in floor:  # the ratio alone would pass a slower RocketKV beside a slower baseline
        ceiling = floor["rocketkv_ms_of_record"] * (1 + floor["tolerance"])
        if measured["rocketkv_ms"] > ceiling + EXACT:
            status = "FAIL"
        line += (f", ceiling {ceiling:.2f} ms ({floor['rocketkv_ms_of_record']:.2f} ms of record plus "
                 f"{floor['tolerance']:.0%})")
    return Verdict(case, status, measured["ratio"], lowest, f"{status} {case}: {line}")


def judge_engine(measured: dict | None, floor: dict | None, previous: dict | None) -> Verdict:
    """``previous``: ``{"tokens_per_s", "source"}`` of the previous result of this device (None: the floor's value of
    record is the reference)."""
    case = "engine_32x8k"
    if not measured or measured.get("error") or not measured.get("tokens_per_s"):
        why = (measured or {}).get("error") or "no measurement"
        return Verdict(case, "FAIL", None, None, f"FAIL {case}: {why}")
    numbers = f"{measured['tokens_per_s']:.1f} output tokens/s (second call)"
    if floor is None:
        return Verdict(case, "not judged", None, None, f"not judged {case}: {numbers}; no floor recorded for this "
                                                       f"device")
    reference, source = ((previous["tokens_per_s"], previous["source"]) if previous
                         else (floor["value_of_record"], floor["source"]))
    ratio, lowest = measured["tokens_per_s"] / reference, 1 - floor["tolerance"]
    status = "ok" if ratio >= lowest - EXACT else "FAIL"
    return Verdict(case, status, ratio, lowest,
                   f"{status} {case}: {numbers} = {ratio:.3f} of {reference:.1f} ({source}), floor {lowest:.2f}")


def judge(measurements: dict, floors: dict, device: str, previous: dict | None = None) -> list[Verdict]:
    """One verdict per case measured: ``measurements[case]`` (a dict; ``{"error": ...}`` when it could not be
    measured) against the floors of ``device`` (a slug)."""
    mine = floors["devices"].get(device, {})
    verdicts = []
    for case in CASES:
        if case not in measurements:
            continue
        if case in SPEEDUP_CASES:
            verdicts.append(judge_decode(measurements[case], mine.get(case), case))
        else:
            verdicts.append(judge_engine(measurements[case], mine.get(case), previous))
    return verdicts


def previous_engine(folder: Path, device: str, exclude: Path | None = None) -> dict | None:
    """The engine case of the newest result of ``device`` in ``folder`` that measured it (file names sort by date;
    the same date by modification time), or None."""
    candidates = [p for p in Path(folder).glob(f"{device}_*.json") if exclude is None or p.resolve() != exclude]
    for path in sorted(candidates, key=lambda p: (p.name.split("_")[1], p.stat().st_mtime), reverse=True):
        try:
            engine = json.loads(path.read_text())["measurements"]["engine_32x8k"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if engine and engine.get("tokens_per_s"):
            return {"tokens_per_s": engine["tokens_per_s"], "source": str(path)}
    return None


# ------------------------------------------------------------------------------------------------ measuring
def measure_decode(quick: bool) -> dict:
    """Both rows of the decode command of record in this process (``hf_rocketkv.bench.decode.run``)."""
    from hf_rocketkv.bench import decode

    with tempfile.TemporaryDirectory() as out:
        report = decode.run([*(QUICK_DECODE_ARGS if quick else DECODE_ARGS), "--out", out])
    rows = {row["cache"]: row for row in report["rows"]}
    rocket, static = rows.get("rocketkv-graphs", {}), rows.get("static-compile", {})
    if rocket.get("status") != "ok" or static.get("status") != "ok":
        return {"error": f"rocketkv-graphs: {rocket.get('status')}, static-compile: {static.get('status')}",
                "rows": report["rows"]}
    return {"rocketkv_ms": rocket["decode_ms_per_token"], "baseline_ms": static["decode_ms_per_token"],
            "ratio": static["decode_ms_per_token"] / rocket["decode_ms_per_token"],
            "rocketkv_peak_gib": rocket["peak_gib"], "baseline_peak_gib": static["peak_gib"],
            "command": "python -m hf_rocketkv.bench.decode " + " ".join(QUICK_DECODE_ARGS if quick else DECODE_ARGS)}


def measure_hybrid(quick: bool) -> dict:
    """Both rows of the hybrid command of record (``benchmarks.hybrid_decode``) in this process."""
    from benchmarks import hybrid_decode

    args = QUICK_HYBRID_ARGS if quick else HYBRID_ARGS
    baseline = "dynamic" if quick else "static-compile"
    with tempfile.TemporaryDirectory() as out:
        report = hybrid_decode.main([*args, "--out", out])
    rows = {row["cache"]: row for row in report["models"]["gemma-3-12b"]["rows"]}
    rocket, base = rows.get("rocketkv", {}), rows.get(baseline, {})
    if rocket.get("status") != "ok" or base.get("status") != "ok":
        return {"error": f"rocketkv: {rocket.get('status')}, {baseline}: {base.get('status')}",
                "rows": list(rows.values())}
    return {"rocketkv_ms": rocket["decode_ms_per_token"], "baseline_ms": base["decode_ms_per_token"],
            "ratio": base["decode_ms_per_token"] / rocket["decode_ms_per_token"],
            "baseline": "DynamicCache" if quick else "StaticCache+compile",
            "rocketkv_peak_gib": rocket["peak_gib"], "baseline_peak_gib": base["peak_gib"],
            "command": "python -m benchmarks.hybrid_decode " + " ".join(args)}


def measure_engine(quick: bool) -> dict:
    """Two ``generate_batch`` calls on one model and pool (different random prompts of the same shape): the second
    call's output tokens/s."""
    import torch

    import hf_rocketkv
    from benchmarks.first_call import prompts, timed_call
    from hf_rocketkv import KVBlockPool
    from hf_rocketkv.bench.decode import LLAMA_31_8B, TINY, build_model
    from hf_rocketkv.serving import SamplingParams

    shape = QUICK_ENGINE if quick else ENGINE
    device = torch.device("cpu" if quick or not torch.cuda.is_available() else "cuda")
    config = TINY if quick else LLAMA_31_8B
    model = build_model(config, None, torch.float32 if device.type == "cpu" else torch.bfloat16, device, seed=0)
    hf_rocketkv.enable(model)
    pool = KVBlockPool(model, max_gpu_bytes=int(shape["pool_gib"] * 2**30))
    params = SamplingParams.greedy(shape["new_tokens"], ignore_eos=True)
    seconds = []
    for call in (1, 2):
        batch = prompts(shape["requests"], shape["prompt_len"], config["vocab_size"], seed=call)
        seconds.append(timed_call(model, batch, pool, params, profile=False)[0])
    tokens = shape["requests"] * shape["new_tokens"]
    return {"tokens_per_s": tokens / seconds[1], "first_call_tokens_per_s": tokens / seconds[0],
            "seconds": seconds, "workload": shape}


def free_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(quick: bool, cases: tuple[str, ...] = CASES) -> dict:
    """Every case of ``cases``, one after the other in this process; a case that raises is recorded as its error."""
    measurers = {"decode_bs1_32k": measure_decode, "engine_32x8k": measure_engine, "hybrid_gemma3_32k": measure_hybrid}
    results = {}
    for case in cases:
        started = time.perf_counter()
        try:
            results[case] = measurers[case](quick)
        except Exception as err:  # noqa: BLE001 - the other case still runs; the verdict fails this one
            traceback.print_exc()
            results[case] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        results[case]["wall_s"] = round(time.perf_counter() - started, 1)
        free_device()
    return results


# ------------------------------------------------------------------------------------------------ the command
def environment(commit: str) -> dict:
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    versions = {}
    for module in ("torch", "transformers", "triton"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = None
    return {"device": name, "device_slug": device_slug(name),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": commit,
            "python": platform.python_version(), **versions}


def default_commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "results" / "perf_guard"),
                        help="folder of the result file (default results/perf_guard)")
    parser.add_argument("--previous-dir", default=None, help="where the previous results are (default: --out)")
    parser.add_argument("--floors", default=str(FLOORS), help="the floor file (default benchmarks/perf_floors.json)")
    parser.add_argument("--commit", default=None, help="the commit measured (default $COMMIT, else git's HEAD)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: the script's logic")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--judge", metavar="FILE", default=None,
                        help="judge the measurements of FILE (a result file of this script) instead of measuring")
    parser.add_argument("--device", default=None, help="with --judge: the device slug whose floors apply "
                                                       "(default the file's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    floors = load_floors(Path(args.floors))
    if args.judge:
        record = json.loads(Path(args.judge).read_text())
        device = args.device or record["env"]["device_slug"]
        previous = record.get("previous_engine")
        verdicts = judge(record["measurements"], floors, device, previous)
        for verdict in verdicts:
            print(verdict.line)
        return 1 if any(v.status == "FAIL" for v in verdicts) else 0
    env = environment(args.commit or default_commit())
    if args.quick:
        env["quick"] = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{env['device_slug']}_{env['date']}_{device_slug(env['commit'])}.json"
    previous = previous_engine(Path(args.previous_dir or out), env["device_slug"], exclude=path.resolve())
    measurements = measure(args.quick, tuple(args.cases))
    verdicts = judge(measurements, floors, env["device_slug"], previous)
    record = {"env": env, "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.perf_guard",
                                               *(argv if argv is not None else sys.argv[1:])]),
              "floors": {"file": str(Path(args.floors)), "device": floors["devices"].get(env["device_slug"])},
              "previous_engine": previous, "measurements": measurements,
              "verdicts": [dataclasses.asdict(v) for v in verdicts]}
    path.write_text(json.dumps(record, indent=1, default=str))
    for verdict in verdicts:
        print(verdict.line)
    print(f"wrote {path}")
    return 1 if any(v.status == "FAIL" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
