"""ring_append: one decode token per row into a sliding-window ring, Triton vs reference vs a per-element oracle."""

import pytest
import torch

from hf_rocketkv.kernels.ring_append import ring_append_torch
from tests.kernels.kernel_utils import DEVICE, gen, ops

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


@pytest.mark.parametrize("dtype,head_dim,window,shared_count,with_rows,batch,heads", [
    (torch.float32, 16, 8, False, True, 3, 2),
    (torch.bfloat16, 48, 5, True, False, 3, 3),
    (torch.float16, 128, 16, False, False, 3, 2),
    (torch.bfloat16, 256, 1024, True, True, 3, 8),
    (torch.bfloat16, 256, 1024, True, True, 1, 8),  # one row owning a 0-d count: advanced inside the launch
    (torch.float32, 64, 7, True, False, 1, 5),
])
@pytest.mark.parametrize("advance,keep", [(False, False), (True, False), (True, True)])
def test_ring_append_writes_slot_position_mod_window(dtype, head_dim, window, shared_count, with_rows, batch, heads,
                                                     advance, keep):
    """keep: the slots as they were land in kept_keys / kept_values (strided views) before the token replaces them."""
    g = gen("ring-append", dtype, head_dim, window, shared_count, with_rows, batch, heads)
    spare = 2 if with_rows else 0
    store_k = torch.randn(batch + spare, heads, window, head_dim, generator=g).to(dtype).to(DEVICE)
    store_v = torch.randn(batch + spare, heads, window, head_dim, generator=g).to(dtype).to(DEVICE)
    new_k = torch.randn(batch, heads, 1, head_dim, generator=g).to(dtype).to(DEVICE)
    new_v = torch.randn(batch, heads, 1, head_dim, generator=g).to(dtype).to(DEVICE)
    counts = [0, window - 1, 3 * window + 2][:batch]
    seen = (torch.tensor(window + 3) if shared_count else torch.tensor(counts)).to(DEVICE)
    rows = torch.randperm(batch + spare, generator=g)[:batch].to(DEVICE) if with_rows else None
    want_k, want_v = store_k.clone(), store_v.clone()
    want_kept = torch.empty(2, batch, heads, 1, head_dim, dtype=dtype, device=DEVICE)
    for b in range(batch):  # the oracle: element by element
        r = int(rows[b]) if rows is not None else b
        slot = int(seen if shared_count else seen[b]) % window
        want_kept[0, b, :, 0], want_kept[1, b, :, 0] = store_k[r, :, slot], store_v[r, :, slot]
        want_k[r, :, slot] = new_k[b, :, 0]
        want_v[r, :, slot] = new_v[b, :, 0]
    want_seen = seen + 1 if advance else seen.clone()  # advance_seen: the count moves past the token, once
    for append in (ring_append_torch, ops().ring_append):
        got_k, got_v, got_seen = store_k.clone(), store_v.clone(), seen.clone()
        kept = torch.full((2, batch, 1, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE).transpose(2, 3)
        extra = dict(kept_keys=kept[0], kept_values=kept[1]) if keep else {}
        append(got_k, got_v, got_seen, new_k, new_v, rows, advance_seen=advance, **extra)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert torch.equal(got_seen, want_seen)
        if keep:
            assert torch.equal(kept, want_kept)


def test_ring_append_takes_the_transposed_view_of_a_projection():
    """key_new as attention modules produce it: [B, 1, Hkv, D] transposed to [B, Hkv, 1, D]."""
    g = gen("ring-append-view")
    store = torch.zeros(2, 4, 8, 32, device=DEVICE)
    new = torch.randn(2, 1, 4, 32, generator=g).to(DEVICE).transpose(1, 2)
    seen = torch.tensor([5, 9], device=DEVICE)
    k, v = store.clone(), store.clone()
    ops().ring_append(k, v, seen, new, new)
    assert torch.equal(k[0, :, 5], new[0, :, 0]) and torch.equal(k[1, :, 1], new[1, :, 0]) and torch.equal(k, v)


def test_bad_arguments_are_refused_naming_them():
    k = torch.zeros(2, 2, 8, 16, device=DEVICE)
    new = torch.zeros(2, 2, 1, 16, device=DEVICE)
    for append in (ring_append_torch, ops().ring_append):
        with pytest.raises(ValueError, match="seen"):
            append(k, k.clone(), torch.zeros(2, dtype=torch.int32, device=DEVICE), new, new)
        with pytest.raises(ValueError, match="key_new"):
            append(k, k.clone(), torch.zeros(2, dtype=torch.long, device=DEVICE), new[:, :, :0], new)
        with pytest.raises(ValueError, match="rows"):
            append(k, k.clone(), torch.zeros(2, dtype=torch.long, device=DEVICE), new, new,
                   torch.zeros(3, dtype=torch.long, device=DEVICE))
        seen = torch.zeros(2, dtype=torch.long, device=DEVICE)
        with pytest.raises(ValueError, match="kept_keys and kept_values come together"):
            append(k, k.clone(), seen, new, new, kept_keys=new.clone())
        with pytest.raises(ValueError, match=r"kept_values must be \[2, 2, 1, 16\]"):
            append(k, k.clone(), seen, new, new, kept_keys=new.clone(), kept_values=new[:1].clone())
        with pytest.raises(ValueError, match="kept_keys must be .* of the store's torch.float32"):
            append(k, k.clone(), seen, new, new, kept_keys=new.half(), kept_values=new.clone())


def test_advancing_a_count_broadcast_over_rows_is_refused_before_any_write():
    """``advance_seen`` on a ``[B]`` count that is one value expanded over several rows (stride 0): refused naming
    ``seen`` before the rings are touched (the kernel would otherwise write the tokens and then fail to advance)."""
    g = gen("ring-append-expanded")
    store = torch.randn(3, 2, 8, 16, generator=g).to(DEVICE)
    new = torch.randn(3, 2, 1, 16, generator=g).to(DEVICE)
    shared = torch.tensor(5, device=DEVICE)
    for append in (ring_append_torch, ops().ring_append):
        k, v = store.clone(), store.clone()
        with pytest.raises(ValueError, match="seen is one count broadcast over 3 rows"):
            append(k, v, shared.expand(3), new, new, advance_seen=True)
        assert torch.equal(k, store) and torch.equal(v, store) and int(shared) == 5
        append(k, v, shared.expand(3), new, new)  # without advancing, the shared count is read only
        assert torch.equal(k[:, :, 5], new[:, :, 0]) and int(shared) == 5
