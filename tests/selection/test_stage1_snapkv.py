"""Stage 1 (SnapKV-style eviction after prefill, selection/stage1_snapkv.py and the policy the cache runs,
policies/snapkv.py) against a brute-force reference written from spec §2, alone and inside a model's prefill.

The reference uses plain Python loops over batch rows, KV heads, query heads of the group and window queries, and
float64 arithmetic. Max-pooling creates plateaus of exactly equal scores, so the kept prefix is compared "up to
ties": every kept token must score at least the k-th best reference score and every dropped token at most that
score (with a small tolerance for float32 vs float64). Without a tie at the boundary this is set equality.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_rocketkv import RocketKVCache
from hf_rocketkv.policies import SnapKVPolicy, Stage1Inputs
from hf_rocketkv.selection.stage1_snapkv import pooled_prefix_scores, snapkv_keep_slots, window_scores
from tests.support.tiny_models import compressing_config, greedy, left_pad, make_models, random_ids
from hf_rocketkv.integration.compat import cache_kwargs

# ------------------------------------------------------------------------------------------------ brute force


def ref_window_scores_row(q_row, keys_row, start, end, scaling):
    """Spec §2 for one row: fp64 softmax of each window query over the valid keys up to itself (causal inside the
    window), summed over the window queries and over the G query heads of each KV head. ``[Hkv, N]``, zeros outside
    ``[start, end)``."""
    num_q_heads, w, _ = q_row.shape
    num_kv_heads, num_slots, _ = keys_row.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_kv_heads, num_slots, dtype=torch.float64)
    for h in range(num_kv_heads):
        for g in range(group):
            query_head = h * group + g
            for i in range(w):
                query_slot = end - w + i
                visible = keys_row[h, start : query_slot + 1].double()
                logits = visible @ q_row[query_head, i].double() * scaling
                out[h, start : query_slot + 1] += torch.softmax(logits, dim=0)
    return out


def ref_max_pool(values, kernel_size):
    """Same-length max-pooling with stride 1: position j sees [j - k//2, j + k//2] clipped to the sequence."""
    half = kernel_size // 2
    n = len(values)
    return [max(values[max(0, j - half) : min(n, j + half + 1)]) for j in range(n)]


def ref_keep_row(scores_row, start, end, window_size, prompt_budget, kernel_size):
    """``(window, pooled, k)`` per KV head, or None when the row is kept whole (at most prompt_budget tokens).

    window: the always-kept slots; pooled: reference pooled scores of the prefix slots [start, end - w);
    k: how many prefix tokens are kept.
    """
    length = end - start
    if length <= prompt_budget:
        return None
    w = min(window_size, length)
    window = list(range(end - w, end))
    pooled = [ref_max_pool(scores_row[h, start : end - w].tolist(), kernel_size) for h in range(scores_row.shape[0])]
    return window, pooled, prompt_budget - w


def assert_topk_up_to_ties(chosen_prefix, pooled, k, offset, rel_tol=1e-4):
    """``chosen_prefix`` (slots) is a top-k set of ``pooled`` (scores of slots offset, offset+1, ...) up to ties."""
    chosen = [s - offset for s in chosen_prefix]
    assert len(chosen) == k and len(set(chosen)) == k, (chosen, k)
    assert all(0 <= c < len(pooled) for c in chosen), chosen
    if k == 0:
        return
    ranked = sorted(pooled, reverse=True)
    kth = ranked[k - 1]
    tol = rel_tol * max(abs(kth), 1e-6)
    chosen_set = set(chosen)
    for j, score in enumerate(pooled):
        if j in chosen_set:
            assert score >= kth - tol, f"kept slot {j + offset} scores {score} < k-th best {kth}"
        else:
            assert score <= kth + tol, f"dropped slot {j + offset} scores {score} > k-th best {kth}"


def check_row(kept, q_row, keys_row, start, end, window_size, prompt_budget, kernel_size, scaling):
    """Compare one row's kept slots ``[Hkv, n]`` with the reference."""
    num_kv_heads = keys_row.shape[0]
    assert kept.dtype == torch.long
    assert kept.shape[0] == num_kv_heads
    length = end - start
    assert kept.shape[1] == min(length, prompt_budget)
    if length <= prompt_budget:
        assert torch.equal(kept, torch.arange(start, end).expand(num_kv_heads, length))
        return
    scores = ref_window_scores_row(q_row, keys_row, start, end, scaling)
    window, pooled, k = ref_keep_row(scores, start, end, window_size, prompt_budget, kernel_size)
    for h in range(num_kv_heads):
        row = kept[h].tolist()
        assert row == sorted(row), "kept slots must be ascending"
        assert len(set(row)) == len(row)
        assert row[-len(window) :] == window, "the observation window must be kept"
        assert min(row) >= start, "left padding must never be kept"
        assert_topk_up_to_ties(row[: -len(window)], pooled[h], k, offset=start)


def random_case(seed, batch, num_kv_heads, group, head_dim, num_slots, window, lengths, pad_value=0.0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_kv_heads * group, window, head_dim, generator=generator) * 1.5
    keys = torch.randn(batch, num_kv_heads, num_slots, head_dim, generator=generator) * 1.5
    start = torch.tensor([num_slots - n for n in lengths])
    end = torch.full((batch,), num_slots)
    for b, s in enumerate(start.tolist()):
        keys[b, :, :s] = pad_value  # left padding
    return q, keys, start, end


# ------------------------------------------------------------------------------------------------ unit tests

SHAPES = [
    # batch, kv heads, group (GQA), head_dim, slots, window, budget, kernel, valid lengths per row
    (1, 1, 1, 16, 40, 4, 12, 3, [40]),
    (1, 2, 2, 32, 64, 8, 20, 5, [64]),
    (2, 2, 4, 16, 50, 6, 18, 7, [50, 37]),
    (3, 1, 8, 64, 48, 8, 16, 1, [48, 30, 12]),
    (2, 4, 3, 32, 70, 5, 33, 9, [70, 41]),
    (2, 2, 5, 16, 33, 4, 32, 3, [33, 33]),  # exactly one token over budget
    (3, 2, 2, 16, 60, 8, 8, 63, [60, 9, 8]),  # budget == window: only the window survives; kernel > length
    (1, 3, 6, 64, 90, 16, 40, 15, [90]),
    (4, 2, 7, 32, 45, 4, 10, 5, [45, 44, 11, 3]),
]


@pytest.mark.parametrize("index", range(len(SHAPES)))
def test_window_scores_match_reference(index):
    batch, kv, group, dim, slots, window, _, _, lengths = SHAPES[index]
    q, keys, start, end = random_case(100 + index, batch, kv, group, dim, slots, window, lengths, pad_value=50.0)
    scaling = dim**-0.5
    got = window_scores(q, keys, start, end, scaling)
    assert got.dtype == torch.float32 and got.shape == (batch, kv, slots)
    for b in range(batch):
        # a row shorter than the window (the last case: 3 tokens, window 4) has a window query in its padding: it
        # sees no key and adds nothing (the reference's empty softmax)
        ref = ref_window_scores_row(q[b], keys[b], int(start[b]), int(end[b]), scaling)
        torch.testing.assert_close(got[b].double(), ref, rtol=1e-5, atol=1e-6)
        assert torch.all(got[b, :, : int(start[b])] == 0), "padding slots must get no probability mass"


@pytest.mark.parametrize("kernel_size", [1, 3, 5, 63])
def test_pooling_is_same_length_max(kernel_size):
    generator = torch.Generator().manual_seed(kernel_size)
    scores = torch.rand(3, 41, generator=generator)
    got = pooled_prefix_scores(scores, kernel_size)
    assert got.shape == scores.shape
    for h in range(3):
        assert got[h].tolist() == pytest.approx(ref_max_pool(scores[h].tolist(), kernel_size))


def test_pooling_of_an_empty_prefix_is_empty():
    """A prefix of no slots (a row whose valid tokens are all window) pools to no scores, not an error."""
    got = pooled_prefix_scores(torch.zeros(3, 0), 5)
    assert got.shape == (3, 0)


@pytest.mark.parametrize("window_len", [[6, 2], [3, 6], [1, 9], [4, 4]])
def test_window_len_rows_select_as_each_row_alone(window_len):
    """Rows with fewer real window queries (``window_len``) keep what each row keeps alone with only its last
    ``window_len[b]`` queries and that many window slots, the documented oracle (a length above w counts as w)."""
    batch, kv, group, dim, slots, window, budget, kernel, lengths = SHAPES[2]
    q, keys, start, end = random_case(77, batch, kv, group, dim, slots, window, lengths, pad_value=50.0)
    kwargs = {"prompt_budget": budget, "kernel_size": kernel, "scaling": dim**-0.5}
    kept = snapkv_keep_slots(q, keys, start, end, window_size=window, window_len=torch.tensor(window_len), **kwargs)
    for b, n in enumerate(window_len):
        n = min(n, window)
        alone = snapkv_keep_slots(q[b : b + 1, :, window - n :], keys[b : b + 1], start[b : b + 1], end[b : b + 1],
                                  window_size=n, **kwargs)
        assert torch.equal(kept[b], alone[0]), (b, n)


def test_a_row_without_a_real_window_query_is_refused():
    q, keys, start, end = random_case(3, *SHAPES[2][:6], SHAPES[2][8])
    with pytest.raises(ValueError, match=r"at least one real query.*\[4, 0\]"):
        snapkv_keep_slots(q, keys, start, end, window_size=6, prompt_budget=18, kernel_size=7, scaling=0.25,
                          window_len=torch.tensor([4, 0]))


@pytest.mark.parametrize("index", range(len(SHAPES)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keep_slots_match_reference(index, seed):
    batch, kv, group, dim, slots, window, budget, kernel, lengths = SHAPES[index]
    q, keys, start, end = random_case(1000 * seed + index, batch, kv, group, dim, slots, window, lengths, pad_value=50.0)
    scaling = dim**-0.5
    kept = snapkv_keep_slots(
        q, keys, start, end, window_size=window, prompt_budget=budget, kernel_size=kernel, scaling=scaling
    )
    assert len(kept) == batch
    for b in range(batch):
        check_row(kept[b], q[b], keys[b], int(start[b]), int(end[b]), window, budget, kernel, scaling)


@pytest.mark.parametrize("index", range(len(SHAPES)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_snapkv_policy_keeps_the_reference_slots(index, seed):
    """The same brute-force reference for ``SnapKVPolicy`` (policies/snapkv.py), the stage-1 selection the cache
    runs (``snapkv_keep_slots`` above is its standalone twin, no longer called by the package)."""
    batch, kv, group, dim, slots, window, budget, kernel, lengths = SHAPES[index]
    q, keys, start, end = random_case(1000 * seed + index, batch, kv, group, dim, slots, window, lengths, pad_value=50.0)
    scaling = dim**-0.5
    kept = SnapKVPolicy(kernel_size=kernel).select(Stage1Inputs(q, keys, start, end, budget=budget, scaling=scaling))
    assert len(kept) == batch
    for b in range(batch):
        assert kept[b].counts.tolist() == [kept[b].slots.shape[1]] * kv
        check_row(kept[b].slots, q[b], keys[b], int(start[b]), int(end[b]), window, budget, kernel, scaling)


def test_prompt_at_budget_is_kept_whole_even_with_scores():
    q, keys, start, end = random_case(5, 2, 2, 2, 16, 30, 4, [30, 20])
    kept = snapkv_keep_slots(q, keys, start, end, window_size=4, prompt_budget=30, kernel_size=3, scaling=0.25)
    assert torch.equal(kept[0], torch.arange(30).expand(2, 30))
    assert torch.equal(kept[1], torch.arange(10, 30).expand(2, 20))


def test_scores_drive_selection():
    """A prefix key aligned with every window query is kept by every head; pooling keeps its neighbours too."""
    torch.manual_seed(0)
    dim, slots, window, budget = 16, 64, 4, 4 + 3
    q = torch.zeros(1, 2, window, dim)
    q[..., 0] = 4.0
    keys = torch.randn(1, 2, slots, dim) * 0.1
    keys[0, :, 20, 0] = 10.0  # slot 20 dominates the window's attention
    kept = snapkv_keep_slots(
        q, keys, torch.tensor([0]), torch.tensor([slots]), window_size=window, prompt_budget=budget, kernel_size=3,
        scaling=dim**-0.5,
    )[0]
    for h in range(2):
        assert kept[h].tolist() == [19, 20, 21, 60, 61, 62, 63]


def test_per_head_selection_differs():
    """Selection is per KV head: two heads with different hot keys keep different prefixes."""
    dim, slots, window = 16, 50, 4
    q = torch.zeros(1, 2, window, dim)
    q[..., 0] = 4.0
    keys = torch.zeros(1, 2, slots, dim)
    keys[0, 0, 5, 0] = 10.0
    keys[0, 1, 30, 0] = 10.0
    kept = snapkv_keep_slots(
        q, keys, torch.tensor([0]), torch.tensor([slots]), window_size=window, prompt_budget=window + 1,
        kernel_size=1, scaling=dim**-0.5,
    )[0]
    assert kept[0, 0].item() == 5 and kept[1, 0].item() == 30


# ------------------------------------------------------------------------------------------------ in a model

SPY_NAME = "rkvtest_spy"
_SPY: list = []


def _spy_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _SPY.append((module.layer_idx, query.detach().clone(), key.detach().clone(), scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(SPY_NAME, _spy_attention)
AttentionMaskInterface.register(SPY_NAME, sdpa_mask)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_prefill_eviction_matches_reference(arch):
    """The tokens a tiny model keeps per layer/row/KV head equal the reference computed from its own post-RoPE
    queries and keys (captured independently from an sdpa forward), with ragged left padding."""
    rocket, sdpa = make_models(arch, num_attention_heads=8, num_key_value_heads=2, hidden_size=128, head_dim=16)
    rows = [random_ids(1, n, seed=n)[0] for n in (57, 40, 21)]
    ids, mask = left_pad(rows)
    config = compressing_config(prompt_budget=24, window_size=8, kernel_size=5)
    cache = RocketKVCache(config)
    greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=1)

    sdpa.set_attn_implementation(SPY_NAME)
    _SPY.clear()
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # what generate() uses for left padding
    with torch.no_grad():
        sdpa(input_ids=ids, attention_mask=mask, position_ids=position_ids, **cache_kwargs(DynamicCache()))
    assert len(_SPY) == rocket.config.num_hidden_layers

    for layer_idx, query, key, scaling in _SPY:
        positions = cache.kept_positions(layer_idx)
        lengths = cache.layers[layer_idx].lengths.tolist()
        for b, row in enumerate(rows):
            start, end = ids.shape[1] - len(row), ids.shape[1]
            assert lengths[b] == min(len(row), config.prompt_budget)
            kept = positions[b, :, : lengths[b]].long()
            assert torch.all(positions[b, :, lengths[b] :] == -1)
            q_row = query[b, :, end - config.window_size : end]
            check_row(kept, q_row, key[b], start, end, config.window_size, config.prompt_budget,
                      config.kernel_size, scaling)
            # the stored keys are the captured keys of the kept slots
            stored = cache.layers[layer_idx].keys[b, :, : lengths[b]]
            torch.testing.assert_close(stored, key[b].gather(1, kept[..., None].expand(-1, -1, key.shape[-1])))
    assert math.isclose(_SPY[0][3], 16**-0.5)
