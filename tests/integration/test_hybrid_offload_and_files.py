"""Host offload and prefix files on models with sliding-window layers (gpt-oss, Gemma 3, Gemma 2, Cohere 2: tiny
random configs, window 8, pool pages of 8 tokens, fp32 on the CPU; docs/memory.md, "Layer kinds").

A hybrid pool's pages span the full-attention layers only; a hit takes those layers' K/V from the pages and replays
the prefix's last ``sum(windows)`` tokens for the sliding ones (tests/integration/test_hybrid_prefix_reuse.py). So a
page offloaded to host memory, or saved to a prefix file, is those layers' tensors and nothing else. The oracles,
computed here and not by the pool's code:

- bytes of a host slot and of an offloaded / onloaded page from the shapes, over the full-attention layers only;
- the page contents: the K/V of the full-attention layers that come back from the host (or from a file) equal,
  byte for byte, what those pages held before they left;
- the same prompt run cold on a fresh pool: greedy tokens equal and logits close (fp32, rtol = atol = 1e-4) after a
  hit on onloaded pages and after a hit on a file's pages, with ``reused_tokens`` the hit's whole pages;
- a file names only the full-attention layers' tensors, and loads only into a pool of the same layer kinds and
  windows (a Llama pool's file into a gpt-oss pool, the reverse, another window: refused, naming ``layer_windows``);
- every page and slot is back in the pool after close.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.memory import PrefixFileError
from hf_rocketkv.memory.prefix_file import read_prefix_file, write_prefix_file
from tests.integration.test_hybrid_prefix_reuse import (
    NEW,
    PAGE,
    all_back,
    assert_same,
    run,
    shared,
)
from tests.support.hybrid_models import WINDOW, make_hybrid_models
from tests.support.tiny_models import (
    compressing_config,
    cpu_pool,
    make_models,
    random_ids,
)

ARCHS = ["gpt_oss", "gemma3", "gemma2", "cohere2"]
HOST = 1 << 20
HEADS, DIM = 2, 16  # tests/support/tiny_models.py BASE_CONFIG
HIT = 56  # shared(70, 59, 72): 7 whole pages


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request):
    return request.param, make_hybrid_models(request.param)[0]


def global_layers(pool: KVBlockPool) -> list[int]:
    return [i for i, w in enumerate(pool.layer_windows) if w is None]


def oracle_page_bytes(num_global: int, config) -> int:
    """K + V (fp32) + KT (min and max per KT page, the config's KT dtype) of one page, full-attention layers only;
    every segment is a multiple of 16 bytes here, so a host slot (aligned record) is exactly this."""
    kv = HEADS * PAGE * DIM * 4
    kt = HEADS * (PAGE // config.page_size) * 2 * DIM * getattr(torch, config.kt_cache_dtype).itemsize
    assert kv % 16 == 0 and kt % 16 == 0
    return num_global * (2 * kv + kt)


def snapshot(pool: KVBlockPool, ids) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per resident page of ``ids``' chain (device tier): each full-attention layer's K and V of that page."""
    out = []
    for info in pool.resident_prefix(ids):
        out.append({i: (pool.layer(i).k[info.index].clone(), pool.layer(i).v[info.index].clone())
                    for i in global_layers(pool)})
    return out


def assert_pages_hold(pool: KVBlockPool, pages, expected) -> None:
    assert len(pages) == len(expected)
    for page, layers in zip(pages, expected):
        for i, (k, v) in layers.items():
            assert torch.equal(pool.layer(i).k[page], k) and torch.equal(pool.layer(i).v[page], v)


def prefill_hit_pages(model, config, pool, ids, hit_pages: int):
    """Prefill ``ids`` on ``pool``; ``(the page ids its hit landed in, the cache's stats)`` (the cache closed)."""
    cache = RocketKVCache(config, pool=pool)
    with cache.prefill(ids, torch.ones_like(ids), max_new_tokens=NEW) as start:
        pages = list(cache.pages.rows[0].admission.prompt.pages[:hit_pages])
        with torch.no_grad():
            model(input_ids=ids[:, start:], cache=cache)
    stats = cache.stats
    cache.close()
    return pages, stats


def cold_run(model, config, ids, device="cpu"):
    """``ids`` run on a fresh pool on ``device`` (no hit): ``run``'s ``(sequences, logits, stats)``."""
    pool = cpu_pool(model, config, page_size=PAGE, device=device)
    cold = run(model, config, pool, ids)
    assert cold[2].reused_tokens == 0 and all_back(pool)
    return cold


# ------------------------------------------------------------------------------------------------ host offload
def test_host_slots_count_the_full_attention_layers_only(hybrid):
    _, rocket = hybrid
    config = compressing_config()
    pool = cpu_pool(rocket, config, page_size=PAGE, host_bytes=HOST)
    num_global = len(global_layers(pool))
    assert 0 < num_global < len(pool.layer_windows)
    page = oracle_page_bytes(num_global, config)
    assert pool.bytes_per_page == page
    assert pool._host.slot_bytes == page and pool.host_slots == HOST // page
    assert pool.host_slots != HOST // oracle_page_bytes(len(pool.layer_windows), config)  # not every layer's


def test_a_prefix_onloaded_from_the_host_equals_a_cold_run(hybrid):
    """The first request's pages go to the host (``evict``); the second request sharing its prefix onloads them:
    the pages hold what they held before, and tokens / logits equal a cold run."""
    _, rocket = hybrid
    config = compressing_config()
    first, second = shared(70, 59, 72)
    pool = cpu_pool(rocket, config, page_size=PAGE, host_bytes=HOST)
    page = oracle_page_bytes(len(global_layers(pool)), config)
    run(rocket, config, pool, first)
    before = snapshot(pool, second[0])
    assert len(before) == HIT // PAGE
    cached = pool.cached_pages()
    assert pool.evict() == cached > 0 and pool.cached_pages() == 0
    stats = pool.stats()
    assert stats.host_cached == cached and stats.offloaded_bytes == cached * page and stats.dropped_pages == 0
    assert all(info.tier == "host" for info in pool.resident_prefix(second[0]))

    pages, prefill_stats = prefill_hit_pages(rocket, config, pool, second, HIT // PAGE)
    assert prefill_stats.reused_tokens == HIT and prefill_stats.onloaded_bytes == HIT // PAGE * page
    assert_pages_hold(pool, pages, before)
    assert all_back(pool)

    pool.close()

    pool = cpu_pool(rocket, config, page_size=PAGE, host_bytes=HOST)  # the same, generating: tokens and logits
    run(rocket, config, pool, first)
    assert pool.evict() > 0
    hot = run(rocket, config, pool, second)
    assert hot[2].reused_tokens == HIT and hot[2].onloaded_bytes == HIT // PAGE * page
    assert_same(hot, cold_run(rocket, config, second))
    assert all_back(pool)
    pool.close()


def test_pool_pressure_offloads_and_the_hit_comes_back(hybrid):
    """No explicit evict: other requests take the pages, the prefix moves to the host, and its hit onloads it."""
    _, rocket = hybrid
    config = compressing_config()
    first, second = shared(70, 59, 72)
    probe = cpu_pool(rocket, config, page_size=PAGE)
    bytes_for = probe.total_slots() * probe.bytes_per_slot + 16 * probe.bytes_per_page  # one 90-token request
    pool = cpu_pool(rocket, config, max_bytes=bytes_for, page_size=PAGE, host_bytes=HOST,
                    sliding_slots=probe.total_slots())
    assert pool.total_pages() == 16
    run(rocket, config, pool, first)
    for seed in (40, 41):  # unrelated prompts: their pages displace the first's
        run(rocket, config, pool, random_ids(1, 90, seed=seed))
    assert pool.stats().offloaded_bytes > 0
    hot = run(rocket, config, pool, second)
    assert hot[2].reused_tokens == HIT and hot[2].onloaded_bytes > 0
    assert_same(hot, cold_run(rocket, config, second))
    assert all_back(pool)


def test_host_bytes_are_refused_when_every_layer_slides():
    rocket, _ = make_hybrid_models("mistral")
    with pytest.raises(ValueError, match="every layer of this model slides.*no pages to offload"):
        cpu_pool(rocket, compressing_config(), page_size=PAGE, host_bytes=HOST)


# ------------------------------------------------------------------------------------------------ prefix files
@pytest.mark.parametrize("from_host", [False, True], ids=["device", "host"])
def test_a_prefix_file_in_a_fresh_pool_serves_a_hit_equal_to_a_cold_run(hybrid, tmp_path, from_host):
    arch, rocket = hybrid
    config = compressing_config()
    first, second = shared(70, 59, 72)
    pool = cpu_pool(rocket, config, page_size=PAGE, host_bytes=HOST if from_host else 0)
    run(rocket, config, pool, first)
    before = snapshot(pool, second[0])
    if from_host:
        assert pool.evict() > 0  # saved from the host slots
    path = tmp_path / f"{arch}.safetensors"
    assert pool.save_prefix(path, second[0]) == HIT
    tensors, meta = read_prefix_file(path)
    full = global_layers(pool)
    assert set(tensors) == {"token_ids"} | {f"layer.{i}.{n}" for i in full for n in ("k", "v", "kt")}
    assert json.loads(meta["layer_windows"]) == list(pool.layer_windows)
    assert torch.equal(tensors["token_ids"], second[0, :HIT])

    fresh = cpu_pool(rocket, config, page_size=PAGE)
    loaded = fresh.load_prefix(path)
    assert (loaded.num_tokens, loaded.pages_loaded, loaded.pages_already_resident) == (HIT, HIT // PAGE, 0)
    assert_pages_hold(fresh, [info.index for info in fresh.resident_prefix(second[0])], before)
    hot = run(rocket, config, fresh, second)
    assert hot[2].reused_tokens == HIT and hot[2].onloaded_bytes == 0
    assert_same(hot, cold_run(rocket, config, second))
    assert all_back(fresh) and all_back(pool)
    pool.close()


def saved_file(model, tmp_path, name: str):
    """A prefix file of 7 pages saved from a pool of ``model`` after one request."""
    config = compressing_config()
    first, second = shared(70, 59, 72)
    pool = cpu_pool(model, config, page_size=PAGE)
    run(model, config, pool, first)
    path = tmp_path / name
    assert pool.save_prefix(path, second[0]) == HIT
    return path


@pytest.fixture(scope="module")
def llama():
    return make_models("llama", num_hidden_layers=4)[0]  # as many layers as the hybrid models: kinds alone differ


def test_a_file_loads_only_into_a_pool_of_the_same_layer_kinds(hybrid, llama, tmp_path):
    arch, rocket = hybrid
    config = compressing_config()
    hybrid_file = saved_file(rocket, tmp_path, "hybrid.safetensors")
    llama_file = saved_file(llama, tmp_path, "llama.safetensors")
    with pytest.raises(PrefixFileError, match=r"layer_windows=\[null, null, null, null\].*this pool's model has "
                                              r"layer_windows=\[.*8"):
        cpu_pool(rocket, config, page_size=PAGE).load_prefix(llama_file)
    with pytest.raises(PrefixFileError, match=r"layer_windows=\[.*8.*\].*this pool's model has "
                                              r"layer_windows=\[null, null, null, null\]"):
        cpu_pool(llama, config, page_size=PAGE).load_prefix(hybrid_file)
    wider, _ = make_hybrid_models(arch, sliding_window=2 * WINDOW)  # the same weights, another window
    wider_pool = cpu_pool(wider, config, page_size=PAGE)
    assert wider_pool.fingerprint == cpu_pool(rocket, config, page_size=PAGE).fingerprint  # the window alone differs
    with pytest.raises(PrefixFileError, match=rf"layer_windows=.*{WINDOW}.*this pool's model has .*{2 * WINDOW}"):
        wider_pool.load_prefix(hybrid_file)
    other = "gpt_oss" if arch == "gemma3" else "gemma3"  # other layer kinds than ``arch``'s
    with pytest.raises(PrefixFileError, match="layer_windows"):
        cpu_pool(make_hybrid_models(other)[0], config, page_size=PAGE).load_prefix(hybrid_file)
    assert all_back(wider_pool) and wider_pool.cached_pages() == 0  # a refused file inserts nothing


def test_a_file_without_layer_windows_reads_as_all_full_attention(hybrid, llama, tmp_path):
    """Files written before ``layer_windows`` was recorded held every layer: they load into the same Llama pool and
    are refused by a hybrid pool."""
    _, rocket = hybrid
    config = compressing_config()
    tensors, meta = read_prefix_file(saved_file(llama, tmp_path, "llama.safetensors"))
    del meta["layer_windows"], meta["content_digest"]
    old = tmp_path / "old.safetensors"
    write_prefix_file(old, tensors, meta)
    assert cpu_pool(llama, config, page_size=PAGE).load_prefix(old).pages_loaded == HIT // PAGE
    with pytest.raises(PrefixFileError, match="layer_windows"):
        cpu_pool(rocket, config, page_size=PAGE).load_prefix(old)
