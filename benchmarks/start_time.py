"""How fast the front door answers: ``import hf_rocketkv``, ``hf-rocketkv --help``, each subcommand's ``--help`` and a
mistake on the command line, each in a fresh interpreter (*CPU*).

    python -m benchmarks.start_time --out out/start_time --repeats 5

Each command runs ``--repeats`` times as a subprocess (``python -c ...`` / ``python -m hf_rocketkv.cli ...`` from
the repository root); the record keeps every wall time, their median and range, the machine (CPU, cores, load
average before and after) and, for comparison, the import time of torch plus transformers' model code, which the
package no longer imports at start. ``python -X importtime`` gives the package's own import time (the sum of its
modules' cumulative microseconds at the top level).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "import hf_rocketkv": [sys.executable, "-c", "import hf_rocketkv"],
    "hf-rocketkv --help": [sys.executable, "-m", "hf_rocketkv.cli", "--help"],
    **{f"hf-rocketkv {name} --help": [sys.executable, "-m", "hf_rocketkv.cli", name, "--help"]
       for name in ("generate", "eval", "bench", "warmup", "serve")},
    "a mistake (generate --device gpu)": [sys.executable, "-m", "hf_rocketkv.cli", "generate", "--device", "gpu"],
    "import torch + transformers' model code": [sys.executable, "-c", "import torch, transformers.modeling_utils"],
}


def wall_times(command: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - start)
    return times


def package_import_us() -> int:
    """``-X importtime``: the cumulative microseconds of the top-level ``hf_rocketkv`` import."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import hf_rocketkv"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stderr
    match = re.search(r"^import time:\s+\d+ \|\s+(\d+) \| hf_rocketkv$", err, re.M)
    if match is None:
        raise RuntimeError("start_time: -X importtime printed no line for hf_rocketkv")
    return int(match.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for start_time.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    load_before = os.getloadavg()
    rows = {}
    for name, command in COMMANDS.items():
        times = wall_times(command, args.repeats)
        rows[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                      "all_s": times}
        print(f"{name:42s} median {rows[name]['median_s']:.3f} s (min {min(times):.3f}, max {max(times):.3f})")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {"device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit or "unknown",
              "command": "python -m benchmarks.start_time " + " ".join(argv if argv is not None else sys.argv[1:]),
              "metric": "wall seconds of a fresh interpreter running the command, median of the repeats",
              "python": platform.python_version(), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "package_import_us": package_import_us(), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "start_time.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
