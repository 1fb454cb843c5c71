"""Prefix files: bit-exact save/load (also in a fresh process), re-hashing under the loader's salt, and refusal of
other models, dtypes, page sizes, truncated and tampered files."""

import json

import pytest
import torch

from hf_rocketkv.memory import LOADED_PREFIX_PRIORITY, PoolExhaustedError, PrefixFileError, PrefixKeys
from tests.memory.helpers import HEAD_DIM, fill_pages, make_pool, model_config, page_bytes_of, rocket_config

CFG = rocket_config(prompt_budget=32, window_size=8)
IDS = list(range(11, 11 + 45))  # 5 full pages of 8 and a partial one


def warmed_pool(dtype=torch.bfloat16, host_pages=0, keys=None, **kwargs):
    pool = make_pool(24, host_pages=host_pages, dtype=dtype, **kwargs)
    adm = pool.admit(len(IDS), 0, CFG, token_ids=IDS, keys=keys)
    fill_pages(pool, adm.prompt.pages, seed=5)
    pool.commit_prompt(adm)
    contents = [page_bytes_of(pool, p) for p in adm.prompt.pages[:5]]
    pool.release(adm)
    return pool, contents


def resident_bytes(pool, ids, keys=None):
    return [page_bytes_of(pool, info.index) for info in pool.resident_prefix(ids, keys)]


@pytest.mark.parametrize("dtype, granularity", [(torch.bfloat16, "page"), (torch.float8_e4m3fn, "head")])
def test_save_load_round_trip_bit_exact(tmp_path, dtype, granularity):
    source, contents = warmed_pool(dtype, host_pages=4, scale_granularity=granularity)
    source.evict(2)  # two pages (the chain's tail) on the host: saved from there
    assert [i.tier for i in source.resident_prefix(IDS)] == ["device"] * 3 + ["host"] * 2
    path = tmp_path / "doc.prefix.safetensors"
    assert source.save_prefix(path, IDS + [1, 2, 3]) == 40
    target = make_pool(24, dtype=dtype, scale_granularity=granularity)
    loaded = target.load_prefix(path)
    assert (loaded.num_tokens, loaded.pages_loaded, loaded.pages_already_resident) == (40, 5, 0)
    assert resident_bytes(target, IDS) == contents
    infos = target.resident_prefix(IDS)
    assert all(i.ref == 0 and i.free and i.priority == LOADED_PREFIX_PRIORITY for i in infos)
    assert [i.depth for i in infos] == [0, 1, 2, 3, 4]
    adm = target.admit(len(IDS), 0, CFG, token_ids=IDS)
    assert adm.reused_tokens == 32  # the hit cap, floor((45 - 8) / 8) pages
    target.release(adm)
    again = target.load_prefix(path)
    assert (again.pages_loaded, again.pages_already_resident) == (0, 5)
    assert target.free_pages() == 24


def test_hashes_are_recomputed_under_the_loaders_salt(tmp_path):
    tenant = PrefixKeys(cache_salt="tenant-a", adapter="lora-7")
    source, contents = warmed_pool(keys=tenant)
    path = tmp_path / "salted.safetensors"
    source.save_prefix(path, IDS, keys=tenant)
    meta = json.loads(_metadata(path)["extra_keys"])
    assert meta == {"adapter": "lora-7", "multimodal": []}  # the salt never reaches the file
    assert "tenant-a" not in path.read_bytes().decode("latin-1")
    target = make_pool(24)
    target.load_prefix(path, cache_salt="tenant-b")
    assert resident_bytes(target, IDS, PrefixKeys(cache_salt="tenant-b", adapter="lora-7")) == contents
    assert target.resident_prefix(IDS, tenant) == []  # the saving tenant's salt does not reach these pages
    assert target.resident_prefix(IDS, PrefixKeys(cache_salt="tenant-b")) == []  # the adapter came from the file


def _metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


def test_other_model_dtype_page_size_refused(tmp_path):
    source, _ = warmed_pool()
    path = tmp_path / "p.safetensors"
    source.save_prefix(path, IDS)
    for other, pattern in (
        (make_pool(24, config=model_config(rope_theta=500000.0)), "saved for another model.*rope_theta"),
        (make_pool(24, config=model_config(num_key_value_heads=1)), "saved for another model"),
        (make_pool(24, dtype=torch.float32), r"kv_dtype='bfloat16'; this pool has kv_dtype='float32'"),
        (make_pool(12, page_size=16), r"page_size='8'; this pool has page_size='16'"),
        (make_pool(24, kt_dtype="bfloat16"), r"kt_dtype='float8_e5m2'; this pool has kt_dtype='bfloat16'"),
    ):
        before = other.free_page_ids()
        with pytest.raises(PrefixFileError, match=pattern):
            other.load_prefix(path)
        assert other.free_page_ids() == before and other.cached_pages() == 0


def test_weights_enter_the_fingerprint(tmp_path):
    class Tiny(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.config = model_config(dtype="bfloat16")
            self.proj = torch.nn.Linear(4, 4)
            generator = torch.Generator().manual_seed(seed)
            for parameter in self.proj.parameters():
                torch.nn.init.normal_(parameter, generator=generator)

    same = [make_pool(24, config=None, bind=True, dtype=torch.bfloat16).fingerprint]
    from hf_rocketkv.memory import KVBlockPool

    a1 = KVBlockPool(Tiny(1), max_gpu_bytes=1 << 16, page_size=8)
    a2 = KVBlockPool(Tiny(1), max_gpu_bytes=1 << 16, page_size=8)
    b = KVBlockPool(Tiny(2), max_gpu_bytes=1 << 16, page_size=8)
    assert a1.fingerprint == a2.fingerprint and a1.fingerprint != b.fingerprint and a1.fingerprint not in same
    for pool in (a1, b):
        pool.bind_all("cpu")
    adm = a1.admit(len(IDS), 0, CFG, token_ids=IDS)
    a1.commit_prompt(adm)
    a1.release(adm)
    a1.save_prefix(tmp_path / "m.safetensors", IDS)
    with pytest.raises(PrefixFileError, match="saved for another model"):
        b.load_prefix(tmp_path / "m.safetensors")
    assert a2.load_prefix(tmp_path / "m.safetensors", device="cpu").pages_loaded == 5


def test_truncated_and_tampered_files_refused(tmp_path):
    source, _ = warmed_pool()
    path = tmp_path / "p.safetensors"
    source.save_prefix(path, IDS)
    data = path.read_bytes()
    target = make_pool(24)
    cases = {
        "truncated-half": data[: len(data) // 2],
        "truncated-tail": data[:-3],
        "tensor-byte": data[:-10] + bytes([data[-10] ^ 0x01]) + data[-9:],
        "metadata": data.replace(b'"page_size":"8"', b'"page_size":"9"') if b'"page_size":"8"' in data else
        data.replace(b'"token_count":"40"', b'"token_count":"41"'),
        "empty": b"",
    }
    for name, payload in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(payload)
        with pytest.raises(PrefixFileError, match="truncated|digest|cannot be read"):
            target.load_prefix(bad)
    assert target.cached_pages() == 0
    with pytest.raises(PrefixFileError, match="does not exist"):
        target.load_prefix(tmp_path / "missing.safetensors")


def test_load_needs_room_and_a_device(tmp_path):
    source, _ = warmed_pool()
    path = tmp_path / "p.safetensors"
    source.save_prefix(path, IDS)
    small = make_pool(4)
    before = small.free_page_ids()
    with pytest.raises(PoolExhaustedError, match="needs 5 pages but only 4"):
        small.load_prefix(path)
    assert small.free_page_ids() == before
    unbound = make_pool(24, bind=False)
    with pytest.raises(ValueError, match="pass device="):
        unbound.load_prefix(path)
    assert unbound.load_prefix(path, device="cpu").pages_loaded == 5
    assert unbound.layer(1).k.shape == (24, 2, 8, HEAD_DIM)
    with pytest.raises(ValueError, match="no page of these 3 token ids is resident"):
        source.save_prefix(tmp_path / "x.safetensors", [1, 2, 3])
