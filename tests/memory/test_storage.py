"""Device storage: lazy per-layer allocation from the K/V actually seen, reference token writes/reads (bf16 exact,
fp8 within the documented bound), page records, pages per byte budget, geometry parsing."""

import types

import pytest
import torch

from hf_rocketkv.memory import KVBlockPool
from hf_rocketkv.memory.fp8 import FP8_MAX
from hf_rocketkv.memory.layout import RecordLayout
from hf_rocketkv.memory.page_io import read_tokens, write_tokens
from tests.memory.helpers import HEAD_DIM, KV_HEADS, fill_pages, make_pool, model_config, page_bytes


def test_layers_allocate_lazily_from_the_first_key_states():
    pool = make_pool(8, bind=False)
    with pytest.raises(ValueError, match="layer 0 has not stored anything yet"):
        pool.layer(0)
    shard = torch.zeros(3, 1, 5, HEAD_DIM, dtype=torch.float16)  # a tensor-parallel shard: 1 of the 2 KV heads
    storage = pool.layer(0, shard)
    assert storage.k.shape == (8, 1, 8, HEAD_DIM) and storage.k.dtype == torch.bfloat16  # the pool's dtype
    assert storage.kt.shape == (8, 1, 2, 2, HEAD_DIM) and storage.kt.dtype == torch.float8_e5m2
    assert storage.k_scale is None
    assert pool.layer(0, shard) is storage and pool.layer(0) is storage
    with pytest.raises(ValueError, match="holds 1 KV heads on cpu; got 2"):
        pool.layer(0, torch.zeros(1, 2, 1, HEAD_DIM))
    with pytest.raises(ValueError, match="head_dim 16, the pool was planned for head_dim 8"):
        pool.layer(1, torch.zeros(1, 2, 1, 16))
    with pytest.raises(ValueError, match="3 KV heads, more than the 2 .* pass num_kv_heads=3"):
        pool.layer(1, torch.zeros(1, 3, 1, HEAD_DIM))
    with pytest.raises(ValueError, match=r"layer index must be in \[0, 2\), got 2"):
        pool.layer(2, shard)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        pool.layer(1, torch.zeros(2, HEAD_DIM))


def test_fp8_scales_allocated_per_granularity():
    page = make_pool(4, dtype=torch.float8_e4m3fn)
    head = make_pool(4, dtype=torch.float8_e4m3fn, scale_granularity="head")
    assert page.layer(0).k_scale.shape == (4,) and head.layer(1).v_scale.shape == (4, KV_HEADS)
    assert torch.equal(page.layer(0).k_scale, torch.ones(4))


def test_num_kv_heads_override_plans_for_a_shard():
    full = KVBlockPool(model_config(), max_gpu_bytes=10 * page_bytes(), page_size=8, dtype="bfloat16")
    shard = KVBlockPool(model_config(), max_gpu_bytes=10 * page_bytes(), page_size=8, dtype="bfloat16", num_kv_heads=1)
    assert full.total_pages() == 10 and shard.total_pages() == 20
    assert full.fingerprint != shard.fingerprint


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_read_exact_for_float_storage(dtype):
    pool = make_pool(12, dtype=dtype)
    layer = pool.layer(1)
    table = [5, 2, 9, 0]  # pages in positional order, deliberately not sorted
    keys, values = torch.randn(KV_HEADS, 29, HEAD_DIM), torch.randn(KV_HEADS, 29, HEAD_DIM)
    write_tokens(layer, table, 0, keys[:, :21], values[:, :21])
    write_tokens(layer, table, 21, keys[:, 21:], values[:, 21:])  # an append that starts mid-page
    got_k, got_v = read_tokens(layer, table, 29)
    assert torch.equal(got_k, keys.to(dtype).float()) and torch.equal(got_v, values.to(dtype).float())
    # token t lives in page table[t // 8], slot t % 8
    assert torch.equal(layer.k[9, :, 3].float(), keys[:, 19].to(dtype).float())
    part_k, _ = read_tokens(layer, table, 5, start=10)
    assert torch.equal(part_k, keys[:, 10:15].to(dtype).float())
    with pytest.raises(ValueError, match=r"tokens \[30, 31\) need 4 pages, the table has 3"):
        write_tokens(layer, table[:3], 30, keys[:, :1], values[:, :1])
    with pytest.raises(ValueError, match="keys must be"):
        write_tokens(layer, table, 0, keys[:1], values[:1])


@pytest.mark.parametrize("granularity", ["page", "head"])
def test_fp8_write_read_within_bound_and_ignores_stale_slots(granularity):
    pool = make_pool(12, dtype=torch.float8_e4m3fn, scale_granularity=granularity)
    fill_pages(pool, range(12), seed=3)  # stale bytes from an earlier owner must not enter any scale
    layer = pool.layer(0)
    table = [7, 3, 11]
    keys = torch.randn(KV_HEADS, 19, HEAD_DIM) * torch.tensor([1.0, 1e-3])[:, None, None]
    values = torch.randn(KV_HEADS, 19, HEAD_DIM)
    write_tokens(layer, table, 0, keys, values)
    # the last page holds 3 tokens (16..18): its scale comes from them alone, its other slots are zero
    last = keys[:, 16:19].abs()
    expected_scale = last.amax() / FP8_MAX if granularity == "page" else last.amax(dim=(1, 2)) / FP8_MAX
    assert torch.allclose(layer.k_scale[11], expected_scale, rtol=1e-6)
    assert torch.equal(layer.k[11, :, 3:].float(), torch.zeros(KV_HEADS, 5, HEAD_DIM))
    got_k, got_v = read_tokens(layer, table, 19)
    for got, want, scales in ((got_k, keys, layer.k_scale), (got_v, values, layer.v_scale)):
        per_token = scales[[7] * 8 + [3] * 8 + [11] * 3]  # the scale of each token's page: [T] or [T, H]
        s = per_token[None, :, None] if granularity == "page" else per_token.T[:, :, None]
        assert torch.all((got - want).abs() <= want.abs() * 2.0**-4 + s * 2.0**-10 + 1e-7)


def test_record_pack_unpack_and_gather_scatter_round_trip():
    pool = make_pool(6, dtype=torch.float8_e4m3fn, scale_granularity="head")
    fill_pages(pool, range(6), seed=11)
    layout = RecordLayout([pool.layer(i).shape for i in range(2)])
    assert layout.record_bytes % 16 == 0 and all(seg.offset % 16 == 0 for seg in layout.segments)
    storage = pool._storage
    ids = torch.tensor([4, 1, 5])
    records = storage.gather_records(ids, layout)
    unpacked = layout.unpack(records)
    assert torch.equal(unpacked[(1, "v_scale")], pool.layer(1).v_scale[ids])
    assert torch.equal(unpacked[(0, "kt")].view(torch.uint8), pool.layer(0).kt[ids].view(torch.uint8))
    assert torch.equal(layout.pack(unpacked, 3), records)
    before = [pool.layer(0).k[i].clone() for i in range(6)]
    storage.scatter_records(torch.tensor([0, 2, 3]), records, layout)
    for src, dst in ((4, 0), (1, 2), (5, 3)):
        assert torch.equal(pool.layer(0).k[dst].view(torch.uint8), before[src].view(torch.uint8))
    assert torch.equal(pool.layer(1).k_scale[2], pool.layer(1).k_scale[1])


def test_geometry_from_configs_and_models():
    text = model_config(num_key_value_heads=None, head_dim=None, hidden_size=64, num_attention_heads=4)
    composite = types.SimpleNamespace(get_text_config=lambda: text, architectures=["Outer"])
    pool = KVBlockPool(composite, max_gpu_bytes=1 << 16, page_size=8, dtype="float16")
    assert (pool.geometry.num_layers, pool.geometry.num_kv_heads, pool.geometry.head_dim) == (2, 4, 16)
    assert pool.geometry.architecture == "TinyForCausalLM" and '"rope_theta":10000.0' in pool.geometry.rope

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = model_config()
            self.w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))

    assert KVBlockPool(Model(), max_gpu_bytes=1 << 16, page_size=8).dtype == torch.float16  # the weights' dtype
    with pytest.raises(ValueError, match="has no num_hidden_layers"):
        KVBlockPool(types.SimpleNamespace(), max_gpu_bytes=1 << 16, dtype="bfloat16")
    with pytest.raises(ValueError, match="has no .config"):
        KVBlockPool(torch.nn.Linear(2, 2), max_gpu_bytes=1 << 16, dtype="bfloat16")
    with pytest.raises(ValueError, match="num_key_value_heads must be a positive integer, got 0"):
        KVBlockPool(model_config(num_key_value_heads=0), max_gpu_bytes=1 << 16, dtype="bfloat16")
    with pytest.raises(ValueError, match="KVBlockPool.host_bytes=10 holds no page"):
        KVBlockPool(model_config(), max_gpu_bytes=1 << 16, host_bytes=10, page_size=8, dtype="bfloat16")
    with pytest.raises(ValueError, match="KVBlockPool.default_priority must be an integer in"):
        KVBlockPool(model_config(), max_gpu_bytes=1 << 16, dtype="bfloat16", default_priority=101)


@pytest.mark.parametrize("dtype, granularity", [(torch.bfloat16, "page"), (torch.float32, "page"),
                                                (torch.float8_e4m3fn, "page"), (torch.float8_e4m3fn, "head")])
def test_num_pages_from_bytes(dtype, granularity):
    per_page = page_bytes(dtype, 8, scale_granularity=granularity)
    pool = KVBlockPool(model_config(), max_gpu_bytes=10 * per_page + per_page - 1, page_size=8, dtype=dtype,
                       scale_granularity=granularity)
    assert pool.bytes_per_page == per_page and pool.total_pages() == 10 == pool.free_pages()
    with pytest.raises(ValueError, match=rf"max_gpu_bytes={per_page - 1} holds no page.*{per_page} bytes"):
        KVBlockPool(model_config(), max_gpu_bytes=per_page - 1, page_size=8, dtype=dtype,
                    scale_granularity=granularity)
