"""KVBlockPool's host offload on a GPU: pages evicted to pinned host memory and brought back by a prefix hit keep
every byte (K, V, KT and fp8 scales of every layer), also when the copies overlap compute on the model's stream.

A prefix of 8,192 tokens (512 pages of 16 tokens, 32 layers of Llama-3.1-8B KV shapes) is filled with random values
and its bytes kept as the reference. Checked against that reference: (1) evict every page to the host, scramble every
free device page (a copy that did nothing fails), onload by a prefix hit; (2) an onload enqueued behind a chain of
matmuls on the compute stream (it waits only on page events); (3) three rounds of evicting half the pages while
matmuls run and onloading on a hit; and every page free again at the end. On bf16 pages, and on fp8 (e4m3)
pages with per-head scales. The bandwidth and overlap numbers are benchmarks/probes/offload_bandwidth.py's.
"""

from __future__ import annotations

import types

import pytest
import torch

from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.memory import KVBlockPool

from .gpu_models import CUDA

GIB = 1 << 30
PREFIX_TOKENS, PAGE_SIZE = 8192, 16
MATMUL_SIZE, MATMUL_COUNT = 4096, 40
LLAMA_8B_KV = types.SimpleNamespace(num_hidden_layers=32, num_key_value_heads=8, num_attention_heads=32,
                                    head_dim=128, rope_theta=500000.0, architectures=["LlamaForCausalLM"])
ROCKET = RocketKVConfig(prompt_budget=2048, window_size=32, page_size=4, kt_cache_dtype="float8_e5m2")


def page_records(pool: KVBlockPool, pages: list[int]) -> torch.Tensor:
    """Every byte of the given pages (all layers), on the device."""
    ids = torch.tensor(pages, dtype=torch.long, device=CUDA)
    return pool._storage.gather_records(ids, pool._record_layout())


def fill_random(pool: KVBlockPool, pages: list[int], seed: int) -> None:
    """Random finite values in K, V, KT and scales of ``pages`` in every layer."""
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    ids = torch.tensor(pages, dtype=torch.long, device=CUDA)
    for layer_idx in range(pool.geometry.num_layers):
        for name, tensor in pool.layer(layer_idx).tensors().items():
            values = torch.randn((len(pages), *tensor.shape[1:]), generator=generator, device=CUDA)
            if name.endswith("scale"):
                values = values.abs() + 0.01
            rows = tensor.reshape(tensor.shape[0], -1).view(torch.uint8)  # fp8 has no index_copy_: copy bytes
            rows.index_copy_(0, ids, values.to(tensor.dtype).reshape(len(pages), -1).view(torch.uint8))


def matmul_chain():
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=CUDA, dtype=torch.bfloat16)

    def run():
        x = a
        for _ in range(MATMUL_COUNT):
            x = (x @ a).clamp_(-1, 1)
        return x

    return run


@pytest.mark.parametrize("dtype,granularity", [("bfloat16", "page"), ("float8_e4m3fn", "head")],
                         ids=["bf16_pages", "fp8_pages_head_scales"])
def test_offloaded_pages_come_back_bit_exact(dtype, granularity):
    probe = KVBlockPool(LLAMA_8B_KV, max_gpu_bytes=GIB, page_size=PAGE_SIZE, dtype=dtype,
                        scale_granularity=granularity)
    prefix_pages = PREFIX_TOKENS // PAGE_SIZE
    device_pages = prefix_pages + prefix_pages // 2 + 256
    pool = KVBlockPool(LLAMA_8B_KV, max_gpu_bytes=device_pages * probe.bytes_per_page,
                       host_bytes=(prefix_pages + 64) * (probe.bytes_per_page + 4096), page_size=PAGE_SIZE,
                       dtype=dtype, scale_granularity=granularity, device=CUDA)
    pool.bind_all(CUDA)
    ids = list(range(1000, 1000 + PREFIX_TOKENS + 300))  # the prefix + 300 tokens of a question
    try:
        adm = pool.admit(len(ids), 16, ROCKET, token_ids=ids)
        fill_random(pool, list(adm.prompt.pages), seed=1)
        pool.commit_prompt(adm)
        reference = page_records(pool, list(adm.prompt.pages[: len(ids) // PAGE_SIZE]))  # every full page indexed
        pool.release(adm)

        # (1) everything to the host, the device pages scrambled, then back by a hit
        assert pool.evict() > 0
        pool.synchronize()
        filler = pool.new_table("view")
        pool.allocate(filler, pool.free_pages())
        fill_random(pool, list(filler.pages), seed=2)
        pool.release(filler)
        adm = pool.admit(len(ids), 16, ROCKET, token_ids=ids)
        pool.synchronize()
        assert adm.onloaded_pages > 0 and adm.hit_pages > 0
        assert torch.equal(page_records(pool, list(adm.prompt.pages[: adm.hit_pages])), reference[: adm.hit_pages]), \
            "the onloaded pages differ from the offloaded ones"
        pool.release(adm)

        # (2) an onload enqueued behind compute on the same stream
        run_matmuls = matmul_chain()
        pool.evict()
        pool.synchronize()
        run_matmuls()
        adm = pool.admit(len(ids), 16, ROCKET, token_ids=ids)
        torch.cuda.synchronize()
        assert torch.equal(page_records(pool, list(adm.prompt.pages[: adm.hit_pages])), reference[: adm.hit_pages]), \
            "an onload overlapping compute changed the pages"
        pool.release(adm)

        # (3) rounds of offloading half while matmuls run, then a hit
        for round_idx in range(3):
            pool.evict(prefix_pages // 2 + round_idx * 7)
            run_matmuls()
            adm = pool.admit(len(ids), 16, ROCKET, token_ids=ids)
            run_matmuls()
            hit = list(adm.prompt.pages[: adm.hit_pages])
            torch.cuda.synchronize()
            assert torch.equal(page_records(pool, hit), reference[: len(hit)]), f"round {round_idx}: pages differ"
            pool.release(adm)
        assert pool.free_pages() == pool.total_pages(), "pages were not given back"
    finally:
        pool.close()
