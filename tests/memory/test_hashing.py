"""Prefix hashing: canonical bytes (checked against a from-the-spec re-implementation), chaining, extra keys,
stability across processes (the hit cap, RocketKV's rule, is tested with cache/page_budget.py in
tests/cache/test_page_budget.py)."""

import hashlib
import struct

import pytest

from hf_rocketkv.memory.hashing import (
    ROOT_SEED,
    MultimodalItem,
    PrefixKeys,
    as_token_list,
    page_hashes,
    root_hash,
)

ROOT = root_hash("f" * 64)


def _field(tag: bytes, payload: bytes) -> bytes:
    return len(tag).to_bytes(4, "little") + tag + len(payload).to_bytes(8, "little") + payload


def test_root_and_page_zero_match_the_documented_encoding():
    fingerprint = "ab" * 32
    root = hashlib.sha256(ROOT_SEED + _field(b"fingerprint", fingerprint.encode())).digest()
    assert root_hash(fingerprint) == root
    ids = [1, 2, 70000, 2**40]
    tokens = b"".join(i.to_bytes(8, "little", signed=True) for i in ids)
    salt = _field(b"salt", "tenant-a".encode())
    adapter = _field(b"adapter", "lora:x@/p".encode())
    mm = _field(b"mm", _field(b"digest", b"img0") + struct.pack("<q", 2))
    expected0 = hashlib.sha256(root + _field(b"tokens", tokens) + salt + adapter + mm).digest()
    ids2 = [5, 6, 7, 8]
    tokens2 = b"".join(i.to_bytes(8, "little") for i in ids2)
    mm2 = _field(b"mm", _field(b"digest", b"img0") + struct.pack("<q", -2))  # the item started 2 tokens earlier
    expected1 = hashlib.sha256(expected0 + _field(b"tokens", tokens2) + adapter + mm2).digest()  # no salt after page 0
    keys = PrefixKeys(cache_salt="tenant-a", adapter="lora:x@/p", multimodal=(MultimodalItem("img0", 2, 3),))
    assert page_hashes(root, ids + ids2 + [9], 4, keys) == [expected0, expected1]


def test_only_full_pages_are_hashed():
    assert len(page_hashes(ROOT, list(range(15)), 4)) == 3
    assert len(page_hashes(ROOT, list(range(16)), 4)) == 4
    assert page_hashes(ROOT, [1, 2, 3], 4) == []


@pytest.mark.parametrize("changed_page", [0, 1, 3])
def test_chain_changing_a_token_misses_that_page_and_later(changed_page):
    ids = list(range(100, 132))  # 8 pages of 4
    base = page_hashes(ROOT, ids, 4)
    edited = list(ids)
    edited[changed_page * 4 + 2] += 1
    other = page_hashes(ROOT, edited, 4)
    assert other[:changed_page] == base[:changed_page]
    assert all(a != b for a, b in zip(other[changed_page:], base[changed_page:]))


def test_extra_keys_change_page_zero():
    ids = list(range(16))
    plain = page_hashes(ROOT, ids, 4)
    for keys in (PrefixKeys(cache_salt="s"), PrefixKeys(adapter="a"), PrefixKeys(multimodal=(MultimodalItem("d", 0, 1),)),
                 PrefixKeys(multimodal=(MultimodalItem("d", 1, 1),))):
        assert page_hashes(ROOT, ids, 4, keys)[0] != plain[0]
    # an empty salt is a salt; the multimodal item touches only the pages it overlaps
    assert page_hashes(ROOT, ids, 4, PrefixKeys(cache_salt=""))[0] != plain[0]
    late = page_hashes(ROOT, ids, 4, PrefixKeys(multimodal=(MultimodalItem("d", 9, 2),)))
    assert late[:2] == plain[:2] and late[2] != plain[2]
    assert page_hashes(ROOT, ids, 4, PrefixKeys(cache_salt="s")) != page_hashes(ROOT, ids, 4, PrefixKeys(cache_salt="t"))
    assert root_hash("a" * 64) != root_hash("b" * 64)


def test_token_id_validation():
    assert as_token_list((1, 2)) == [1, 2]
    with pytest.raises(ValueError, match=r"token_ids\[1\].*got -1"):
        as_token_list([0, -1])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        import torch

        as_token_list(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence of token ids"):
        as_token_list("abc")


@pytest.mark.parametrize("dtype", ["int64", "int32", "int16", "uint8", "uint64"])
def test_tensor_token_ids_are_checked_on_the_tensor(dtype):
    """Tensors are validated with tensor ops (no per-token Python loop): same list, same errors as for a list."""
    import torch

    dtype = getattr(torch, dtype)
    ids = torch.tensor([5, 0, 7, 200], dtype=dtype)
    got = as_token_list(ids)
    assert got == [5, 0, 7, 200] and all(type(t) is int for t in got)
    if dtype.is_signed:
        bad = torch.tensor([5, 0, -3, 7, -1], dtype=dtype)
        with pytest.raises(ValueError, match=r"token_ids\[2\] must be an integer token id in \[0, 2\*\*63\), got -3"):
            as_token_list(bad)
    for wrong in (torch.tensor([1.0, 2.0]), torch.tensor([True, False]), torch.zeros(2, 2, dtype=dtype)):
        with pytest.raises(ValueError, match="1-D integer tensor"):
            as_token_list(wrong)
    with pytest.raises(ValueError, match="PrefixKeys.cache_salt"):
        PrefixKeys(cache_salt=b"bytes")
    with pytest.raises(ValueError, match="MultimodalItem.length"):
        MultimodalItem("d", 0, 0)


# ------------------------------------------------------------------------------------------------ every token counts
@pytest.mark.parametrize("page_size", [1, 3, 4, 8, 16])
def test_every_token_of_every_page_is_in_its_hash(page_size):
    """Editing the token at ANY position p (first, middle, last of a page; small and 63-bit edits) changes the hash
    of page p // page_size and of every later page, and of no earlier page; a token of the trailing partial page
    changes no hash. (A hash that skipped a page's last token passed the earlier tests, which edit token 2 only.)"""
    pages, tail = 4, page_size - 1
    ids = [1000 + 7 * i for i in range(pages * page_size + tail)]
    base = page_hashes(ROOT, ids, page_size)
    assert len(base) == pages and len(set(base)) == pages
    for position in range(len(ids)):
        for edit in (lambda x: x + 1, lambda x: x ^ (1 << 40), lambda x: x ^ (1 << 62), lambda x: 0):
            edited = list(ids)
            edited[position] = edit(edited[position])
            other = page_hashes(ROOT, edited, page_size)
            page = position // page_size
            assert other[:page] == base[:page], (position, "an earlier page changed")
            assert all(a != b for a, b in zip(other[page:], base[page:])), (position, "a later page kept its hash")


@pytest.mark.parametrize("page_size", [2, 4, 8])
def test_page_boundaries_are_in_the_hash(page_size):
    """Tokens are hashed by position: swapping the last token of a page with the first of the next, or swapping two
    tokens inside a page, changes that page's hash; a page's hash does not depend on the page after it."""
    ids = list(range(50, 50 + 4 * page_size))
    base = page_hashes(ROOT, ids, page_size)
    for page in range(3):
        last, first_next = (page + 1) * page_size - 1, (page + 1) * page_size
        swapped = list(ids)
        swapped[last], swapped[first_next] = swapped[first_next], swapped[last]
        other = page_hashes(ROOT, swapped, page_size)
        assert other[:page] == base[:page] and all(a != b for a, b in zip(other[page:], base[page:]))
        inside = list(ids)
        inside[last - 1], inside[last] = inside[last], inside[last - 1]
        assert page_hashes(ROOT, inside, page_size)[page] != base[page]
    # the same tokens split at another boundary (a page size twice as large) hash differently page for page
    assert page_hashes(ROOT, ids, 2 * page_size)[0] not in base
    assert page_hashes(ROOT, ids[:page_size], page_size) == base[:1]
