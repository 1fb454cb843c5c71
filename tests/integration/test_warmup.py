"""``warmup()`` (integration/warmup.py) on a tiny random Llama: one int batch size or a tuple, the cache folder
created (also without use_compile_cache), and bad arguments refused by name before anything runs."""

from __future__ import annotations

import pytest

from tests.support.tiny_models import compressing_config

EVICT = compressing_config(kt_cache_dtype="float32")  # prompt_budget 24, window 8, KT page 4


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
