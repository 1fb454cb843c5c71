"""Tensor-parallel worker of test_tensor_parallel_gpu.py, one process per GPU under torchrun (NCCL):

    torchrun --nproc_per_node=2 -m tests.gpu.tp_worker_gpu MODEL_DIR OUTPUT_JSON CONTEXT NEW_TOKENS

Loads the checkpoint with ``tp_plan="auto"`` in float32 (each rank holds half of the KV heads), runs one greedy
generate() with a compressing RocketKVCache on the Triton backend and records its steps
(tests/integration/tp_steps.py: kept positions per layer, row and KV head; pages selected at the first decode steps
with the scores of every page in use; logits) and its peak GPU memory.
Rank 0 writes every rank's record to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from hf_rocketkv import RocketKVConfig

ROCKET = RocketKVConfig(backend="triton", kt_cache_dtype="float32")


def prompt(context: int, vocab: int) -> torch.Tensor:
    """The ``[1, context]`` prompt every process draws alike (a seeded CPU generator)."""
    return torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(0))


def main() -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_rocketkv
    from hf_rocketkv import RocketKVCache
    from tests.integration.tp_steps import record_steps

    model_dir, output_path, context, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_plan="auto"),
                                                 attn_implementation=hf_rocketkv.ATTN_NAME,
                                                 dtype=torch.float32).eval()
    device = next(model.parameters()).device
    ids = prompt(context, model.config.vocab_size).to(device)
    torch.cuda.reset_peak_memory_stats(device)
    record = record_steps(model, RocketKVCache(ROCKET), ids, torch.ones_like(ids), new_tokens, 0)
    record["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    record["rank"] = dist.get_rank()
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        with open(output_path, "w") as f:
            json.dump(records, f)
    dist.barrier(device_ids=[device.index])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no NCCL teardown at interpreter exit: the model's DTensor shards keep the group alive


if __name__ == "__main__":
    main()
