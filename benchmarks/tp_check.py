"""Tensor parallel on GPUs: step-level agreement with one GPU (float32) and speed against one GPU (bf16).

    # 1. a random checkpoint with Llama-3.1-8B shapes (8 layers for the step check), written once
    PYTHONPATH=. python benchmarks/tp_check.py save --layers 8 --dtype float32 --dir /tmp/tp8
    # 2. one GPU, then two (torchrun), each records its steps (and times decode)
    PYTHONPATH=. CUDA_VISIBLE_DEVICES=0 python benchmarks/tp_check.py run --dir /tmp/tp8 --out $OUT/single.json
    PYTHONPATH=. torchrun --nproc_per_node=2 benchmarks/tp_check.py run --dir /tmp/tp8 --out $OUT/tp.json
    # 3. compare (anywhere)
    python benchmarks/tp_check.py compare $OUT/single.json $OUT/tp.json

``run`` records what tests/tp_steps.py records (kept positions per layer/row/KV head, pages selected at the first
decode steps with the score margin at the top-k boundary, first logits) plus decode ms/token; ``compare`` reports the
agreement per rank, the tie rate, the logits' relative error and the TP/1-GPU speed ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def save(args) -> None:
    from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model

    model = build_model(LLAMA_31_8B, args.layers, getattr(torch, args.dtype), torch.device("cuda"), 0)
    model.save_pretrained(args.dir)
    print("saved", args.dir)


def run(args) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_rocketkv
    from hf_rocketkv import RocketKVCache, RocketKVConfig
    from tp_steps import record_steps

    distributed = "WORLD_SIZE" in os.environ
    kwargs = dict(distributed_config=DistributedConfig(tp_plan="auto")) if distributed else dict(device_map="cuda")
    if args.dtype:  # e.g. a bf16 checkpoint (half the disk) run in float32: every weight is exactly representable
        kwargs["dtype"] = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.dir, attn_implementation=hf_rocketkv.ATTN_NAME, **kwargs).eval()
    rank = int(os.environ.get("RANK", 0))
    config = RocketKVConfig(backend="triton", kt_cache_dtype="float32" if model.dtype == torch.float32 else "float8_e5m2")
    device = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context),
                        generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    record = record_steps(model, RocketKVCache(config), ids, mask, args.new_tokens, 0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, past_key_values=RocketKVCache(config), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    record.update(rank=rank, seconds=time.perf_counter() - t0, device=torch.cuda.get_device_name(),
                  world=int(os.environ.get("WORLD_SIZE", 1)))
    records = [record]
    if distributed:
        import torch.distributed as dist

        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))


def compare(args) -> None:
    single = json.loads(Path(args.single).read_text())[0]
    ranks = json.loads(Path(args.tp).read_text())
    world = len(ranks)
    heads = len(single["kept"][0][0]) // world
    report = dict(world=world, ranks=[])
    for rank in ranks:
        r = rank["rank"]
        kept = [got[b][h] == want[b][r * heads + h] for got, want in zip(rank["kept"], single["kept"])
                for b in range(len(want)) for h in range(heads)]
        pages = ties = total = 0
        for got, want in zip(rank["steps"], single["steps"]):
            for b in range(len(want["pages"])):
                for h in range(heads):
                    total += 1
                    same = got["pages"][b][h] == want["pages"][b][r * heads + h]
                    pages += same
                    ties += (not same) and want["margins"][b][r * heads + h] < 1e-6
        errors = [float((torch.tensor(g) - torch.tensor(w)).abs().max() / torch.tensor(w).abs().max())
                  for g, w in zip(rank["logits"], single["logits"])]
        report["ranks"].append(dict(rank=r, kept_equal=sum(kept) / len(kept), pages_equal=pages / max(total, 1),
                                    mismatches_at_ties=ties, mismatches=total - pages, logits_rel_err=errors,
                                    seconds=rank["seconds"]))
    report["speed_ratio_tp_over_single"] = ranks[0]["seconds"] / single["seconds"]
    print(json.dumps(report, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--dtype", default="float32")
    s.add_argument("--dir", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dir", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--context", type=int, default=16384)
    r.add_argument("--new-tokens", type=int, default=32)
    r.add_argument("--dtype", default=None, help="load the checkpoint in this dtype (default: as saved)")
    c = sub.add_parser("compare")
    c.add_argument("single")
    c.add_argument("tp")
    args = p.parse_args()
    {"save": save, "run": run, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
