"""KVBlockPool's settable mode: ``prefix_reuse`` changed after construction changes how later admissions are planned
(the formulas of docs/memory.md, computed here: with reuse a 64-token prompt keeps its 8 prompt pages beside a view
of 24 + 10 tokens; without, the prompt table is compacted in place, so the peak is the larger of the two)."""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig

from hf_rocketkv import KVBlockPool, RocketKVConfig

CFG = RocketKVConfig(prompt_budget=24, window_size=8, kernel_size=5, page_size=4, kt_cache_dtype="float32",
                     backend="torch")
PAGE = 8


def test_prefix_reuse_set_after_construction_governs_later_plans():
    model = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    pool = KVBlockPool(model, max_gpu_bytes=1 << 20, page_size=PAGE, dtype=torch.float32, device="cpu",
                       kt_page_size=CFG.page_size, kt_dtype=CFG.kt_cache_dtype)
    prompt, view = math.ceil(64 / PAGE), math.ceil((CFG.prompt_budget + 10) / PAGE)
    assert pool.pages_needed(64, 10, CFG).prefill_peak == prompt + view
    pool.prefix_reuse = False
    assert pool.prefix_reuse is False
    assert pool.pages_needed(64, 10, CFG).prefill_peak == max(prompt, view)
    pool.prefix_reuse = True
    assert pool.pages_needed(64, 10, CFG).prefill_peak == prompt + view


def test_priorities_set_after_construction_are_checked_and_govern_later_pages():
    """``default_priority`` / ``offload_min_priority`` set on a built pool: refused outside 0..100 (naming the
    field, the value kept), else the next registered page takes the default and eviction reads the threshold."""
    import pytest

    model = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    pool = KVBlockPool(model, max_gpu_bytes=1 << 20, page_size=PAGE, dtype=torch.float32, device="cpu")
    for name in ("default_priority", "offload_min_priority"):
        for bad in (-1, 101, 2.5, True, "50"):
            with pytest.raises(ValueError, match=f"KVBlockPool.{name}"):
                setattr(pool, name, bad)
        assert getattr(pool, name) == 35
        setattr(pool, name, 70)
        assert getattr(pool, name) == 70
    table = pool.new_table("prompt")
    pool.allocate(table, 1)
    pool.register(table, [b"h" * 16])
    assert pool.page_info(table.pages[0]).priority == 70
    pool.release(table)
