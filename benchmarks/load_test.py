"""Bounded load test of the OpenAI-compatible server (loopback only): TTFT, tokens/s per user and per GPU, errors.

    # against a running server (hf-rocketkv serve --model M --config C.yaml --port 8000)
    python -m benchmarks.load_test --url http://127.0.0.1:8000/v1 --requests 64 --concurrency 8 \
        --prompt-tokens 2048 --max-tokens 128 --time-limit 600 --output load.json

    # or start the server in this process on a model first
    python -m benchmarks.load_test --serve-model smollm2 --config smollm2-longdoc --requests 8 --concurrency 2

Every request streams through the ``openai`` client (``stream_options.include_usage``), with ``ignore_eos`` so each
produces exactly ``--max-tokens`` tokens. Bounded: at most ``--requests`` requests, at most ``--concurrency`` at a
time, nothing starts after ``--time-limit`` seconds and requests still running then are abandoned (counted as
errors). Only loopback addresses are accepted.

Reported (and written as JSON with --output):
    ttft_s                    time to first token (first streamed text), p50 / p90 / p99 / mean
    tokens_per_s_per_user     per request: (completion tokens - 1) / (end - first token), p50 / p90 / p99 / mean
    output_tokens_per_s       per GPU: total completion tokens / wall time of the whole run
    latency_s, errors (count and the first messages), completed, wall_s, the settings, the date
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
MAX_REQUESTS = 10_000
WORDS = ("river stone lantern harbor quiet meadow signal copper winter orchard basket thunder velvet compass "
         "garden ladder mirror candle silver pocket island feather marble window engine violet bridge").split()


@dataclass
class RequestRecord:
    index: int
    start: float
    first_token: float | None = None
    end: float | None = None
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tokens_per_s(self) -> float | None:
        if self.first_token is None or self.end is None or self.completion_tokens < 2 or self.end <= self.first_token:
            return None
        return (self.completion_tokens - 1) / (self.end - self.first_token)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0-100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None, "count": len(values)}


def make_prompt(index: int, words: int) -> str:
    """A distinct synthetic prompt of about ``words`` tokens (no shared prefix between requests)."""
    rng = random.Random(index)
    return f"Request {index}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\nSummarise the text above:"


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"--url must point at a loopback address ({', '.join(sorted(LOOPBACK_HOSTS))}), got {host!r}")


def one_request(client, model: str, index: int, args, deadline: float) -> RequestRecord:
    record = RequestRecord(index, time.perf_counter())
    remaining = deadline - time.monotonic()
    try:
        kwargs = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                      timeout=max(remaining, 0.1))
        if args.chat:
            stream = client.chat.completions.create(
                messages=[{"role": "user", "content": make_prompt(index, args.prompt_tokens)}], **kwargs)
        else:
            stream = client.completions.create(prompt=make_prompt(index, args.prompt_tokens), **kwargs)
        for chunk in stream:
            if chunk.choices:
                text = chunk.choices[0].delta.content if args.chat else chunk.choices[0].text
                if text and record.first_token is None:
                    record.first_token = time.perf_counter()
            if chunk.usage is not None:
                record.completion_tokens = chunk.usage.completion_tokens
        record.end = time.perf_counter()
    except Exception as err:  # noqa: BLE001 - every failure is counted and reported, never fatal
        record.end = time.perf_counter()
        record.error = f"{type(err).__name__}: {err}"[:300]
    return record


def run_load_test(base_url: str, args, model: str | None = None) -> dict:
    """Run the load and return the report (see the module docstring)."""
    import openai

    check_loopback(base_url)
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    model = model or args.model or client.models.list().data[0].id
    deadline = time.monotonic() + args.time_limit
    counter = iter(range(args.requests))
    lock = threading.Lock()
    records: list[RequestRecord] = []

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            record = one_request(client, model, index, args, deadline)
            with lock:
                records.append(record)

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for _ in range(args.concurrency):
            pool.submit(worker)
    wall = time.perf_counter() - start
    return report(records, wall, args, model, base_url)


def report(records: list[RequestRecord], wall: float, args, model: str, base_url: str) -> dict:
    ok = [r for r in records if r.error is None]
    errors = [r.error for r in records if r.error is not None]
    total_tokens = sum(r.completion_tokens for r in ok)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "url": base_url,
        "model": model,
        "settings": {"requests": args.requests, "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                     "max_tokens": args.max_tokens, "time_limit_s": args.time_limit, "chat": args.chat,
                     "temperature": args.temperature},
        "sent": len(records),
        "completed": len(ok),
        "errors": {"count": len(errors), "first": errors[:5]},
        "wall_s": wall,
        "output_tokens": total_tokens,
        "output_tokens_per_s": total_tokens / wall if wall > 0 else None,
        "ttft_s": summary([r.ttft for r in ok if r.ttft is not None]),
        "tokens_per_s_per_user": summary([r.tokens_per_s for r in ok if r.tokens_per_s is not None]),
        "latency_s": summary([r.end - r.start for r in ok]),
        "requests": [asdict(r) for r in sorted(records, key=lambda r: r.index)],
    }


def format_report(result: dict) -> str:
    def fmt(stats: dict, unit: str) -> str:
        if stats["count"] == 0:
            return "n/a"
        return f"p50 {stats['p50']:.3f}{unit}  p99 {stats['p99']:.3f}{unit}  mean {stats['mean']:.3f}{unit}"

    per_gpu = result["output_tokens_per_s"]
    return "\n".join([
        f"{result['completed']}/{result['sent']} requests completed, {result['errors']['count']} errors, "
        f"wall {result['wall_s']:.1f} s",
        f"TTFT            {fmt(result['ttft_s'], ' s')}",
        f"tokens/s/user   {fmt(result['tokens_per_s_per_user'], '')}",
        f"tokens/s (GPU)  {per_gpu:.1f}" if per_gpu is not None else "tokens/s (GPU)  n/a",
    ] + [f"error: {e}" for e in result["errors"]["first"]])


# ------------------------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--serve-model", help="start the server in this process on this model (smollm2, a folder)")
    parser.add_argument("--config", default=None, help="RocketKV YAML (with --serve-model)")
    parser.add_argument("--device", default=None, help="torch device (with --serve-model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-queue", type=int, default=256, help="server queue bound (with --serve-model)")
    parser.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="about this many prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds; nothing starts after it")
    parser.add_argument("--output", default=None, help="write the report as JSON here")
    return parser


def check_args(args) -> None:
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be in [1, {MAX_REQUESTS}], got {args.requests}")
    if not 1 <= args.concurrency <= args.requests:
        raise ValueError(f"--concurrency must be in [1, --requests], got {args.concurrency}")
    if args.max_tokens < 1 or args.prompt_tokens < 1:
        raise ValueError("--max-tokens and --prompt-tokens must be >= 1")
    if args.time_limit <= 0:
        raise ValueError(f"--time-limit must be > 0, got {args.time_limit}")
    if args.url:
        check_loopback(args.url)


def serve_in_process(args):
    """Load the model and start the server on 127.0.0.1 (a free port); returns (server, manager, device name)."""
    import torch

    from hf_rocketkv.cli.serve import load_config
    from hf_rocketkv.models import load_model_and_tokenizer
    from hf_rocketkv.serving import GenerationManager, create_app
    from hf_rocketkv.serving.http.background import ServerThread

    config = load_config(args.config)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_model_and_tokenizer(args.serve_model, dtype=dtype, device=args.device)
    manager = GenerationManager(model, tokenizer, config, max_queue=args.max_queue)
    device = next(model.parameters()).device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    server = ServerThread(create_app(manager, str(args.serve_model))).start()
    return server, manager, name


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:
        print(f"load_test: error: {err}", file=sys.stderr)
        return 2
    server = manager = None
    device = None
    try:
        if args.serve_model:
            server, manager, device = serve_in_process(args)
            base_url = server.url + "/v1"
        else:
            base_url = args.url
        result = run_load_test(base_url, args)
        result["device"] = device
        if manager is not None:
            result["server_metrics"] = {"finished": manager.metrics().finished,
                                        "rejected": manager.metrics().rejected_total}
    finally:
        if server is not None:
            server.stop()
        if manager is not None:
            manager.stop(drain=False, timeout=60)
    print(format_report(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
