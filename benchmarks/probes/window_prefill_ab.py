"""A hybrid model's prefill with the sliding layers' band route off and on (integration/window_prefill.py), on a GPU,
in one process.

    python -m benchmarks.probes.window_prefill_ab --model gemma-3-12b --prompt-len 8192 --rounds 3 --out $OUT/window

Random bf16 weights of the published shapes (``benchmarks/hybrid_decode.py``). One prompt through a
``RocketKVCache(RocketKVConfig(flash_window_prefill=True))`` forward under the config's fused paths
(``logits_to_keep=1``: the batching engine's prefill of one chunk, stage 1 included), timed with CUDA events (the
median of ``--repeats`` after a warm-up) with the band route off (``window_prefill._TAKES_WINDOW`` False:
transformers' mask in query spans, the previous path) and on, alternately, ``--rounds`` times: one JSON line per
row. Then one prefill each way for the first token (the same, and the largest difference of the last position's
logits) and the flash calls one prefill makes with the route on (one per sliding layer). Writes
``window_prefill_ab.json`` under ``--out`` (command, device, date, commit, torch and transformers versions, every
row, the medians over the rounds). ``--quick``: tiny shapes, on the CPU where there is no GPU (the route never runs
there: a smoke of the probe itself).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.hybrid_decode import MODELS, build_model
from benchmarks.probes.profile_hybrid_prefill import median_ms

COMMAND = "python -m benchmarks.probes.window_prefill_ab"


@contextlib.contextmanager
def band_route(on: bool):
    """The sliding layers' band route on (as the package has it) or off, for the ``with`` block."""
    from hf_rocketkv.integration import window_prefill

    saved = window_prefill._TAKES_WINDOW
    window_prefill._TAKES_WINDOW = saved and on
    try:
        yield
    finally:
        window_prefill._TAKES_WINDOW = saved


@contextlib.contextmanager
def counted_flash_calls(counts: list):
    """Each call of the flash op inside the block appends 1 to ``counts``."""
    from hf_rocketkv.integration import window_prefill

    real = window_prefill._FLASH_FORWARD
    if real is None:
        yield
        return

    def counting(*args, **kwargs):
        counts.append(1)
        return real(*args, **kwargs)

    window_prefill._FLASH_FORWARD = counting
    try:
        yield
    finally:
        window_prefill._FLASH_FORWARD = real


def prefill_fn(model, ids):
    """One prefill forward of ``ids`` into a fresh cache, as the engine's prefill chunk runs; returns the last
    position's logits."""
    from hf_rocketkv import RocketKVCache, RocketKVConfig
    from hf_rocketkv.integration.compat import cache_kwargs
    from hf_rocketkv.integration.fused_modeling import fused_modeling

    config = RocketKVConfig(flash_window_prefill=True)  # the route on (the default); band_route(False) turns it off

    def prefill():
        cache = RocketKVCache(config, model_config=model.config)
        with torch.no_grad(), fused_modeling(model, config):
            return model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1]

    return prefill


def run(args, argv: list[str]) -> dict:
    import hf_rocketkv
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = build_model(args.model, args.quick, None, dtype, device)
    hf_rocketkv.enable(model)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    prefill = prefill_fn(model, ids)
    rows = []
    for round_index in range(args.rounds):
        for on in (False, True):
            with band_route(on):
                ms = median_ms(prefill, args.repeats, device)
            row = dict(model=args.model, row="band on" if on else "band off", round=round_index, prefill_ms=ms,
                       prompt_len=args.prompt_len)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with band_route(False):
        off_logits = prefill().float()
    calls = []
    with band_route(True), counted_flash_calls(calls):
        on_logits = prefill().float()
    medians = {name: sorted(r["prefill_ms"] for r in rows if r["row"] == name)[args.rounds // 2]
               for name in ("band off", "band on")}
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
    return dict(command=" ".join([COMMAND, *argv]), model=args.model, prompt_len=args.prompt_len,
                repeats=args.repeats, rounds=args.rounds, quick=args.quick, commit=commit,
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                date=datetime.date.today().isoformat(), torch=torch.__version__,
                transformers=transformers.__version__, rows=rows, median_ms=medians,
                on_over_off=medians["band on"] / medians["band off"],
                first_token_equal=bool(torch.equal(off_logits.argmax(-1), on_logits.argmax(-1))),
                max_abs_logit_diff=(off_logits - on_logits).abs().max().item(), flash_calls_per_prefill=len(calls))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="gemma-3-12b")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5, help="timed prefills per row (the median is reported)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of band off / band on")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on the CPU: a smoke of the probe)")
    parser.add_argument("--out", default="out")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    report = run(args, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "window_prefill_ab.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("model", "median_ms", "on_over_off", "first_token_equal",
                                             "max_abs_logit_diff", "flash_calls_per_prefill")}))
    return report


if __name__ == "__main__":
    main()
