"""Small pools and configs for the memory/ tests (CPU, a few KiB)."""

from __future__ import annotations

import types

import torch

from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.memory import KVBlockPool

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8


def model_config(**overrides) -> types.SimpleNamespace:
    fields = dict(num_hidden_layers=LAYERS, num_key_value_heads=KV_HEADS, num_attention_heads=4, head_dim=HEAD_DIM,
                  rope_theta=10000.0, architectures=["TinyForCausalLM"])
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def rocket_config(**overrides) -> RocketKVConfig:
    fields = dict(prompt_budget=32, window_size=8, kernel_size=3, page_size=4, topk=4, topr=8)
    fields.update(overrides)
    return RocketKVConfig(**fields)


def page_bytes(dtype=torch.bfloat16, page_size: int = 8, layers: int = LAYERS, heads: int = KV_HEADS,
               head_dim: int = HEAD_DIM, kt_page_size: int = 4, scale_granularity: str = "page",
               kt_itemsize: int = 1) -> int:
    """Bytes of one page over all layers, computed here from the layout rules (independent of the pool)."""
    k = heads * page_size * head_dim * dtype.itemsize
    kt = heads * (page_size // kt_page_size) * 2 * head_dim * kt_itemsize  # default: float8_e5m2 KT
    scales = 0
    if dtype == torch.float8_e4m3fn:
        scales = 2 * 4 * (1 if scale_granularity == "page" else heads)
    return layers * (2 * k + kt + scales)


def slot_bytes(dtype=torch.bfloat16, page_size: int = 8, scale_granularity: str = "page") -> int:
    """Bytes of one host slot: each layer's K, V, KT (and fp8 scales), each rounded up to 16 bytes."""
    def align(n):
        return -(-n // 16) * 16
    k = KV_HEADS * page_size * HEAD_DIM * dtype.itemsize
    kt = KV_HEADS * (page_size // 4) * 2 * HEAD_DIM
    tensors = [k, k, kt]
    if dtype == torch.float8_e4m3fn:
        tensors += [4 * (1 if scale_granularity == "page" else KV_HEADS)] * 2
    return LAYERS * sum(align(n) for n in tensors)


def make_pool(num_pages: int = 16, host_pages: int = 0, page_size: int = 8, dtype=torch.bfloat16, bind: bool = True,
              config=None, **kwargs) -> KVBlockPool:
    """A CPU pool of exactly ``num_pages`` pages (and about ``host_pages`` host slots), layers allocated."""
    granularity = kwargs.get("scale_granularity", "page")
    kt_itemsize = 2 if kwargs.get("kt_dtype") in ("bfloat16", "float16") else 1
    config = config or model_config()
    per_page = page_bytes(dtype, page_size, heads=config.num_key_value_heads, scale_granularity=granularity,
                          kt_itemsize=kt_itemsize)
    host_bytes = host_pages * slot_bytes(dtype, page_size, granularity)
    pool = KVBlockPool(config, max_gpu_bytes=num_pages * per_page, host_bytes=host_bytes,
                       page_size=page_size, dtype=dtype, **kwargs)
    assert pool.total_pages() == num_pages and pool.host_slots == host_pages
    if bind:
        pool.bind_all("cpu")
    return pool


def fill_pages(pool: KVBlockPool, pages, seed: int) -> None:
    """Random bytes in every tensor of the given pages (K, V, KT and fp8 scales), all layers."""
    generator = torch.Generator().manual_seed(seed)
    for layer_idx in range(pool.geometry.num_layers):
        storage = pool.layer(layer_idx)
        for name, tensor in storage.tensors().items():
            for page in pages:
                raw = tensor[page].reshape(-1).view(torch.uint8) if tensor[page].dim() else \
                    tensor[page:page + 1].view(torch.uint8)
                noise = torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8)
                if name in ("k", "v", "kt") or name.endswith("scale"):
                    noise = _finite(noise, tensor.dtype)
                raw.copy_(noise)


def _finite(noise: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Random bytes that decode to finite values of ``dtype`` (NaN payloads would break == comparisons)."""
    bad = ~torch.isfinite(noise.view(dtype).float())
    grouped = noise.clone().view(-1, dtype.itemsize)
    grouped[bad] = 0
    return grouped.reshape(-1)


def page_bytes_of(pool: KVBlockPool, page: int) -> bytes:
    """Every byte of one device page in every layer, for bit-exact comparisons."""
    parts = []
    for layer_idx in range(pool.geometry.num_layers):
        for tensor in pool.layer(layer_idx).tensors().values():
            parts.append(tensor[page].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                         if tensor[page].dim() else tensor[page:page + 1].view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def snapshot(pool: KVBlockPool):
    """Everything observable about the pool's state."""
    return (
        pool.free_page_ids("device"),
        pool.free_page_ids("host"),
        [pool.page_info(i) for i in range(pool.total_pages())],
        [pool.page_info(i, "host") for i in range(pool.host_slots)],
        pool.stats(),
    )


PREFIX_CFG = rocket_config(prompt_budget=32, window_size=8)  # the prefix tests' config (pool pages of 8 tokens)


def warm(pool, ids, keys=None, priority=None):
    """Admit, 'compute', index and release a prompt: its full pages become cached. Returns its prompt pages."""
    adm = pool.admit(len(ids), 0, PREFIX_CFG, token_ids=ids, keys=keys)
    pool.commit_prompt(adm, priority=priority)
    pages = adm.prompt.pages
    pool.release(adm)
    return pages


def reused(pool, ids, keys=None):
    adm = pool.admit(len(ids), 0, PREFIX_CFG, token_ids=ids, keys=keys)
    tokens = adm.reused_tokens
    pool.release(adm)
    return tokens
