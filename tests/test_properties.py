"""Property tests (hypothesis) for stage-2 selection and the cache layer's bookkeeping over random shapes.

Selection: random batch, KV heads, GQA ratio 1-8, head dim, page size, ragged row lengths (partial last pages):
page scores equal a float64 brute-force oracle, and the selected pages are the newest page plus the best others.

Bookkeeping: a layer driven through random sequences of prefill (left-padded, optionally chunked), decode steps and
later turns with padding between the turns. After every step: lengths, positions, KT and host mirrors agree with
what was fed, independently recomputed.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_rocketkv import RocketKVConfig, RocketKVLayer
from hf_rocketkv.cache.layer import GenerationHints
from hf_rocketkv.selection.stage2_pages import num_pages, page_scores, select_pages

from tests.support.stage2_oracle import ref_build_kt, ref_page_scores

SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


# ------------------------------------------------------------------------------------------------ selection
@st.composite
def selection_case(draw):
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    dim = draw(st.sampled_from([4, 8, 16]))
    page = draw(st.sampled_from([1, 2, 4, 8]))
    pages = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, pages * page), min_size=batch, max_size=batch))  # ragged, partial pages
    topr = draw(st.integers(1, dim + 2))
    topk = draw(st.integers(1, pages + 1))
    seed = draw(st.integers(0, 2**16))
    return batch, heads, group, dim, page, pages, lengths, topr, topk, seed


@SETTINGS
@given(selection_case())
def test_page_scores_and_selection_match_brute_force(case):
    batch, heads, group, dim, page, pages, lengths, topr, topk, seed = case
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, pages * page, dim, generator=g)
    lengths_t = torch.tensor(lengths)
    kt = ref_build_kt(keys, lengths_t, page, torch.float32)
    q = torch.randn(batch, heads, group, dim, generator=g)
    n_pages = num_pages(lengths_t, page)

    probs = page_scores(q, kt, n_pages, topr)
    expected = ref_page_scores(q, kt, n_pages, topr)
    channel_margin = q.double().abs().sum(2).sort(-1, descending=True).values
    if topr < dim and bool((channel_margin[..., topr - 1] - channel_margin[..., topr]).abs().min() < 1e-6):
        return  # a tie at the top-r channel boundary: either channel set is right
    torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-6)

    page_idx, valid = select_pages(probs, n_pages, topk)
    k = min(topk, pages)
    assert page_idx.shape == (batch, heads, k)
    for b in range(batch):
        n = int(n_pages[b])
        for h in range(heads):
            chosen = {int(p) for p, ok in zip(page_idx[b, h], valid[b, h]) if ok}
            assert len(chosen) == min(k, n) and all(0 <= p < n for p in chosen)
            assert n - 1 in chosen  # the newest page is always attended
            others = sorted(range(n - 1), key=lambda j: (-float(expected[b, h, j]), j))
            best = set(others[: min(k, n) - 1])
            worst_taken = min((float(expected[b, h, j]) for j in chosen - {n - 1}), default=None)
            best_left = max((float(expected[b, h, j]) for j in set(others) - chosen), default=None)
            if worst_taken is not None and best_left is not None:
                assert worst_taken >= best_left - 1e-6, (chosen, best)  # no better page left out (up to ties)


# ------------------------------------------------------------------------------------------------ bookkeeping
@st.composite
def layer_script(draw):
    heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    page = draw(st.sampled_from([1, 2, 4]))
    window = draw(st.integers(1, 4))
    budget = draw(st.integers(window, 12))
    batch = draw(st.integers(1, 3))
    prompt = draw(st.integers(1, 20))
    pads = draw(st.lists(st.integers(0, prompt - 1), min_size=batch, max_size=batch))
    chunks = draw(st.sampled_from([None, 3, 5]))
    steps = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("decode"), st.integers(1, 4)),
                st.tuples(st.just("turn"), st.lists(st.integers(1, 6), min_size=batch, max_size=batch)),
            ),
            max_size=4,
        )
    )
    seed = draw(st.integers(0, 2**16))
    return heads, group, page, window, budget, batch, prompt, pads, chunks, steps, seed


class Shadow:
    """The oracle's own record of what each row has stored: (column, key) in slot order, per row and KV head."""

    def __init__(self, batch):
        self.rows = [[] for _ in range(batch)]


def _check(layer: RocketKVLayer, seen: int, shadow_counts: list[int]) -> None:
    cfg = layer.config
    lengths = layer.lengths.tolist()
    assert lengths == shadow_counts
    assert layer.host_max_length == max(lengths)
    assert layer.host_seen == seen == int(layer.seen)
    assert layer.capacity % cfg.page_size == 0 and layer.capacity >= max(lengths)
    for b, n in enumerate(lengths):
        columns = layer.positions[b, :, :n]
        if n > 1:
            assert bool((columns[:, 1:] > columns[:, :-1]).all())  # ascending, unique
        assert bool((columns >= 0).all()) and bool((columns < seen).all())
        assert bool((layer.positions[b, :, n:] == -1).all())
    torch.testing.assert_close(
        layer.kt.float(), ref_build_kt(layer.keys, layer.lengths, cfg.page_size, torch.float32), rtol=0, atol=0
    )


@SETTINGS
@given(layer_script())
def test_layer_bookkeeping_over_random_request_sequences(script):
    heads, group, page, window, budget, batch, prompt, pads, chunks, steps, seed = script
    g = torch.Generator().manual_seed(seed)
    dim = 8
    config = RocketKVConfig(
        prompt_budget=budget, window_size=window, kernel_size=3, topk=2, topr=dim, page_size=page,
        kt_cache_dtype="float32", backend="torch", capacity_headroom=4,
    )
    layer = RocketKVLayer(config, GenerationHints())

    def qkv(n):
        return (torch.randn(batch, heads, n, dim, generator=g), torch.randn(batch, heads, n, dim, generator=g),
                torch.randn(batch, heads * group, n, dim, generator=g))

    # prefill, left-padded, in chunks or at once
    start = torch.tensor(pads)
    fed = 0
    for size in ([prompt] if chunks is None else [min(chunks, prompt - i) for i in range(0, prompt, chunks)]):
        k, v, q = qkv(size)
        layer.update(k, v)
        fed += size
        column = torch.arange(fed - size, fed)
        layer.observe_prefill(q, start, dim**-0.5, valid=column[None, :] >= start[:, None])
    layer.compress()
    counts = [min(prompt - p, budget) for p in pads]
    seen = prompt
    _check(layer, seen, counts)

    for kind, arg in steps:
        if kind == "decode":
            for _ in range(arg):
                k, v, _ = qkv(1)
                layer.update(k, v)
                seen += 1
                counts = [c + 1 for c in counts]
                _check(layer, seen, counts)
        else:  # a later turn: row b adds arg[b] real tokens, padding between the turns (one forward)
            n = max(arg) + 1
            valid = torch.zeros(batch, n, dtype=torch.bool)
            valid[:, 0] = True  # the previous turn's last token, fed back now
            for b, m in enumerate(arg):
                valid[b, n - m :] = True
            k, v, q = qkv(n)
            layer.update(k, v)
            layer.store_new_tokens(valid)
            seen += n
            counts = [c + int(valid[b].sum()) for b, c in enumerate(counts)]
            _check(layer, seen, counts)
            layer.observe_prefill(q, None, dim**-0.5, valid=valid)
            layer.compress()
            counts = [min(c, budget) for c in counts]
            _check(layer, seen, counts)
            for b in range(batch):
                stored = set(layer.positions[b, 0, : counts[b]].tolist())
                real_new = {seen - n + j for j in range(n) if valid[b, j]}
                padding = {seen - n + j for j in range(n) if not valid[b, j]}
                assert not stored & padding  # padding is never stored
                last_real = sorted(real_new)[-min(window, len(real_new)) :]
                assert set(last_real) <= stored  # the turn's window (its last real tokens) is always kept
