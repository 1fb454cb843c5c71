"""Fourteenth-session audit fixes around the pool, warmup and the benchmark commands.

* ``pages_needed`` / ``can_admit`` read keep_all from ``cfg.multi_turn``: the oracle is the free-page drop a real
  keep_all generate() causes on a pool (so an under-count shows as can_admit saying yes to a request that fails).
* ``load_prefix`` on a fresh pool built from a model (no ``device=``) serves a hit with the cold run's tokens.
* ``warmup()`` validates its arguments (errors name them) and creates ``cache_dir``; ``hf-rocketkv warmup`` and
  ``hf-rocketkv bench`` report bad arguments in one to three lines with exit 2.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.compat import cache_kwargs

from .helpers import compressing_config, greedy, make_models, random_ids

CFG = compressing_config(kt_cache_dtype="float32")  # budget 24, window 8, KT page 4
KEEP_ALL = CFG.replace(multi_turn="keep_all")


@pytest.fixture(scope="module")
def model():
    return make_models("llama")[0]


def pool_of(model_or_config, pages=None, **kwargs):
    probe = KVBlockPool(model_or_config, max_gpu_bytes=4 << 20, page_size=8, dtype=torch.float32,
                        kt_page_size=CFG.page_size, kt_dtype=CFG.kt_cache_dtype, **kwargs)
    if pages is None:
        return probe
    return KVBlockPool(model_or_config, max_gpu_bytes=pages * probe.bytes_per_page, page_size=8,
                       dtype=torch.float32, kt_page_size=CFG.page_size, kt_dtype=CFG.kt_cache_dtype, **kwargs)


def test_keep_all_accounting_comes_from_the_config_and_matches_a_real_generate(model):
    ids = random_ids(1, 60, seed=31)
    pool = pool_of(model.config, device="cpu")
    total = pool.free_pages()
    cache = RocketKVCache(KEEP_ALL, pool=pool)
    greedy(model, ids, max_new_tokens=9, **cache_kwargs(cache))  # stores 8 new tokens (the last is never fed)
    held = total - pool.free_pages()  # keep_all keeps its prompt table: the steady state is what it holds
    cache.close()
    needed = pool.pages_needed(60, 8, KEEP_ALL)
    assert needed == pool.pages_needed(60, 8, CFG, keep_all=True)
    assert needed.steady_state == held
    assert needed.prefill_peak > pool.pages_needed(60, 8, CFG).prefill_peak  # evict releases the prompt table

    tight = pool_of(model.config, pages=needed.prefill_peak - 1, device="cpu")
    assert not tight.can_admit(60, 8, KEEP_ALL)
    exact = pool_of(model.config, pages=needed.prefill_peak, device="cpu")
    assert exact.can_admit(60, 8, KEEP_ALL)
    greedy(model, ids, max_new_tokens=9, **cache_kwargs(RocketKVCache(KEEP_ALL, pool=exact)))  # it fits


def test_load_prefix_on_a_fresh_pool_built_from_the_model(model, tmp_path):
    ids = random_ids(1, 60, seed=32)
    source = pool_of(model)
    cold_cache = RocketKVCache(CFG, pool=source)
    cold = greedy(model, ids, max_new_tokens=6, **cache_kwargs(cold_cache))
    cold_cache.close()
    path = tmp_path / "prefix.safetensors"
    assert source.save_prefix(path, ids[0]) > 0
    fresh = pool_of(model)  # no device=: the model's device is used when the file's pages are placed
    fresh.load_prefix(path)
    cache = RocketKVCache(CFG, pool=fresh)
    got = greedy(model, ids, max_new_tokens=6, **cache_kwargs(cache))
    assert cache.stats.reused_tokens > 0 and torch.equal(got, cold)


@pytest.mark.parametrize("kwargs, name", [
    (dict(batch_sizes=[0]), "batch_sizes"),
    (dict(batch_sizes="x"), "batch_sizes"),
    (dict(batch_sizes=[]), "batch_sizes"),
    (dict(prompt_tokens=0), "prompt_tokens"),
    (dict(new_tokens=-1), "new_tokens"),
    (dict(prompt_tokens=1020, new_tokens=8), "max_position_embeddings"),  # the tiny model has 1024 positions
])
def test_warmup_refuses_bad_arguments_by_name(model, tmp_path, kwargs, name):
    from hf_rocketkv.integration.warmup import warmup

    with pytest.raises(ValueError, match=name):
        warmup(model, CFG, cache_dir=tmp_path / "c", **kwargs)


def test_warmup_takes_one_batch_size_and_creates_its_folder(model, tmp_path):
    from hf_rocketkv.integration.warmup import warmup

    result = warmup(model, CFG, cache_dir=tmp_path / "new" / "c", batch_sizes=2, prompt_tokens=40, new_tokens=2)
    assert [t["batch"] for t in result["timings"]] == [2]
    assert (tmp_path / "new" / "c").is_dir()


def exit_code(argv) -> int:
    """What ``hf-rocketkv ARGV`` exits with (main returns it, or an argument parser raises SystemExit)."""
    from hf_rocketkv.cli import main

    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("argv", [
    ["bench", "--bogus"],
    ["bench", "--batch", "0", "--quick"],
    ["bench", "--workload", "--batches", "0", "--quick"],
    ["warmup", "--device", "gpu"],
])
def test_bench_and_warmup_argument_errors_are_short(capsys, tmp_path, argv):
    assert exit_code(argv + (["--cache-dir", str(tmp_path)] if argv[0] == "warmup" else [])) == 2
    err = capsys.readouterr().err
    assert 1 <= len(err.strip().splitlines()) <= 3 and "Traceback" not in err


def test_warmup_refuses_a_file_as_its_cache_dir(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert exit_code(["warmup", "--cache-dir", str(afile)]) == 2
    err = capsys.readouterr().err
    assert "--cache-dir" in err and 1 <= len(err.strip().splitlines()) <= 3
