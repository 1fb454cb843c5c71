"""A KVBlockPool without a size (memory/sizing.py): the rule over (device, free bytes, fraction) on made-up free
memory, how free memory is read (/proc/meminfo, a cgroup limit, CUDA's mem_get_info), and ``KVBlockPool(model)``
taking that size. Expected sizes are the rule's arithmetic written out here, page bytes counted by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_rocketkv import KVBlockPool
from hf_rocketkv.memory import sizing
from hf_rocketkv.memory.sizing import auto_pool_size, cgroup_memory_left, meminfo_available, pool_bytes
from tests.support.tiny_models import make_models

GIB = 1 << 30
MIB = 1 << 20


@pytest.mark.parametrize("device, free, fraction, expected", [
    ("cuda", 80 * GIB, None, int(80 * GIB * 9 / 10)),    # vLLM's 0.9 of what is free
    ("cuda", 10 * GIB, 0.5, 5 * GIB),
    ("cuda", 300 * GIB, None, 270 * GIB),                # no cap on a device
    ("cpu", 4 * GIB, None, 1 * GIB),                     # a quarter of the available RAM
    ("cpu", 64 * GIB, None, 2 * GIB),                    # ... at most 2 GiB by default
    ("cpu", 64 * GIB, 0.5, 32 * GIB),                    # a fraction given is not capped
    ("mps", 2 * GIB, None, 512 * MIB),                   # other devices: host RAM's rule
    ("cpu", 0, None, 0),
])
def test_the_rule_on_made_up_free_memory(device, free, fraction, expected):
    assert pool_bytes(device, free, fraction) == expected


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, True, "0.5", float("nan")])
def test_a_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match=r"kv_memory_fraction must be a number in \(0, 1\]"):
        pool_bytes("cuda", GIB, fraction)


def test_free_memory_must_be_bytes():
    with pytest.raises(ValueError, match="free memory"):
        pool_bytes("cpu", -1)


def test_meminfo_and_cgroup_readers(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    2048 kB\n")
    assert meminfo_available(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:       16000000 kB\n")
    assert meminfo_available(meminfo) is None
    assert meminfo_available(tmp_path / "missing") is None

    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    assert cgroup_memory_left(tmp_path) is None  # unlimited
    (tmp_path / "memory.max").write_text(f"{GIB}\n")
    (tmp_path / "memory.current").write_text(f"{256 * MIB}\n")
    assert cgroup_memory_left(tmp_path) == 768 * MIB
    assert cgroup_memory_left(tmp_path / "nothing") is None


def test_host_available_is_within_the_cgroup_limit(monkeypatch):
    monkeypatch.setattr(sizing, "meminfo_available", lambda: 8 * GIB)
    monkeypatch.setattr(sizing, "cgroup_memory_left", lambda: None)
    assert sizing.host_available() == 8 * GIB
    monkeypatch.setattr(sizing, "cgroup_memory_left", lambda: 3 * GIB)
    assert sizing.host_available() == 3 * GIB


def page_bytes(config, page_size: int, kt_page_size: int, kv_bytes: int, kt_bytes: int) -> int:
    """One pool page over every layer: K and V of ``page_size`` tokens, KT's min and max per KT page."""
    heads, dim = config.num_key_value_heads, config.head_dim
    per_layer = 2 * heads * page_size * dim * kv_bytes + heads * (page_size // kt_page_size) * 2 * dim * kt_bytes
    return config.num_hidden_layers * per_layer


def test_pool_without_a_size_takes_the_rule_of_the_ram(monkeypatch):
    monkeypatch.setattr(sizing, "host_available", lambda: 64 * MIB)
    config = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         hidden_size=64)
    pool = KVBlockPool(config, dtype=torch.float32, kt_dtype="float32", page_size=16, kt_page_size=4, device="cpu")
    assert pool.sizing.bytes == 16 * MIB and not pool.sizing.capped
    assert pool.num_pages == 16 * MIB // page_bytes(config, 16, 4, 4, 4)
    assert pool.sizing.describe() == "0.25 of 0.1 GiB available RAM"
    # bytes given: exactly those, as before
    given = KVBlockPool(config, max_gpu_bytes=MIB, dtype=torch.float32, kt_dtype="float32", device="cpu")
    assert given.sizing is None and given.num_pages == MIB // page_bytes(config, 16, 4, 4, 4)


def test_pool_of_a_model_sizes_for_the_models_device(monkeypatch):
    monkeypatch.setattr(sizing, "host_available", lambda: 40 * GIB)
    model, _ = make_models("llama")
    pool = KVBlockPool(model, kt_dtype="bfloat16")  # the model's float32, on its device (the CPU)
    assert pool.sizing.device == "cpu" and pool.sizing.capped and pool.sizing.bytes == 2 * GIB
    assert pool.num_pages == 2 * GIB // page_bytes(model.config, 16, 4, 4, 2)
    assert "capped at 2 GiB" in pool.sizing.describe()


def test_pool_on_cuda_takes_0_9_of_the_free_device_memory(monkeypatch):
    """Sized from mem_get_info (made up here); the pages are allocated on first use, so no GPU is needed."""
    seen = []

    def mem_get_info(device=None):
        seen.append(torch.device(device))
        return 8 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         hidden_size=64)
    pool = KVBlockPool(config, dtype=torch.bfloat16, device="cuda:0")
    assert seen == [torch.device("cuda", 0)]
    # the prefill reserve of this config, by hand: dense K/V of 32768 tokens (2 x 2 layers x 2 heads x 16 x 32768 x
    # 2 bytes: the config names no dtype, counted as half precision) + a chunk of 8192 tokens' activations
    # (8192 x (8 x 64 + 4 x 11008) x 2; LlamaConfig's default intermediate size)
    reserve = 2 * 2 * 2 * 16 * 32768 * 2 + 8192 * (8 * 64 + 4 * 11008) * 2
    assert pool.sizing.reserve == reserve
    assert pool.sizing.bytes == int((8 * GIB - reserve) * 9 / 10) and pool.sizing.device == "cuda:0"
    assert pool.num_pages == pool.sizing.bytes // page_bytes(config, 16, 4, 2, 1)  # KT fp8 e5m2 by default
    assert auto_pool_size("cuda:0", fraction=0.5).bytes == 4 * GIB
    assert auto_pool_size("cuda:0").describe() == "0.9 of 8.0 GiB free on cuda:0"
    assert auto_pool_size("cuda:0", reserve=GIB).bytes == int(7 * GIB * 9 / 10)
    assert auto_pool_size("cuda:0", reserve=GIB).describe() == "0.9 of (8.0 GiB free on cuda:0 - 1.0 GiB kept for prefill)"


def test_prefill_reserve_of_llama_3_1_8b_shapes():
    """The numbers docs/memory.md states: 4 GiB of dense K/V for a 32k prompt, 1.375 GiB of one 8k chunk's
    activations (8192 x (8 x 4096 + 4 x 14336) x 2 bytes)."""
    reserve = sizing.prefill_reserve_bytes(32, 8, 128, 4096, 14336, 2)
    assert reserve == 4 * GIB + 8192 * 90112 * 2 == int(5.375 * GIB)
    config = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                         intermediate_size=14336, dtype=torch.bfloat16)
    assert sizing.model_prefill_reserve(config) == reserve


@pytest.mark.slow  # ~30 s
def test_the_pool_reserves_from_its_own_geometry_a_shards_kv_heads_under_num_kv_heads(monkeypatch):
    """KVBlockPool sizes the reserve from the geometry it holds (``geometry_prefill_reserve``), so a pool planned for
    a tensor-parallel shard (``num_kv_heads=``) keeps that shard's dense K/V only; ``model_prefill_reserve`` agrees."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * GIB, 80 * GIB))
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         hidden_size=64, intermediate_size=128)
    activations = 8192 * (8 * 64 + 4 * 128) * 2
    whole = 2 * 2 * 2 * 16 * 32768 * 2 + activations  # K and V x 2 layers x 2 KV heads x 16 x 32768 tokens x 2 bytes
    shard = 2 * 2 * 1 * 16 * 32768 * 2 + activations  # ... 1 KV head
    assert KVBlockPool(config, dtype=torch.bfloat16, device="cuda:0").sizing.reserve == whole == sizing.model_prefill_reserve(config)
    pool = KVBlockPool(config, dtype=torch.bfloat16, device="cuda:0", num_kv_heads=1)
    assert pool.sizing.reserve == shard == sizing.model_prefill_reserve(config, num_kv_heads=1)
    assert sizing.geometry_prefill_reserve(pool.geometry, 64, 128) == shard


def test_the_reserve_applies_on_cuda_only_and_never_below_zero(monkeypatch):
    monkeypatch.setattr(sizing, "host_available", lambda: 64 * MIB)
    assert auto_pool_size("cpu", reserve=GIB).reserve == 0 and auto_pool_size("cpu", reserve=GIB).bytes == 16 * MIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 80 * GIB))
    assert auto_pool_size("cuda:0", reserve=2 * GIB).bytes == 0
    with pytest.raises(ValueError, match="reserve must be an integer"):
        auto_pool_size("cuda:0", reserve=-1)


def test_a_pool_too_small_for_a_page_says_so(monkeypatch):
    monkeypatch.setattr(sizing, "host_available", lambda: 1000)
    with pytest.raises(ValueError, match="holds no page|max_gpu_bytes"):
        KVBlockPool(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64),
                    dtype=torch.float32, device="cpu")
