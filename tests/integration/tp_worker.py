"""Tensor-parallel worker for tests/integration/test_tensor_parallel.py (run under ``torchrun --nproc_per_node=2``,
gloo, CPU).

    torchrun --nproc_per_node=2 tests/integration/tp_worker.py MODEL_DIR INPUT_JSON OUTPUT_JSON

Loads the tiny checkpoint in MODEL_DIR with ``tp_plan="auto"`` and ``attn_implementation="rocketkv"``, generates
greedily with a compressing RocketKVCache built from the config in INPUT_JSON (then once more for each entry of its
optional ``runs``, with that entry's inputs and config), and has rank 0 write the tokens plus what every rank's
cache held (KV heads per rank, which layers slide, kept tokens, logical length) to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist


def main() -> None:
    model_dir, input_path, output_path = sys.argv[1:4]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    spec = json.loads(open(input_path).read())

    import hf_rocketkv
    from hf_rocketkv import RocketKVCache, RocketKVConfig
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir,  # tp_plan: "auto" or a dict of overrides; "distributed": more DistributedConfig fields (ep_size)
        distributed_config=DistributedConfig(tp_plan=spec.get("tp_plan", "auto"), **spec.get("distributed", {})),
        attn_implementation=hf_rocketkv.ATTN_NAME,
        dtype=torch.float32,
    ).eval()
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = model.device  # the CPU under gloo; each rank's GPU where transformers picked NCCL
    if device.type == "cuda" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")  # float32 experts: grouped_mm is a bf16 kernel on CUDA
    input_ids = torch.tensor(spec["input_ids"], dtype=torch.long, device=device)
    attention_mask = torch.tensor(spec["attention_mask"], dtype=torch.long, device=device)
    cache = RocketKVCache(RocketKVConfig(**spec["rocketkv"]))
    if spec.get("record_steps"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tp_steps import record_steps

        record = record_steps(model, cache, input_ids, attention_mask, spec["max_new_tokens"], spec["pad_token_id"])
        gathered = [None] * world
        dist.all_gather_object(gathered, dict(rank=rank, **record))
        _write_and_exit(output_path, rank, world, gathered)
    local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())  # this rank's shard
    report = dict(rank=rank, local_parameters=local, **generate_report(model, cache, input_ids, attention_mask, spec))
    if spec.get("runs"):  # more generate() calls on the same shards, each with its own inputs and cache config
        report["runs"] = [
            generate_report(model, RocketKVCache(RocketKVConfig(**run["rocketkv"])),
                            torch.tensor(run["input_ids"], dtype=torch.long, device=device),
                            torch.tensor(run["attention_mask"], dtype=torch.long, device=device), {**spec, **run})
            for run in spec["runs"]
        ]
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    _write_and_exit(output_path, rank, world, gathered)


def generate_report(model, cache, input_ids, attention_mask, spec: dict) -> dict:
    """Greedy tokens of one generate() call and what this rank's cache held after it."""
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            cache=cache,
            max_new_tokens=spec["max_new_tokens"],
            do_sample=False,
            eos_token_id=None,
            pad_token_id=spec["pad_token_id"],
        )
    return {
        "tokens": out.tolist(),
        "kv_heads": [int(layer.keys.shape[1]) for layer in cache.layers],
        "sliding": [bool(layer.is_sliding) for layer in cache.layers],
        "kept_tokens": [cache.kept_tokens(i).tolist() for i in range(len(cache.layers))],
        "seq_length": cache.get_seq_length(),
        "compressed": cache.is_compressed,
    }


def _write_and_exit(output_path: str, rank: int, world: int, gathered: list) -> None:
    """Rank 0 writes the report; every rank then leaves without interpreter finalization.

    The model's DTensor shards keep the gloo process group alive past ``destroy_process_group()``; gloo's worker
    threads then meet a half torn-down interpreter at exit and, now and then, abort the process ("terminate called
    without an active exception", SIGABRT) after all the work is done (pytorch/pytorch#179291). ``os._exit`` after
    flushing skips that teardown, so the exit status reports the run, not the race."""
    if rank == 0:
        with open(output_path, "w") as f:
            json.dump({"world_size": world, "ranks": gathered}, f)
            f.flush()
            os.fsync(f.fileno())
    if dist.get_backend() == "nccl":  # this rank's GPU, not a guessed one; no NCCL teardown (the shards hold the group)
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
