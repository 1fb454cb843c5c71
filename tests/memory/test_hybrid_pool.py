"""A pool for a model with sliding-window layers: pages over the full-attention layers, one ring slot per row.

The oracle is computed here from the shapes (docs/memory.md, "Layer kinds"), not from the pool's code: bytes of a
page over the full-attention layers only, bytes of a slot (K and V of ``window`` tokens in every sliding layer), the
slot count and the pages left, then random sequences of admissions, reservations and releases against a plain
model (free pages, free slots lowest id first, what each admission holds).
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from hf_rocketkv.memory import KVBlockPool, PoolExhaustedError, RowDemand

HEADS, DIM, PAGE, KT_PAGE = 2, 8, 8, 4


def hybrid_config(layer_types, window=6):
    return types.SimpleNamespace(num_hidden_layers=len(layer_types), num_key_value_heads=HEADS,
                                 num_attention_heads=4, head_dim=DIM, layer_types=list(layer_types),
                                 sliding_window=window, architectures=["TinyHybrid"])


GEMMA_LIKE = ["sliding_attention"] * 5 + ["full_attention"]
ALTERNATING = ["sliding_attention", "full_attention"] * 2


def oracle_page_bytes(global_layers: int, itemsize: int = 4) -> int:
    kv = HEADS * PAGE * DIM * itemsize
    kt = HEADS * (PAGE // KT_PAGE) * 2 * DIM * 1  # float8_e5m2 KT
    return global_layers * (2 * kv + kt)


def oracle_slot_bytes(sliding_layers: int, window: int, itemsize: int = 4) -> int:
    return sliding_layers * 2 * HEADS * window * DIM * itemsize


def make(layer_types, max_gpu_bytes, window=6, **kwargs) -> KVBlockPool:
    return KVBlockPool(hybrid_config(layer_types, window), max_gpu_bytes=max_gpu_bytes, page_size=PAGE,
                       dtype=torch.float32, kt_page_size=KT_PAGE, **kwargs)


def demand(prompt: int, new: int, budget: int = 16) -> RowDemand:
    return RowDemand(prompt_tokens=prompt, new_tokens=new, view_tokens=min(prompt, budget) + new, hit_cap_tokens=0)


def ceil(a, b):
    return -(-a // b)


@pytest.mark.parametrize("layer_types", [GEMMA_LIKE, ALTERNATING])
@pytest.mark.parametrize("slots", [None, 3])
def test_sizes_follow_the_layer_kinds(layer_types, slots):
    n_sliding = layer_types.count("sliding_attention")
    n_global = len(layer_types) - n_sliding
    budget = 200_000
    pool = make(layer_types, budget, sliding_slots=slots)
    per_slot = oracle_slot_bytes(n_sliding, 6)
    expect_slots = slots if slots is not None else min(64, budget // 2 // per_slot)
    assert pool.bytes_per_page == oracle_page_bytes(n_global)
    assert pool.bytes_per_slot == per_slot
    assert pool.total_slots() == expect_slots
    assert pool.total_pages() == (budget - expect_slots * per_slot) // oracle_page_bytes(n_global)
    assert pool.device_bytes() <= budget
    assert pool.layer_windows == tuple(6 if t == "sliding_attention" else None for t in layer_types)
    stats = pool.stats()
    assert (stats.total_slots, stats.free_slots) == (expect_slots, expect_slots)


def test_a_model_without_sliding_layers_is_unchanged():
    config = types.SimpleNamespace(num_hidden_layers=3, num_key_value_heads=HEADS, num_attention_heads=4,
                                   head_dim=DIM)
    pool = KVBlockPool(config, max_gpu_bytes=100_000, page_size=PAGE, dtype=torch.float32, kt_page_size=KT_PAGE)
    assert pool.bytes_per_page == oracle_page_bytes(3)
    assert pool.total_pages() == 100_000 // oracle_page_bytes(3)
    assert (pool.total_slots(), pool.bytes_per_slot, pool.has_sliding_layers) == (0, 0, False)
    needed = pool.pages_needed(40, 8, demand(40, 8))
    assert needed.slots == 0 and needed.prefill_peak_bytes == needed.prefill_peak * pool.bytes_per_page


def test_every_layer_sliding_takes_slots_only():
    pool = make(["sliding_attention"] * 3, 10 * oracle_slot_bytes(3, 6) + 5)
    assert (pool.total_pages(), pool.total_slots()) == (0, 10)
    needed = pool.pages_needed(1000, 50, demand(1000, 50))
    assert (needed.prefill_peak, needed.steady_state, needed.slots) == (0, 0, 1)
    admissions = [pool.admit(1000, 50, demand(1000, 50)) for _ in range(10)]
    assert pool.free_slots() == 0 and not pool.can_admit(10, 1, demand(10, 1))
    with pytest.raises(PoolExhaustedError, match="sliding-window slots"):
        pool.admit(10, 1, demand(10, 1))
    for adm in admissions:
        pool.release(adm)
    assert pool.free_slots() == 10


def test_pages_needed_counts_each_kind_by_its_rule():
    pool = make(GEMMA_LIKE, 400_000, sliding_slots=4)
    per_page, per_slot = oracle_page_bytes(1), oracle_slot_bytes(5, 6)
    for prompt in (5, 64, 1000):
        needed = pool.pages_needed([prompt, 7], [3, 2], [demand(prompt, 3), demand(7, 2)])
        pages = ceil(prompt, PAGE) + ceil(min(prompt, 16) + 3, PAGE) + ceil(7, PAGE) + ceil(9, PAGE)
        steady = ceil(min(prompt, 16) + 3, PAGE) + ceil(9, PAGE)
        assert (needed.prefill_peak, needed.steady_state, needed.slots) == (pages, steady, 2)
        assert needed.prefill_peak_bytes == pages * per_page + 2 * per_slot
        assert needed.steady_state_bytes == steady * per_page + 2 * per_slot  # slots: constant in the prompt


FP8 = torch.float8_e4m3fn


def fp8_page_bytes(global_layers: int, granularity: str) -> int:
    """A page over the full-attention layers in e4m3: K and V of one byte per value, the KT, two float32 scales per
    page (``page``) or per page and KV head (``head``)."""
    kv = HEADS * PAGE * DIM * 1
    kt = HEADS * (PAGE // KT_PAGE) * 2 * DIM * 1
    scales = 2 * 4 * (1 if granularity == "page" else HEADS)
    return global_layers * (2 * kv + kt + scales)


@pytest.mark.parametrize("layer_types", [GEMMA_LIKE, ALTERNATING])
@pytest.mark.parametrize("granularity", ["page", "head"])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_fp8_pages_count_the_slab_in_the_model_dtype(layer_types, granularity, model_dtype):
    """fp8 pages over the full-attention layers; the slab keeps the model's dtype (here the config's), and every
    count (slots, pages, device bytes, pages_needed's bytes, stats) follows: the oracle is computed from the shapes."""
    n_sliding = layer_types.count("sliding_attention")
    n_global = len(layer_types) - n_sliding
    budget = 300_000
    config = hybrid_config(layer_types)
    config.dtype = model_dtype
    pool = KVBlockPool(config, max_gpu_bytes=budget, page_size=PAGE, dtype=FP8, kt_page_size=KT_PAGE,
                       scale_granularity=granularity, sliding_slots=3)
    per_page = fp8_page_bytes(n_global, granularity)
    per_slot = oracle_slot_bytes(n_sliding, 6, itemsize=model_dtype.itemsize)
    assert (pool.dtype, pool.sliding_dtype) == (FP8, model_dtype)
    assert pool.bytes_per_page == per_page
    assert pool.bytes_per_slot == per_slot
    assert pool.total_slots() == 3
    assert pool.total_pages() == (budget - 3 * per_slot) // per_page
    assert pool.device_bytes() == pool.total_pages() * per_page + 3 * per_slot <= budget
    needed = pool.pages_needed([40, 7], [3, 2], [demand(40, 3), demand(7, 2)])
    assert needed.slots == 2 and needed.prefill_peak_bytes == needed.prefill_peak * per_page + 2 * per_slot
    stats = pool.stats()
    assert (stats.total_pages, stats.total_slots, stats.free_slots) == (pool.total_pages(), 3, 3)
    # the tensors: fp8 pages with their scales in the full-attention layers, the model's dtype in the slab
    pool.bind_all("cpu")
    global_layer = layer_types.index("full_attention")
    storage = pool.layer(global_layer)
    assert storage.k.dtype == storage.v.dtype == FP8 and storage.k_scale.dtype == torch.float32
    assert storage.k_scale.shape == ((pool.total_pages(),) if granularity == "page" else (pool.total_pages(), HEADS))
    k, v = pool.sliding_slab(0, torch.zeros(1, HEADS, 1, DIM, dtype=model_dtype))
    assert k.dtype == v.dtype == model_dtype and k.shape == (3, HEADS, 6, DIM)
    assert pool._core.slab.allocated_bytes() == 3 * per_slot  # the counted bytes are the allocated ones


def test_fp8_pages_take_the_slab_dtype_from_the_model():
    """Built from a model: its parameters' dtype (not the config's) is the slab's."""
    config = hybrid_config(ALTERNATING)
    config.dtype = torch.float32
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    model.config = config
    pool = KVBlockPool(model, max_gpu_bytes=300_000, page_size=PAGE, dtype=FP8, kt_page_size=KT_PAGE,
                       sliding_slots=2)
    assert pool.sliding_dtype == torch.bfloat16 and pool.bytes_per_slot == oracle_slot_bytes(2, 6, itemsize=2)
    assert make(ALTERNATING, 300_000, sliding_slots=2).sliding_dtype == torch.float32  # not fp8: the pool's dtype
    plain = types.SimpleNamespace(num_hidden_layers=2, num_key_value_heads=HEADS, num_attention_heads=4, head_dim=DIM)
    assert KVBlockPool(plain, max_gpu_bytes=100_000, page_size=PAGE, dtype=FP8, kt_page_size=KT_PAGE
                       ).sliding_dtype is None  # no sliding layers: no slab, a Llama-style fp8 pool


def test_refusals_name_the_feature():
    with pytest.raises(ValueError, match="every layer of this model slides.*no pages to offload"):
        make(["sliding_attention"] * 2, 400_000, sliding_slots=2, host_bytes=1 << 16)
    with pytest.raises(ValueError, match="model's dtype.*names none.*set its config's dtype"):
        KVBlockPool(hybrid_config(GEMMA_LIKE), max_gpu_bytes=400_000, page_size=PAGE, kt_page_size=KT_PAGE,
                    dtype=torch.float8_e4m3fn)  # fp8 pages: the slab's dtype must come from the model or its config
    pool = make(GEMMA_LIKE, 400_000, sliding_slots=2)
    pool.release(pool.admit(16, 1, demand(16, 1), token_ids=list(range(16))))  # prefix reuse: the global layers' pages
    every_layer_slides = make(["sliding_attention"] * 2, 400_000, sliding_slots=2)
    with pytest.raises(NotImplementedError, match="every layer of this model slides"):
        every_layer_slides.admit(16, 1, demand(16, 1), token_ids=list(range(16)))
    with pytest.raises(ValueError, match="sliding_slots"):
        make(GEMMA_LIKE, 1000, sliding_slots=5)
    with pytest.raises(ValueError, match="sliding_slots"):
        KVBlockPool(types.SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, num_attention_heads=2,
                                          head_dim=8), max_gpu_bytes=10_000, dtype=torch.float32, sliding_slots=2)


def test_the_slab_is_one_fixed_tensor_per_sliding_layer():
    pool = make(ALTERNATING, 400_000, sliding_slots=3)
    keys = torch.zeros(1, HEADS, 4, DIM)
    k, v = pool.sliding_slab(0, keys)
    assert k.shape == v.shape == (3, HEADS, 6, DIM)
    assert pool.sliding_slab(2, keys)[0].shape == (3, HEADS, 6, DIM)
    assert pool.sliding_slab(0, keys)[0].data_ptr() == k.data_ptr()  # never moves
    with pytest.raises(ValueError, match="not a sliding-window layer"):
        pool.sliding_slab(1, keys)
    with pytest.raises(ValueError, match="sliding-window layer"):
        pool.layer(0, keys)
    pool.bind_all("cpu")
    assert pool.layer(1).k.shape == (pool.total_pages(), HEADS, PAGE, DIM)


@pytest.mark.slow  # 40-90 s per seed on the 2-core machine; CI runs every seed
@pytest.mark.parametrize("seed", range(6))
def test_random_admissions_reservations_and_releases_match_the_oracle(seed):
    rng = random.Random(seed)
    slots = rng.randint(2, 5)
    pool = make(GEMMA_LIKE, slots * oracle_slot_bytes(5, 6) + rng.randint(12, 30) * oracle_page_bytes(1),
                sliding_slots=slots)
    total_pages = pool.total_pages()
    free_pages, free_slots = total_pages, list(range(slots))
    reserved_pages = reserved_slots = 0
    live: list[tuple[object, list, int]] = []  # (admissions or reservation, slot ids, pages)
    for _ in range(60):
        action = rng.random()
        if action < 0.5:
            rows = rng.randint(1, 3)
            prompts = [rng.randint(1, 60) for _ in range(rows)]
            news = [rng.randint(0, 10) for _ in range(rows)]
            demands = [demand(p, n) for p, n in zip(prompts, news)]
            pages = sum(ceil(p, PAGE) + ceil(min(p, 16) + n, PAGE) for p, n in zip(prompts, news))
            fits = pages <= free_pages - reserved_pages and rows <= len(free_slots) - reserved_slots
            assert pool.can_admit(prompts, news, demands) == fits
            if not fits:
                with pytest.raises(PoolExhaustedError):
                    pool.admit_batch(prompts, news, demands)
                continue
            admissions = pool.admit_batch(prompts, news, demands)
            expected = sorted(free_slots)[:rows]
            assert [a.slot.index for a in admissions] == expected
            free_slots = sorted(set(free_slots) - set(expected))
            free_pages -= pages
            live.append((admissions, expected, pages))
        elif action < 0.65:
            pages, want = rng.randint(0, 6), rng.randint(0, 2)
            if pages <= free_pages - reserved_pages and want <= len(free_slots) - reserved_slots:
                live.append((pool.reserve(pages, "test", slots=want), [], pages))
                reserved_pages, reserved_slots = reserved_pages + pages, reserved_slots + want
            else:
                with pytest.raises(PoolExhaustedError):
                    pool.reserve(pages, "test", slots=want)
        elif live:
            obj, held_slots, pages = live.pop(rng.randrange(len(live)))
            if isinstance(obj, list):
                for admission in obj:
                    if rng.random() < 0.5:
                        pool.release(admission)
                    else:  # the cache's way: its tables now, its slot later (a finalizer's queue)
                        pool.release(admission.prompt)
                        pool.release(admission.view)
                        pool.release_later(admission.slot)
                free_pages += pages
                free_slots = sorted(free_slots + held_slots)
            else:
                reserved_pages -= obj.count
                reserved_slots -= obj.slots
                pool.unreserve(obj)
        assert pool.free_pages() == free_pages - reserved_pages
        assert pool.free_slots() == len(free_slots) - reserved_slots
        assert pool.free_slot_ids() == free_slots
        assert pool.stats().free_slots == len(free_slots) - reserved_slots
    for obj, _, _ in live:
        if isinstance(obj, list):
            for admission in obj:
                pool.release(admission)
        else:
            pool.unreserve(obj)
    assert (pool.free_pages(), pool.free_slots()) == (total_pages, slots)


def test_an_admission_out_of_a_reservation_takes_its_slots():
    pool = make(GEMMA_LIKE, 400_000, sliding_slots=2)
    reservation = pool.reserve(6, "request", slots=1)
    assert pool.free_slots() == 1
    other = pool.admit(8, 1, demand(8, 1))
    assert pool.free_slots() == 0 and not pool.can_admit(8, 1, demand(8, 1))
    with pool.exclusive():
        pool.unreserve(reservation)
        admission = pool.admit(8, 1, demand(8, 1))
    assert admission.slot.index == 1 and pool.free_slots() == 0
    pool.release(admission)
    pool.release(other)
    assert pool.free_slots() == 2
    pool.release(admission.slot)  # a lease goes back once
    assert pool.free_slots() == 2


@pytest.mark.parametrize("layer_types", [GEMMA_LIKE, ALTERNATING])
def test_host_slots_hold_a_page_of_the_full_attention_layers(layer_types):
    """Host offload (tests/integration/test_hybrid_offload_and_files.py): one host slot is one page record, the
    full-attention layers' K, V and KT (every segment here a multiple of 16 bytes: no alignment padding)."""
    n_global = layer_types.count("full_attention")
    page = oracle_page_bytes(n_global)
    host = 10 * page + page // 2
    pool = make(layer_types, 400_000, sliding_slots=2, host_bytes=host)
    assert pool.bytes_per_page == page and pool._host.slot_bytes == page
    assert pool.host_slots == 10 and pool.stats().host_slots == 10


def global_page_bytes(pool: KVBlockPool, page: int) -> bytes:
    """Every byte of one page in every full-attention layer (K, V, KT, fp8 scales)."""
    parts = []
    for layer_idx, window in enumerate(pool.layer_windows):
        if window is None:
            for tensor in pool.layer(layer_idx).tensors().values():
                parts.append(tensor[page:page + 1].contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


@pytest.mark.parametrize("dtype", [torch.float32, FP8], ids=["fp32", "fp8"])
def test_pages_round_trip_bit_exact_through_the_host_and_a_file(dtype, tmp_path):
    """Random bytes in the full-attention layers' pages come back unchanged after an offload and onload, and after a
    prefix file loaded into a fresh pool; the sliding layers' slab is in no record."""
    config = hybrid_config(ALTERNATING)
    config.dtype = torch.float32  # the slab's under fp8 pages

    def new_pool(host_bytes=0):
        pool = KVBlockPool(config, max_gpu_bytes=400_000, host_bytes=host_bytes, page_size=PAGE, dtype=dtype,
                           kt_page_size=KT_PAGE, sliding_slots=2, device="cpu")
        pool.bind_all("cpu")
        return pool

    pool = new_pool(host_bytes=1 << 16)
    ids = list(range(3, 3 + 3 * PAGE + 1))
    row = RowDemand(prompt_tokens=len(ids), new_tokens=1, view_tokens=len(ids) + 1, hit_cap_tokens=len(ids) - 1)
    adm = pool.admit(len(ids), 1, row, token_ids=ids)
    pages = torch.tensor(list(adm.prompt.pages[:3]))
    generator = torch.Generator().manual_seed(0)
    for layer_idx in (1, 3):  # the full-attention layers
        for tensor in pool.layer(layer_idx).tensors().values():
            noise = torch.rand(tensor[pages].shape, generator=generator) * 2 + 0.5
            tensor[pages] = noise.to(tensor.dtype)
    expected = [global_page_bytes(pool, int(page)) for page in pages]
    pool.commit_prompt(adm, len(ids))
    pool.release(adm)
    assert pool.evict() == 3 and pool.stats().host_cached == 3
    pool.save_prefix(tmp_path / "p.safetensors", ids)  # read from the host slots
    adm = pool.admit(len(ids), 1, row, token_ids=ids)
    assert adm.reused_tokens == 3 * PAGE and pool.stats().onloaded_bytes == 3 * pool.bytes_per_page
    assert [global_page_bytes(pool, page) for page in adm.prompt.pages[:3]] == expected
    pool.release(adm)

    fresh = new_pool()
    assert fresh.load_prefix(tmp_path / "p.safetensors").pages_loaded == 3
    assert [global_page_bytes(fresh, info.index) for info in fresh.resident_prefix(ids)] == expected
    assert fresh.free_pages() == fresh.total_pages() and fresh.free_slots() == fresh.total_slots()
