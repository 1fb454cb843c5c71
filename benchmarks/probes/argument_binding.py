"""Host microseconds to bind one keyword call of a wrapped modeling forward: ``inspect.Signature.bind`` (with the
defaults applied) against ``integration/compat_calls.ArgumentBinder``, for the two forwards an eager decode step of a
Llama-style model binds per layer (the attention, called with keywords by its decoder layer, and the decoder layer,
called with keywords by the model). No GPU needed: binding is host work.

    python -m benchmarks.probes.argument_binding --out $OUT

Each figure is the best of ``--repeats`` loops of ``--calls`` calls (``timeit``); both ways must give the same
values. Writes ``argument_binding.json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import timeit
from datetime import datetime, timezone
from pathlib import Path

from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

from hf_rocketkv.integration.compat_calls import ArgumentBinder

# the keywords transformers 5.x passes at a decode step (values stand in: binding never reads them)
CALLS = {
    "LlamaAttention.forward": ((object(),), dict(hidden_states=1, position_embeddings=2, attention_mask=3,
                                                 past_key_values=4, cache_position=5, position_ids=6, use_cache=True)),
    "LlamaDecoderLayer.forward": ((object(), 0), dict(attention_mask=3, position_ids=6, past_key_values=4,
                                                      use_cache=True, cache_position=5, position_embeddings=2)),
}
FORWARDS = {"LlamaAttention.forward": LlamaAttention.forward, "LlamaDecoderLayer.forward": LlamaDecoderLayer.forward}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    rows = []
    for name, (positional, keywords) in CALLS.items():
        signature = inspect.signature(FORWARDS[name])
        binder = ArgumentBinder(signature)

        def general(positional=positional, keywords=keywords, signature=signature):
            bound = signature.bind(*positional, **keywords)
            bound.apply_defaults()
            return tuple(bound.arguments.values())

        def table(positional=positional, keywords=keywords, binder=binder):
            return binder.values(positional, keywords)

        if general() != table():
            raise SystemExit(f"{name}: ArgumentBinder bound other values than inspect")
        times = {label: min(timeit.repeat(fn, number=args.calls, repeat=args.repeats)) / args.calls * 1e6
                 for label, fn in (("inspect_us", general), ("binder_us", table))}
        rows.append({"forward": name, **{k: round(v, 2) for k, v in times.items()}})
        print(json.dumps(rows[-1]))
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
    result = {"probe": "argument_binding", "command": " ".join(["python -m benchmarks.probes.argument_binding", *argv]),
              "date": datetime.now(timezone.utc).isoformat(), "commit": commit,
              "host": platform.processor() or platform.machine(), "python": platform.python_version(),
              "metric": "host microseconds per bind, best of the repeats", "calls": args.calls,
              "repeats": args.repeats, "rows": rows}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "argument_binding.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
