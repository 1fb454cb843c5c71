"""Tests of the audit fixes of commit e7fc374 around the pool, warmup and the bench / warmup commands.

* ``pages_needed`` / ``can_admit`` take keep_all from ``cfg.multi_turn == "keep_all"`` when ``keep_all`` is not
  passed. Oracles: the formulas of docs/memory.md (computed here) and the free-page drop of a real keep_all generate().
* ``load_prefix`` on a fresh pool built from a model (no ``device=``) works, and the loaded prefix is reused with
  the cold run's tokens.
* ``hf-rocketkv warmup``: a file as ``--cache-dir``, an unknown ``--device`` and a context beyond the model's
  positions are usage errors (exit 2, 1-3 lines, no traceback), the device one before any model is loaded.
* ``hf-rocketkv bench``: argument errors of the decode and workload parsers are short (exit 2, at most 3 lines).
* ``warmup()``: one int batch size is accepted, ``cache_dir`` is created, bad arguments raise ValueError naming them.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.memory import PoolExhaustedError

from tests.support.tiny_models import compressing_config, greedy, make_models, random_ids

PAGE = 8  # pool page size (tokens)
EVICT = compressing_config(kt_cache_dtype="float32")  # prompt_budget 24, window 8, KT page 4; multi_turn="evict"
KEEP_ALL = EVICT.replace(multi_turn="keep_all")
PROMPT = 60  # longer than the budget (24): keep_all and evict plans differ


@pytest.fixture(scope="module")
def model():
    return make_models("llama", seed=3)[0]


@pytest.fixture(autouse=True)
def restore_process_state(monkeypatch):
    """main() may set torch's thread count and use_compile_cache() sets two environment variables: put them back."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    for key in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:
            monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_pool(model_or_config, pages: int | None = None, **kwargs) -> KVBlockPool:
    """A float32 pool of ``pages`` pages (default: plenty), KT slab matching the configs (float32, page 4)."""
    common = dict(page_size=PAGE, dtype=torch.float32, kt_page_size=EVICT.page_size, kt_dtype=EVICT.kt_cache_dtype)
    probe = KVBlockPool(model_or_config, max_gpu_bytes=8 << 20, **common, **kwargs)
    if pages is None:
        return probe
    return KVBlockPool(model_or_config, max_gpu_bytes=pages * probe.bytes_per_page, **common, **kwargs)


def documented_pages(prompt_len: int, new: int, budget: int, keep_all: bool) -> tuple[int, int]:
    """``(prefill_peak, steady_state)`` of a cold row, from the table in docs/memory.md (prefix reuse on)."""
    kept = min(prompt_len, budget)
    view = math.ceil((kept + new) / PAGE)
    if keep_all:
        prompt = math.ceil((prompt_len + new) / PAGE)
        return prompt + view, prompt + view
    return math.ceil(prompt_len / PAGE) + view, view


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


# ------------------------------------------------------------------------------------------------ fix 1: keep_all
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


# ------------------------------------------------------------------------------------------------ fix 2: load_prefix
def test_load_prefix_on_a_fresh_pool_built_from_the_model(model, tmp_path):
    ids = random_ids(1, PROMPT, seed=42)
    plain = greedy(model, ids, max_new_tokens=6, **cache_kwargs(RocketKVCache(EVICT)))  # the same config, no pool

    source = make_pool(model)  # built from the model, no device=
    cache = RocketKVCache(EVICT, pool=source)
    cold = greedy(model, ids, max_new_tokens=6, **cache_kwargs(cache))
    assert cache.stats.reused_tokens == 0
    cache.close()
    assert torch.equal(cold, plain)
    path = tmp_path / "prefix.safetensors"
    saved = source.save_prefix(path, ids[0])
    assert saved > 0 and saved % PAGE == 0

    fresh = make_pool(model)  # a new pool from the same model, still no device=
    loaded = fresh.load_prefix(path)
    assert loaded.num_tokens == saved and loaded.pages_loaded == saved // PAGE
    warm_cache = RocketKVCache(EVICT, pool=fresh)
    warm = greedy(model, ids, max_new_tokens=6, **cache_kwargs(warm_cache))
    assert warm_cache.stats.reused_tokens > 0
    warm_cache.close()
    assert torch.equal(warm, cold)


# ------------------------------------------------------------------------------------------------ CLI helpers
def run_cli(argv, capsys):
    """``hf-rocketkv ARGV`` in-process: (exit status, stderr). A parser's SystemExit gives its code; an exception
    escaping main() is what a user would see as a traceback, so the test fails with it."""
    from hf_rocketkv.cli import main

    try:
        rc = main(argv)
    except SystemExit as stop:
        rc = stop.code
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"hf-rocketkv {' '.join(argv)} raised {type(err).__name__}: {err} (a traceback for the user)")
    return rc, capsys.readouterr().err


def assert_short_usage_error(rc, err):
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert 1 <= len(lines) <= 3, err
    assert "Traceback" not in err


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail if the warmup command gets as far as loading a model (or warming one up)."""
    import hf_rocketkv.integration.warmup as warmup_module

    cli_main = importlib.import_module("hf_rocketkv.cli.main")  # the module (the package exports a main function)

    def refuse_load(*_args, **_kwargs):
        raise AssertionError("a model was loaded: the argument error should have come first")

    def refuse_warmup(*_args, **_kwargs):
        raise AssertionError("warmup() ran: the argument error should have come first")

    monkeypatch.setattr(cli_main, "load_model", refuse_load)
    monkeypatch.setattr(warmup_module, "warmup", refuse_warmup)


# ------------------------------------------------------------------------------------------------ fix 3: warmup CLI
def test_warmup_cli_refuses_a_file_as_cache_dir(tmp_path, capsys, no_model_loading):
    afile = tmp_path / "not_a_folder"
    afile.write_text("x")
    rc, err = run_cli(["warmup", "--cache-dir", str(afile)], capsys)
    assert_short_usage_error(rc, err)
    assert "--cache-dir" in err
    assert afile.is_file() and afile.read_text() == "x"  # left alone


def test_warmup_cli_refuses_an_unknown_device_before_loading(tmp_path, capsys, no_model_loading):
    rc, err = run_cli(["warmup", "--cache-dir", str(tmp_path / "c"), "--device", "gpu"], capsys)
    assert_short_usage_error(rc, err)
    assert "--device" in err


@pytest.fixture(scope="module")
def short_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama with only 64 positions, saved with the SmolLM2 tokenizer (as tests/cli/test_main.py does)."""
    folder = tmp_path_factory.mktemp("tiny_64_positions")
    smollm2_tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_warmup_cli_refuses_context_beyond_the_models_positions(short_model_dir, tmp_path, capsys, monkeypatch):
    import hf_rocketkv.integration.warmup as warmup_module

    def refuse_warmup(*_args, **_kwargs):
        raise AssertionError("warmup() ran with more tokens than the model has positions")

    monkeypatch.setattr(warmup_module, "warmup", refuse_warmup)
    argv = ["warmup", "--model", str(short_model_dir), "--cache-dir", str(tmp_path / "c"), "--context", "60",
            "--new-tokens", "8", "--set", "prompt_budget=32", "--set", "topk=4", "--threads", "1"]
    rc, err = run_cli(argv, capsys)  # 60 + 8 > 64
    assert_short_usage_error(rc, err)
    assert "--context" in err and "64" in err


# ------------------------------------------------------------------------------------------------ fix 4: bench parsers
@pytest.mark.parametrize("argv, option", [
    (["bench", "--bogus"], "--bogus"),
    (["bench", "--batch", "0", "--quick"], "--batch"),
    (["bench", "--workload", "--batches", "0", "--quick"], "--batches"),
], ids=["unknown-option", "batch-0", "workload-batches-0"])
def test_bench_argument_errors_are_short(argv, option, capsys, monkeypatch):
    import hf_rocketkv.bench.decode as decode
    import hf_rocketkv.bench.workload as workload

    def refuse_build(*_args, **_kwargs):
        raise AssertionError("the benchmark built a model: the bad argument was accepted")

    monkeypatch.setattr(decode, "build_model", refuse_build)
    monkeypatch.setattr(workload, "build_model", refuse_build)
    rc, err = run_cli(argv, capsys)
    assert_short_usage_error(rc, err)
    assert option in err  # the offending option is named


# ------------------------------------------------------------------------------------------------ fix 5: warmup()
def test_warmup_accepts_one_int_batch_size_and_creates_cache_dir(model, tmp_path):
    from hf_rocketkv.integration.warmup import warmup

    folder = tmp_path / "not" / "there" / "yet"
    assert not folder.exists()
    result = warmup(model, EVICT, cache_dir=folder, batch_sizes=2, prompt_tokens=16, new_tokens=2)
    assert [t["batch"] for t in result["timings"]] == [2]
    assert result["timings"][0]["seconds"] > 0
    assert folder.is_dir()  # use_compile_cache was never called


def test_warmup_creates_cache_dir_with_a_tuple_of_batch_sizes(model, tmp_path):
    from hf_rocketkv.integration.warmup import warmup

    folder = tmp_path / "fresh"
    result = warmup(model, EVICT, cache_dir=folder, batch_sizes=(1,), prompt_tokens=16, new_tokens=2)
    assert [t["batch"] for t in result["timings"]] == [1]
    assert folder.is_dir()


@pytest.mark.parametrize("kwargs, name", [
    (dict(batch_sizes=[0]), "batch_sizes"),
    (dict(batch_sizes="x"), "batch_sizes"),
    (dict(prompt_tokens=0), "prompt_tokens"),
    (dict(prompt_tokens=1020, new_tokens=8), "max_position_embeddings"),  # the tiny models have 1024 positions
], ids=["batch-0", "batch-str", "prompt-0", "beyond-positions"])
def test_warmup_refuses_bad_arguments_by_name(model, tmp_path, kwargs, name):
    from hf_rocketkv.integration.warmup import warmup

    assert model.config.max_position_embeddings == 1024
    kwargs = {"prompt_tokens": 16, "new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        warmup(model, EVICT, cache_dir=tmp_path / "c", **kwargs)
