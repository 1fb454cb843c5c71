"""cache/page_budget.py, RocketKV's page arithmetic: a RocketKVConfig becomes the pool's plain per-row numbers
(``RowDemand``) by the formulas of docs/memory.md ("Accounting", "Hit cap"), recomputed here from the documentation,
not from the code; the pool's admission methods take the config through ``memory.as_budget`` and give the same
answers as the equivalent plain numbers; the config checks refuse with their messages. For keep_all, a real
generate() on a tiny Llama takes exactly the pages the formulas give at its peak and holds them after."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.cache import check_pool_policy, request_pages
from hf_rocketkv.cache.page_budget import decode_tokens, hit_cap_tokens, row_demand
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.memory import KVBlockPool, PoolExhaustedError, PoolSpec, RowDemand, as_budget
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, random_ids

MODEL = types.SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4, head_dim=8,
                              architectures=["TinyForCausalLM"])


def ceil(a: int, b: int) -> int:
    return -(-a // b)


def documented(P: int, N: int, p: int, budget: int, window: int, keep_all: bool, reuse: bool) -> dict[str, int]:
    """docs/memory.md: the Accounting table (one row, cold) and the hit cap."""
    kept = min(P, budget)
    view = ceil(kept + N, p)
    if keep_all:
        prompt, view_pages, peak, steady = ceil(P + N, p), view, ceil(P + N, p) + view, ceil(P + N, p) + view
    elif not reuse:
        prompt = max(ceil(P, p), view)
        view_pages, peak, steady = 0, prompt, view
    else:
        prompt, view_pages, peak, steady = ceil(P, p), view, ceil(P, p) + view, view
    cap = (P - window) // p * p if P > budget else (P - 1) // p * p
    return {"prompt_pages": prompt, "view_pages": view_pages, "peak_pages": peak, "steady_pages": steady,
            "hit_cap": max(0, cap)}


def config(budget: int, window: int, **fields) -> RocketKVConfig:
    return RocketKVConfig(prompt_budget=budget, window_size=window, kernel_size=3, page_size=4, topk=4, topr=8,
                          **fields)


def pool(page_size: int = 8, num_pages: int = 256, **kwargs) -> KVBlockPool:
    per_page = KVBlockPool(MODEL, max_gpu_bytes=1 << 20, page_size=page_size, dtype="bfloat16").bytes_per_page
    return KVBlockPool(MODEL, max_gpu_bytes=num_pages * per_page, page_size=page_size, dtype="bfloat16", **kwargs)


@pytest.mark.parametrize(
    "prompt_len, page, window, budget, expected",
    [
        (100, 8, 16, 32, 80),  # evicts: keep the last 16 tokens out -> floor(84 / 8) * 8
        (96, 8, 16, 32, 80),  # exact multiple of the page size
        (32, 8, 16, 32, 24),  # no eviction (P <= budget): only the last token -> floor(31 / 8) * 8
        (33, 8, 16, 32, 16),  # one token over the budget: the window rule applies
        (8, 8, 16, 32, 0),  # a one-page prompt can never hit (its last token must be computed)
        (9, 8, None, None, 8),  # no RocketKV config: last-token rule
        (10, 16, 4, 4, 0),
    ],
)
def test_hit_cap(prompt_len, page, window, budget, expected):
    assert hit_cap_tokens(prompt_len, page, window, budget) == expected


@settings(max_examples=300, deadline=None, derandomize=True)
@given(P=st.integers(1, 3000), N=st.integers(0, 400), p=st.sampled_from([4, 8, 16, 64]),
       window=st.integers(1, 64), extra=st.integers(0, 1000), keep_all=st.booleans(), reuse=st.booleans())
def test_row_numbers_follow_the_documented_formulas(P, N, p, window, extra, keep_all, reuse):
    cfg = config(window + extra, window)
    want = documented(P, N, p, window + extra, window, keep_all, reuse)
    demand = row_demand(cfg, P, N, p, keep_all)
    assert (demand.prompt_tokens, demand.new_tokens) == (P, N)
    assert demand.view_tokens == min(P, window + extra) + N
    assert demand.prompt_table_tokens == (P + N if keep_all else P) and demand.keep_prompt == keep_all
    assert demand.hit_cap_tokens == want["hit_cap"]
    pages = request_pages(cfg, PoolSpec(p, 4, "float8_e5m2", reuse), P, N, keep_all=keep_all)
    assert (pages.prompt_pages, pages.view_pages, pages.peak_pages, pages.steady_pages) == (
        want["prompt_pages"], want["view_pages"], want["peak_pages"], want["steady_pages"])


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("multi_turn", ["evict", "keep_all"])
@pytest.mark.parametrize("page", [4, 16])
def test_the_pool_takes_a_config_and_answers_as_with_its_plain_numbers(reuse, multi_turn, page):
    cfg = config(40, 8, multi_turn=multi_turn)
    keep_all = multi_turn == "keep_all"
    rows = [(130, 7), (40, 0), (9, 30), (41, 3)]
    ids = [list(range(1000 + 7 * r, 1000 + 7 * r + n)) for r, (n, _) in enumerate(rows)]
    target = pool(page, prefix_reuse=reuse)
    warm = target.admit(130, 0, cfg, token_ids=ids[0])  # rows 0 and 3 will hit
    target.commit_prompt(warm)
    target.release(warm)
    lens, news = [n for n, _ in rows], [m for _, m in rows]
    needed = target.pages_needed(lens, news, cfg, token_ids=ids)
    plain = [RowDemand(n, m, min(n, 40) + m, documented(n, m, page, 40, 8, keep_all, reuse)["hit_cap"],
                       n + m if keep_all else n, keep_all) for n, m in rows]
    assert needed == target.pages_needed(lens, news, plain, token_ids=ids)
    want = [documented(n, m, page, 40, 8, keep_all, reuse) for n, m in rows]
    assert (needed.prompt_pages, needed.view_pages, needed.steady_state) == (
        sum(w["prompt_pages"] for w in want), sum(w["view_pages"] for w in want), sum(w["steady_pages"] for w in want))
    for n, m in rows:  # one row at a time: cold rows are exactly the table
        w = documented(n, m, page, 40, 8, keep_all, reuse)
        cold = target.pages_needed(n, m, cfg)
        assert (cold.prefill_peak, cold.steady_state, cold.prompt_pages, cold.view_pages) == (
            w["peak_pages"], w["steady_pages"], w["prompt_pages"], w["view_pages"])
        assert target.can_admit(n, m, cfg) == target.can_admit(n, m, plain[rows.index((n, m))])
        adm = target.admit(n, m, cfg)
        assert (len(adm.prompt), len(adm.view)) == (w["prompt_pages"], w["view_pages"])
        target.release(adm)
    assert target.free_pages() == target.total_pages()


def test_the_hit_cap_decides_the_hits():
    """Cached prompts hit exactly up to the documented cap: the last window tokens when stage 1 evicts, else the
    last token."""
    target = pool(8)
    for P, budget in ((100, 32), (96, 32), (32, 32), (33, 32), (64, 128)):
        cfg = config(budget, 16)
        ids = list(range(5000, 5000 + P))
        warm = target.admit(P, 0, cfg, token_ids=ids)
        target.commit_prompt(warm)
        target.release(warm)
        adm = target.admit(P, 2, cfg, token_ids=ids)
        assert adm.reused_tokens == documented(P, 2, 8, budget, 16, False, True)["hit_cap"]
        target.release(adm)
        target.reset()


def test_decode_headroom_bounds_the_new_tokens():
    """docs: with decode-time compression a view stores at most decode_budget + decode_interval generated tokens."""
    assert decode_tokens(config(32, 8), 500) == 500
    compressing = config(32, 8, decode_budget=64, decode_interval=16, decode_window=8)
    assert [decode_tokens(compressing, n) for n in (10, 80, 81, 500)] == [10, 80, 80, 80]


def test_checks_keep_their_messages():
    target = pool(8)
    with pytest.raises(ValueError, match=r"RocketKVConfig.page_size \(tokens per KT page\) is 8.*"
                                         r"KVBlockPool.kt_page_size=4.*KVBlockPool.page_size, tokens per pool page"):
        target.check_config(RocketKVConfig(prompt_budget=32, window_size=8, page_size=8))
    with pytest.raises(ValueError, match="RocketKVConfig.kt_cache_dtype is 'bfloat16'.*float8_e5m2"):
        target.pages_needed(10, 1, config(32, 8, kt_cache_dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"cfg must be a RocketKVConfig; object lacks \['prompt_budget', 'page_size', "
                                         r"'window_size', 'kt_cache_dtype'\]"):
        target.can_admit(4, 1, object())
    with pytest.raises(ValueError, match=r"RocketKVConfig.stage1='adakv' gives each KV head its own number"):
        target.admit(10, 1, config(32, 8, stage1="adakv"))
    with pytest.raises(ValueError, match=r"RocketKVConfig.stage1='adakv'"):
        check_pool_policy(config(32, 8, stage1="adakv"))
    # an object with the config's fields is a config, as it always was
    duck = types.SimpleNamespace(prompt_budget=32, page_size=4, window_size=8, kt_cache_dtype="float8_e5m2")
    assert target.pages_needed(100, 10, duck) == target.pages_needed(100, 10, config(32, 8))


def test_rocketkv_conversion_is_registered_with_the_memory_floor():
    spec = PoolSpec(8, 4, "float8_e5m2")
    budget = as_budget(config(32, 8), spec)
    assert budget.rows([100, 20], [5, 5], None) == [row_demand(config(32, 8), 100, 5, 8),
                                                    row_demand(config(32, 8), 20, 5, 8)]
    assert as_budget(config(32, 8, multi_turn="keep_all"), spec).rows([10], [3], None)[0].keep_prompt
    assert not as_budget(config(32, 8, multi_turn="keep_all"), spec).rows([10], [3], False)[0].keep_prompt


# ------------------------------------------------------------------------------------------------ a real generate()
# keep_all taken from the config when ``keep_all`` is not passed, checked against the formulas above and against the
# free pages a real keep_all generate() leaves
PAGE = 8  # pool page size (tokens)
EVICT = compressing_config(kt_cache_dtype="float32")  # prompt_budget 24, window 8, KT page 4; multi_turn="evict"
KEEP_ALL = EVICT.replace(multi_turn="keep_all")
PROMPT = 60  # longer than the budget (24): keep_all and evict plans differ


def make_pool(model_or_config, pages: int | None = None, **kwargs) -> KVBlockPool:
    """A float32 pool of ``pages`` pages (default: plenty), KT slab matching the configs (float32, page 4)."""
    probe = cpu_pool(model_or_config, EVICT, 8 << 20, PAGE, **kwargs)
    if pages is None:
        return probe
    return cpu_pool(model_or_config, EVICT, pages * probe.bytes_per_page, PAGE, **kwargs)


def documented_pages(prompt_len: int, new: int, budget: int, keep_all: bool) -> tuple[int, int]:
    """``(prefill_peak, steady_state)`` of a cold row, from the table in docs/memory.md (prefix reuse on)."""
    row = documented(prompt_len, new, PAGE, budget, EVICT.window_size, keep_all, reuse=True)
    return row["peak_pages"], row["steady_pages"]


def generate_tracking_free_pages(model, pool, cfg, ids, max_new_tokens):
    """Greedy generate on a pool-backed cache; returns (tokens, smallest free_pages() seen, free_pages() after)."""
    seen = [pool.free_pages()]

    def record(*_):
        seen.append(pool.free_pages())

    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.register_forward_pre_hook(record))
        hooks.append(layer.register_forward_hook(record))
    cache = RocketKVCache(cfg, pool=pool)
    try:
        out = greedy(model, ids, max_new_tokens=max_new_tokens, **cache_kwargs(cache))
        after = pool.free_pages()
    finally:
        for hook in hooks:
            hook.remove()
        cache.close()
    return out, min(seen + [after]), after


def test_pages_needed_and_can_admit_read_keep_all_from_the_config(model):
    pool = make_pool(model.config, device="cpu")
    new = 8
    from_config = pool.pages_needed(PROMPT, new, KEEP_ALL)
    explicit = pool.pages_needed(PROMPT, new, KEEP_ALL, keep_all=True)
    evict = pool.pages_needed(PROMPT, new, EVICT)
    assert from_config == explicit
    assert (from_config.prefill_peak, from_config.steady_state) == documented_pages(PROMPT, new, 24, keep_all=True)
    assert (evict.prefill_peak, evict.steady_state) == documented_pages(PROMPT, new, 24, keep_all=False)
    assert from_config != evict  # the formulas differ for a prompt beyond the budget
    # an explicit keep_all=False still wins over the config
    assert pool.pages_needed(PROMPT, new, KEEP_ALL, keep_all=False) == evict

    # can_admit follows the same default: a pool between the two peaks admits evict but not keep_all
    peak_all, _ = documented_pages(PROMPT, new, 24, keep_all=True)
    peak_evict, _ = documented_pages(PROMPT, new, 24, keep_all=False)
    assert peak_evict < peak_all
    between = make_pool(model.config, pages=peak_all - 1, device="cpu")
    assert between.can_admit(PROMPT, new, EVICT)
    assert not between.can_admit(PROMPT, new, KEEP_ALL)
    assert between.can_admit(PROMPT, new, KEEP_ALL) == between.can_admit(PROMPT, new, KEEP_ALL, keep_all=True)


def test_keep_all_prefill_peak_matches_a_real_generate_and_sizes_the_pool(model):
    ids = random_ids(1, PROMPT, seed=41)
    n = 9  # generate(max_new_tokens=n) stores n - 1 new tokens (docs/memory.md)
    big = make_pool(model.config, device="cpu")
    total = big.free_pages()
    cold, lowest, after = generate_tracking_free_pages(model, big, KEEP_ALL, ids, n)
    observed_peak, observed_held = total - lowest, total - after
    assert observed_peak > 0 and observed_held == observed_peak  # keep_all keeps its prompt table

    reported = big.pages_needed(PROMPT, n - 1, KEEP_ALL)
    assert reported.prefill_peak == observed_peak
    assert reported.steady_state == observed_held

    exact = make_pool(model.config, pages=observed_peak, device="cpu")
    assert exact.can_admit(PROMPT, n - 1, KEEP_ALL)
    got, lowest_exact, _ = generate_tracking_free_pages(model, exact, KEEP_ALL, ids, n)
    assert lowest_exact == 0 and torch.equal(got, cold)

    short = make_pool(model.config, pages=observed_peak - 1, device="cpu")
    assert not short.can_admit(PROMPT, n - 1, KEEP_ALL)
    with pytest.raises(PoolExhaustedError):
        generate_tracking_free_pages(model, short, KEEP_ALL, ids, n)
