"""The documented ``hf-rocketkv serve`` command under N concurrent streams (loopback only): wall time, time to first
token and the texts of every stream, for comparing two source trees (e.g. before and after a change).

    python -m benchmarks.serve_streams --label after --output results/cpu_DATE_serve_8_streams.json
    git archive BASE | tar -x -C /tmp/base
    python -m benchmarks.serve_streams --label before --tree /tmp/base --commit BASE \
        --output results/cpu_DATE_serve_8_streams.json

Starts ``python -m hf_rocketkv.cli serve --model smollm2 --config smollm2-longdoc --host 127.0.0.1 --port 0`` (the
command the README gives, on a free port; ``--config`` picks another bundled config or YAML file, ``--serve-arg`` adds
flags) from ``--tree`` (its package first on the
path), waits until it says where it listens, sends ``--streams`` streaming chat completions at once (one question
each, greedy, ``--max-tokens``), records per stream the time to first text, the end and the text, then stops the
server with SIGINT. The run is written under its label into ``--output`` (other labels already there are kept), with
the command, date, commit, machine (CPU model, cores, load average before and after) and the server's own lines
(engine, pool, threads). When the file holds more than one label, ``texts_identical`` says whether every label's
texts are the same.

Bounded: the server is killed if it does not listen within ``--start-timeout`` seconds, or if streams are still
running ``--time-limit`` seconds after they were sent (they count as errors, and ``time_limit_hit`` is set); only
127.0.0.1 is used. A tree whose ``hf_rocketkv/`` has uncommitted changes is recorded as such beside its commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

QUESTIONS = [
    "What is a KV cache in a transformer?",
    "Name three prime numbers and say why they are prime.",
    "Explain what a lighthouse does.",
    "Why is the sky blue?",
    "Give two tips for writing clear code.",
    "What does a compiler do?",
    "Describe a cat in one sentence.",
    "What is the capital of France, and what is it known for?",
]
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the run's name in the output file (e.g. before, after)")
    parser.add_argument("--tree", default=str(ROOT), help="source tree whose hf_rocketkv serves (default: this one)")
    parser.add_argument("--commit", default=None, help="the tree's commit when it is no git checkout (git archive)")
    parser.add_argument("--output", required=True, help="JSON file the run is merged into")
    parser.add_argument("--config", default="smollm2-longdoc",
                        help="serve's --config (default smollm2-longdoc, the documented command's)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8, at most 32)")
    parser.add_argument("--max-tokens", type=int, default=24, help="max_tokens of each stream (default 24)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="one more word for serve's command line (repeatable: --serve-arg=--threads "
                             "--serve-arg=1)")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds the server may take to listen")
    parser.add_argument("--time-limit", type=float, default=900, help="seconds the streams may take in all")
    args = parser.parse_args(argv)
    if not 1 <= args.streams <= 32:
        parser.error("--streams must be in [1, 32]")
    if not 1 <= args.max_tokens <= 4096:
        parser.error("--max-tokens must be in [1, 4096]")
    if not (args.start_timeout > 0 and args.time_limit > 0):
        parser.error("--start-timeout and --time-limit must be > 0 seconds")
    return args


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version()}


def commit_of(tree: str) -> str:
    """The tree's short commit, marked when its package has uncommitted changes (what ran is then not that commit)."""
    result = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], check=False,
                            capture_output=True, text=True)
    commit = result.stdout.strip()
    if not commit:
        return "unknown (not a git checkout: see --label)"
    changed = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--", "hf_rocketkv"], check=False,
                             capture_output=True, text=True).stdout.strip()
    return f"{commit} with uncommitted changes to hf_rocketkv/" if changed else commit


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, list[str], list[str]]:
    """The serve process, its URL, the command, and the lines it printed until it listened."""
    command = [sys.executable, "-m", "hf_rocketkv.cli", "serve", "--model", "smollm2", "--config", args.config,
               "--host", "127.0.0.1", "--port", "0", "--log-level", "warning", *args.serve_arg]
    env = {**os.environ, "PYTHONPATH": args.tree, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=args.tree, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True)
    lines: list[str] = []
    watchdog = threading.Timer(args.start_timeout, process.kill)  # a silent server still ends the wait
    watchdog.start()
    try:
        for line in process.stderr:
            if line.startswith("hf-rocketkv serve:"):
                lines.append(line.strip())
            match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if match:
                # keep draining stderr, or a full pipe would block the server
                threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
                return process, match.group(1), command, lines
    finally:
        watchdog.cancel()
    process.kill()
    raise SystemExit(f"the server did not listen within {args.start_timeout} s (exit {process.wait()}): {lines}")


def stream(url: str, question: str, max_tokens: int, sent: float, timeout: float) -> dict:
    import httpx

    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    record = {"question": question, "ttft_s": None, "end_s": None, "text": "", "completion_tokens": None,
              "error": None}
    try:
        with httpx.Client(timeout=timeout) as client, \
                client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                record["error"] = f"HTTP {reply.status_code}: {reply.read()[:200]!r}"
                return record
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record["completion_tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text and record["ttft_s"] is None:
                        record["ttft_s"] = round(time.monotonic() - sent, 3)
                    record["text"] += text
        record["end_s"] = round(time.monotonic() - sent, 3)
    except Exception as err:  # noqa: BLE001 - a failed stream is recorded, the others go on
        record["error"] = f"{type(err).__name__}: {err}"
    return record


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    started = time.monotonic()
    process, url, command, lines = start_server(args)
    ready_s = time.monotonic() - started
    try:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.streams)]
        limit_hit = threading.Event()

        def stop_at_limit() -> None:  # ends every stream still open at the limit
            limit_hit.set()
            process.kill()

        watchdog = threading.Timer(args.time_limit, stop_at_limit)
        sent = time.monotonic()
        watchdog.start()
        with ThreadPoolExecutor(args.streams) as pool:
            records = list(pool.map(lambda q: stream(url, q, args.max_tokens, sent, args.time_limit), questions))
        wall = time.monotonic() - sent
        watchdog.cancel()
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    ends = [r["end_s"] for r in records if r["end_s"] is not None]
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tree": args.tree, "commit": args.commit or commit_of(args.tree),
        "command": " ".join(command[1:]).replace("-m hf_rocketkv.cli", "hf-rocketkv", 1),
        "server_lines": lines, "startup_s": round(ready_s, 1),
        "streams": args.streams, "max_tokens": args.max_tokens,
        "wall_s": round(wall, 2), "last_first_token_s": max(ttfts) if ttfts else None,
        "first_token_s_median": sorted(ttfts)[len(ttfts) // 2] if ttfts else None,
        "last_end_s": max(ends) if ends else None,
        "errors": sum(r["error"] is not None for r in records), "time_limit_hit": limit_hit.is_set(),
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in records),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "records": records,
    }


def summarise(data: dict) -> dict:
    """The file's top-level fields (what scripts/index_results.py reads) over every run it holds, runs last."""
    runs = data["runs"]
    texts = {label: [r["text"] for r in entry["records"]] for label, entry in runs.items()}
    top = {
        "device": f"CPU ({data['machine']['cpu']}, {data['machine']['cpus']} CPUs)",
        "date": max(entry["date"] for entry in runs.values())[:10],
        "commit": ", ".join(f"{label}: {entry['commit']}" for label, entry in runs.items()),
        "command": "; ".join(f"{label}: {entry['command']}" for label, entry in runs.items()),
        "summary": {label: {k: entry[k] for k in ("wall_s", "last_first_token_s", "first_token_s_median",
                                                  "completion_tokens", "errors")} for label, entry in runs.items()},
    }
    if len(texts) > 1:
        top["texts_identical"] = len({json.dumps(t) for t in texts.values()}) == 1
    return {**top, "machine": data["machine"], "runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    path = Path(args.output)
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    data["machine"] = machine()
    data["runs"][args.label] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summarise(data), indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=2))
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
