"""The rows per prefill forward of generate()'s automatic row groups (memory/prefill_rows.py), against the rule
written out: a scan over every row count of the bytes the module docstring counts, then the fewest even groups."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from hf_rocketkv.memory.prefill_rows import PREFILL_FRACTION, PrefillShapes, plan_prefill_rows

GiB = 2**30
LLAMA_8B = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                           num_hidden_layers=32)


def scan(hidden, intermediate, kv_heads, head_dim, dtype_bytes, batch, tokens, kept_per_row, free):
    """The rule by brute force: the largest r in [1, batch] with r rows' forward + every row's kept cache within
    0.8 of free (None: the whole batch), then the fewest forwards of as even a size as they go."""
    per_token = (8 * hidden + 4 * intermediate) * dtype_bytes + 2 * (2 * kv_heads * head_dim * dtype_bytes)

    def fits(r):
        return r * tokens * per_token + batch * kept_per_row <= 0.8 * free

    if fits(batch):
        return None
    best = max([r for r in range(1, batch) if fits(r)], default=1)
    groups = -(-batch // best)
    return -(-batch // groups)


def test_shapes_of_a_llama_by_hand():
    shapes = PrefillShapes.of(LLAMA_8B, 2)
    assert shapes.activation_bytes == (8 * 4096 + 4 * 14336) * 2 == 180_224
    assert shapes.layer_kv_bytes == 2 * 8 * 128 * 2 == 4096
    assert shapes.layers == 32
    assert shapes.forward_bytes(3, 1000) == 3 * 1000 * (180_224 + 8192)


def test_shapes_of_a_mixture_of_experts_an_explicit_head_dim_and_no_kv_heads():
    moe = SimpleNamespace(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=64, num_experts_per_tok=4, num_hidden_layers=24)
    shapes = PrefillShapes.of(moe, 2)
    assert shapes.activation_bytes == (8 * 2880 + 4 * 2880 * 4) * 2
    assert shapes.layer_kv_bytes == 2 * 8 * 64 * 2
    mha = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    shapes = PrefillShapes.of(mha, 4)
    assert shapes.activation_bytes == (8 * 64 + 4 * 256) * 4  # intermediate defaults to 4 x hidden
    assert shapes.layer_kv_bytes == 2 * 4 * 16 * 4  # every head is a KV head; head_dim = hidden / heads


@pytest.mark.parametrize("batch, tokens, kept_mib, free_gib", [
    (64, 32768, 300, 120), (128, 32768, 300, 120), (4, 32768, 300, 20), (4, 32768, 300, 60), (8, 8192, 0, 10),
    (10, 4096, 5, 2), (9, 16384, 0, 14), (2, 65536, 100, 40), (64, 512, 300, 120), (3, 100, 0, 0),
])
def test_the_rows_match_the_rule_scanned_row_by_row(batch, tokens, kept_mib, free_gib):
    shapes = PrefillShapes.of(LLAMA_8B, 2)
    kept, free = kept_mib << 20, free_gib * GiB
    plan = plan_prefill_rows(shapes, batch, tokens, kept, free, "cuda:0")
    assert plan.rows == scan(4096, 14336, 8, 128, 2, batch, tokens, kept, free)
    whole = batch * tokens * (180_224 + 8192) + batch * kept
    assert plan.need == whole and plan.free == free
    if plan.rows is not None:
        assert plan.groups == math.ceil(batch / plan.rows) and plan.rows < batch


def test_64_rows_of_32k_on_an_h200_go_in_groups_of_eleven():
    # 64 x 32k at Llama-3.1-8B shapes with ~121 GiB free after the weights: 6 forwards of 11 rows
    shapes = PrefillShapes.of(LLAMA_8B, 2)
    kept = 32 * (2048 + 256) * 4096 * 5 // 4  # 32 layers of (2048 kept + 256 new) tokens of 4 KiB, a quarter more
    plan = plan_prefill_rows(shapes, 64, 32768, kept, 121 * GiB, "cuda:0")
    assert (plan.rows, plan.groups) == (11, 6)
    assert plan.describe() == (
        "prefill of 64 rows x 32768 tokens in 6 forwards of 11 rows: one forward of the whole batch needs ~390.5 GiB, "
        "0.8 of the 121.0 GiB free on cuda:0 allows 11")


def test_a_batch_that_fits_is_one_forward_and_says_so():
    shapes = PrefillShapes.of(LLAMA_8B, 2)
    plan = plan_prefill_rows(shapes, 4, 1024, 0, 100 * GiB, "cuda:0")
    assert plan.rows is None and plan.groups == 1
    assert plan.describe() == "prefill of 4 rows x 1024 tokens in one forward (~0.7 GiB of the 100.0 GiB free on cuda:0)"


def test_the_boundary_exactly_at_the_fraction_is_one_forward():
    shapes = PrefillShapes(activation_bytes=100, layer_kv_bytes=0, layers=1)
    need = 4 * 10 * 100
    free = math.ceil(need / PREFILL_FRACTION)
    assert plan_prefill_rows(shapes, 4, 10, 0, free).rows is None
    assert plan_prefill_rows(shapes, 4, 10, 0, free - 2).rows == 2  # 3 rows fit: 2 forwards of 2


def test_a_row_that_does_not_fit_alone_is_attempted_and_said():
    shapes = PrefillShapes.of(LLAMA_8B, 2)
    plan = plan_prefill_rows(shapes, 8, 32768, 1 << 30, 10 * GiB, "cuda:0")
    assert plan.rows == 1 and not plan.fits_one_row and plan.groups == 8
    assert "not even one row fits the estimate in 0.8 of the 10.0 GiB free on cuda:0 (beside the kept caches, or " \
           "them twice while stacking): one row per forward is attempted" in plan.describe()
    # 4 rows' forwards fit beside the kept caches (8 GiB), but stacking them (16 GiB) does not fit in 8.8 GiB
    plan = plan_prefill_rows(shapes, 8, 1024, 1 << 30, 11 * GiB, "cuda:0")
    assert plan.rows == 4 and not plan.fits_one_row


@pytest.mark.parametrize("field, kwargs", [
    ("batch", dict(batch=0)), ("batch", dict(batch=True)), ("tokens", dict(tokens=2.0)),
    ("kept_per_row", dict(kept_per_row=-1)), ("free", dict(free=None)),
])
def test_bad_arguments_name_the_field(field, kwargs):
    arguments = dict(batch=2, tokens=8, kept_per_row=0, free=1 << 30) | kwargs
    with pytest.raises(ValueError, match=f"plan_prefill_rows: {field} must be an integer"):
        plan_prefill_rows(PrefillShapes.of(LLAMA_8B, 2), **arguments)
