"""Helpers of the policy tests besides the oracles (oracle.py): the prompt keys an sdpa forward computes, and a
stage-1 policy that returns different counts per KV head without declaring them."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_rocketkv.policies import KeptSlots
from hf_rocketkv.integration.compat import cache_kwargs


def prompt_keys(sdpa, ids) -> list[torch.Tensor]:
    """Post-RoPE prompt keys of every layer, from a plain sdpa forward with a DynamicCache."""
    cache = DynamicCache()
    with torch.no_grad():
        sdpa(ids, **cache_kwargs(cache), use_cache=True)
    return [layer.keys for layer in cache.layers]


class Ragged:
    """Keeps slots 0 .. budget-1, one fewer in KV head 0, without declaring per_head_budgets."""

    name = "ragged"

    def select(self, inputs):
        heads = inputs.num_kv_heads
        slots = torch.arange(inputs.budget).expand(heads, inputs.budget).clone()
        slots[0, -1] = -1
        counts = torch.full((heads,), inputs.budget)
        counts[0] -= 1
        return [KeptSlots(slots, counts) for _ in range(inputs.keys.shape[0])]
