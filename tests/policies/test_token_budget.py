"""The paper's token-budget mode: derive_budgets against the derived-values table of docs rocketkv-spec.md §1
(D = 128, max_new = 128, S = prompt + 128 with prompts of 16000/32000/64000/96000 tokens), and our power-of-two
adaptation against values recomputed here from that table.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_rocketkv.policies import derive_budgets

# (prompt_len, t) -> (prompt_budget, topk tokens, page, top_r), copied from the spec's table
SPEC_TABLE = {
    (16000, 256): (1465, 128, 3, 61), (16000, 1024): (4684, 512, 3, 81), (16000, 4096): (10293, 2048, 2, 100),
    (32000, 256): (1491, 128, 3, 60), (32000, 1024): (5641, 512, 3, 68), (32000, 4096): (14611, 2048, 2, 71),
    (64000, 256): (1386, 128, 3, 64), (64000, 1024): (6243, 512, 3, 61), (64000, 4096): (19086, 2048, 3, 81),
    (96000, 256): (1273, 128, 3, 70), (96000, 1024): (6370, 512, 3, 60), (96000, 4096): (21468, 2048, 3, 72),
}


@pytest.mark.parametrize(("prompt_len", "budget"), sorted(SPEC_TABLE))
def test_paper_values_match_the_spec_table(prompt_len, budget):
    d = derive_budgets(prompt_len, 128, budget, 128)
    assert (d.prompt_budget, d.topk_tokens, d.paper_page_size, d.paper_topr) == SPEC_TABLE[prompt_len, budget]
    assert d.total_length == prompt_len + 128 and d.capacity == d.prompt_budget + 128


@pytest.mark.parametrize(("prompt_len", "budget"), sorted(SPEC_TABLE))
def test_our_pages_are_the_paper_page_rounded_down_to_a_power_of_two(prompt_len, budget):
    prompt_budget, topk_tokens, paper_page, _ = SPEC_TABLE[prompt_len, budget]
    page = {1: 1, 2: 2, 3: 2}[paper_page]
    stage2_compression = max(1.0, (prompt_budget + 128) / budget)
    d = derive_budgets(prompt_len, 128, budget, 128)
    assert d.page_size == page
    assert d.topk == topk_tokens // page  # pages: the exact-attention read stays t/2 tokens
    assert d.topr == int(128 * page / stage2_compression)


def test_prompt_within_budget_is_kept_whole():
    d = derive_budgets(300, 100, 1024, 64)  # S = 400 <= t: no compression
    assert (d.compression, d.split, d.capacity, d.prompt_budget) == (1.0, 0.2, 400, 300)
    assert (d.paper_page_size, d.page_size, d.topr, d.topk) == (1, 1, 64, 512)


def test_generation_longer_than_the_prompt_keeps_the_prompt():
    """capacity >= min(2 max_new, S): with max_new >= S / 2 the whole sequence fits, so the prompt is kept."""
    d = derive_budgets(1000, 4000, 64, 128)
    assert d.capacity == 5000 and d.prompt_budget == 1000


@pytest.mark.parametrize(
    ("field", "args"),
    [("prompt_len", (0, 1, 64, 8)), ("max_new_tokens", (10, -1, 64, 8)), ("token_budget", (10, 1, 1, 8)),
     ("head_dim", (10, 1, 64, 0)), ("token_budget", (10, 1, 64.0, 8))],
)
def test_bad_arguments_name_the_field(field, args):
    with pytest.raises(ValueError, match=f"derive_budgets: {field} must be an integer"):
        derive_budgets(*args)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200_000), st.integers(0, 4096), st.integers(2, 8192), st.sampled_from([64, 80, 128, 256]))
def test_derived_budgets_are_usable(prompt_len, max_new, budget, head_dim):
    d = derive_budgets(prompt_len, max_new, budget, head_dim)
    assert 0.2 <= d.split <= 0.8 and d.compression >= 1
    assert 0 <= d.prompt_budget <= prompt_len
    assert d.page_size & (d.page_size - 1) == 0 and 1 <= d.page_size <= d.paper_page_size
    assert 1 <= d.topr <= head_dim and 1 <= d.paper_topr <= head_dim
    assert d.topk >= 1 and (d.topk * d.page_size <= d.topk_tokens or d.topk == 1)
    assert d.paper_page_size <= max(1.0, d.capacity / budget)  # the paper keeps the page within c2
    # the stage-1 share: capacity is about S / c^split (or the generation floor)
    assert d.capacity >= min(2 * max_new, d.total_length)
    assert d.capacity >= math.floor(d.total_length / d.compression**d.split)


def test_top_r_is_at_least_one_channel():
    """S = 1,000,000, t = 2, D = 2: c = 500,000, a = min(0.2 + 0.06 * 18.93, 0.8) = 0.8, capacity =
    floor(1e6 / 500000^0.8) = floor(1e6 / 36,239) = 27, c2 = 27 / 2 = 13.5, page = ceil(sqrt(13.5)) = 4, and
    D * page / c2 = 8 / 13.5 = 0.59: int() gives 0 channels, clamped up to 1."""
    d = derive_budgets(1_000_000, 0, 2, 2)
    assert d.capacity == 27 and d.prompt_budget == 27
    assert (d.paper_page_size, d.page_size, d.paper_topr, d.topr) == (4, 4, 1, 1)


def test_a_one_channel_head_is_accepted():
    d = derive_budgets(1000, 0, 64, 1)
    assert d.topr == 1 and d.paper_topr == 1


def test_capacity_floor_of_twice_the_new_tokens():
    """S = 11,000 (10,000 + 1,000 new), t = 256: c = 42.97, a = 0.2 + 0.06 log2(42.97) = 0.526, S / c^a = 1,524.6 is
    under min(2 x 1,000, S) = 2,000, so capacity is 2,000 and the prompt keeps 1,000."""
    d = derive_budgets(10_000, 1_000, 256, 128)
    assert (d.capacity, d.prompt_budget) == (2000, 1000)


def test_a_page_equal_to_the_stage2_compression_is_kept():
    """S = 22, t = 8, D = 64: c = 2.75, a = 0.2 + 0.06 log2(2.75) = 0.288, capacity = floor(22 / 2.75^0.288) =
    floor(16.44) = 16, c2 = 16 / 8 = 2, page = ceil(sqrt(2)) = 2, which does not exceed c2: kept (not 1)."""
    d = derive_budgets(22, 0, 8, 64)
    assert (d.capacity, d.paper_page_size, d.page_size, d.topr) == (16, 2, 2, 64)
