"""generate()'s automatic row groups (``prefill_batch_size=None``, integration/row_groups.py): a batch whose
one-forward prefill would not fit in the free memory is prefilled in groups, with the tokens of one forward.

The free memory is what ``free_for_prefill`` reads; these tests set it (a tiny model never runs short) and check the
tokens against a one-forward prefill and against the same groups set by hand (``prefill_batch_size``)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.integration import row_groups
from hf_rocketkv.memory.prefill_rows import PrefillShapes
from tests.support.tiny_models import compressing_config, greedy, left_pad, random_ids

LOGGER = "hf_rocketkv.integration.row_groups"


def _batch():
    return left_pad([random_ids(1, n, seed=n)[0] for n in (60, 45, 20, 31, 52)])


def _free_for(model, rows: int, tokens: int, kept_per_row: int, batch: int) -> int:
    """Free bytes under which exactly ``rows`` rows' forward fits beside the batch's kept caches (the rule by hand)."""
    config = model.config
    per_token = (8 * config.hidden_size + 4 * config.intermediate_size) * 4 \
        + 2 * (2 * config.num_key_value_heads * config.head_dim * 4)
    need = rows * tokens * per_token + batch * kept_per_row
    return int(need / 0.8) + 1


def _kept_per_row(model, cache_config, tokens: int, new: int) -> int:
    config = model.config
    layer_kv = 2 * config.num_key_value_heads * config.head_dim * 4
    return layer_kv * config.num_hidden_layers * (min(tokens, cache_config.prompt_budget) + new) * 5 // 4


def test_a_batch_that_does_not_fit_is_prefilled_in_groups_with_the_tokens_of_one_forward(llama_pair, monkeypatch,
                                                                                         caplog):
    rocket, _ = llama_pair
    ids, mask = _batch()
    reference = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(compressing_config()), max_new_tokens=8)
    by_hand = greedy(rocket, ids, attention_mask=mask, max_new_tokens=8,
                     cache=RocketKVCache(compressing_config(prefill_batch_size=2)))
    kept = _kept_per_row(rocket, compressing_config(), ids.shape[1], 8)
    monkeypatch.setattr(row_groups, "free_for_prefill", lambda device: _free_for(rocket, 2, ids.shape[1], kept, 5))
    groups = []
    run_groups = row_groups.prefill_in_row_groups
    monkeypatch.setattr(row_groups, "prefill_in_row_groups",
                        lambda call, cache, rows: groups.append(rows) or run_groups(call, cache, rows))
    import hf_rocketkv.integration.generate as generate_module
    monkeypatch.setattr(generate_module, "prefill_in_row_groups", row_groups.prefill_in_row_groups)
    cache = RocketKVCache(compressing_config())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=8)
    assert groups == [2]  # 5 rows: 3 forwards of 2 (the fewest forwards, as even as they go)
    assert torch.equal(out, reference) and torch.equal(out, by_hand)
    assert cache.kept_tokens(0)[:, 0].tolist() == [24 + 7, 24 + 7, 20 + 7, 24 + 7, 24 + 7]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and lines[0].startswith(f"hf_rocketkv: prefill of 5 rows x {ids.shape[1]} tokens in 3 "
                                                   f"forwards of 2 rows: one forward of the whole batch needs ~")
    assert lines[0].endswith("allows 2 (RocketKVConfig.prefill_batch_size sets the rows)")


def test_a_batch_that_fits_is_one_forward_and_logs_nothing(llama_pair, monkeypatch, caplog):
    rocket, _ = llama_pair
    ids, mask = _batch()
    kept = _kept_per_row(rocket, compressing_config(), ids.shape[1], 8)
    monkeypatch.setattr(row_groups, "free_for_prefill", lambda device: _free_for(rocket, 5, ids.shape[1], kept, 5))
    cache = RocketKVCache(compressing_config())
    cache.hints.plan(max_length=ids.shape[1] + 8)  # what generate() tells the cache: 8 new tokens
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert row_groups.rows_per_forward(rocket, cache, ids, {"attention_mask": mask}) is None
    # one byte less and the whole batch no longer fits: 4 rows would, so 2 forwards of 3
    monkeypatch.setattr(row_groups, "free_for_prefill",
                        lambda device: _free_for(rocket, 5, ids.shape[1], kept, 5) - 2)
    assert row_groups.rows_per_forward(rocket, cache, ids, {"attention_mask": mask}) == 3
    assert not [r for r in caplog.records if r.name == LOGGER and "in one forward" in r.getMessage()]


def test_a_set_prefill_batch_size_wins_over_the_free_memory(llama_pair, monkeypatch):
    rocket, _ = llama_pair
    ids, mask = _batch()

    def unread(device):
        raise AssertionError("the free memory is not read when prefill_batch_size is set")

    monkeypatch.setattr(row_groups, "free_for_prefill", unread)
    cache = RocketKVCache(compressing_config(prefill_batch_size=3))
    assert row_groups.rows_per_forward(rocket, cache, ids, {"attention_mask": mask}) == 3
    cache = RocketKVCache(compressing_config(prefill_batch_size=5))
    assert row_groups.rows_per_forward(rocket, cache, ids, {"attention_mask": mask}) is None
    single = RocketKVCache(compressing_config())
    assert row_groups.rows_per_forward(rocket, single, ids[:1], {"attention_mask": mask[:1]}) is None


def test_a_pool_backed_cache_counts_no_kept_bytes_and_keeps_the_tokens(llama_pair, monkeypatch):
    rocket, _ = llama_pair
    ids, mask = _batch()
    pool = KVBlockPool(rocket, max_gpu_bytes=4 << 20, page_size=4, kt_dtype="bfloat16")
    reference = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                       cache=RocketKVCache(compressing_config(), pool=pool))
    seen = []
    real_plan = row_groups.plan_prefill_rows
    monkeypatch.setattr(row_groups, "plan_prefill_rows",
                        lambda shapes, batch, tokens, kept, free, device: seen.append(kept)
                        or real_plan(shapes, batch, tokens, kept, free, device))
    monkeypatch.setattr(row_groups, "free_for_prefill", lambda device: _free_for(rocket, 2, ids.shape[1], 0, 5))
    fresh = KVBlockPool(rocket, max_gpu_bytes=4 << 20, page_size=4, kt_dtype="bfloat16")
    out = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=RocketKVCache(compressing_config(),
                                                                                           pool=fresh))
    assert seen == [0]
    assert torch.equal(out, reference)


def test_an_input_that_cannot_be_split_keeps_the_whole_batch_and_warns(llama_pair, monkeypatch, caplog):
    rocket, _ = llama_pair
    ids, mask = _batch()
    monkeypatch.setattr(row_groups, "free_for_prefill", lambda device: 1)
    cache = RocketKVCache(compressing_config())
    kwargs = {"attention_mask": mask, "pixel_values": torch.zeros(5, 3, 4, 4)}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert row_groups.rows_per_forward(rocket, cache, ids, kwargs) is None
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.WARNING
    assert record.getMessage().endswith("but the generate() input 'pixel_values' cannot be split by rows, so the "
                                        "whole batch is prefilled in one forward")


def test_unknown_free_memory_keeps_the_whole_batch(llama_pair, monkeypatch):
    rocket, _ = llama_pair
    ids, mask = _batch()

    def unknown(device):
        raise ValueError("cannot tell the available RAM")

    monkeypatch.setattr(row_groups, "free_for_prefill", unknown)
    assert row_groups.rows_per_forward(rocket, RocketKVCache(compressing_config()), ids, {"attention_mask": mask}) \
        is None


def test_kept_bytes_count_the_budget_the_new_tokens_and_the_dense_layers(llama_pair):
    rocket, _ = llama_pair
    config = rocket.config
    shapes = PrefillShapes.of(config, 4)
    layer_kv = 2 * config.num_key_value_heads * config.head_dim * 4
    cache = RocketKVCache(compressing_config(dense_layers=1))
    cache.hints.plan(max_length=100 + 10)
    layers = config.num_hidden_layers
    assert row_groups.kept_bytes_per_row(cache, shapes, 100) == \
        layer_kv * ((layers - 1) * (24 + 10) * 5 // 4 + 1 * (100 + 10))
    cache = RocketKVCache(compressing_config(capacity_headroom=7))  # no max_length: the headroom
    assert row_groups.kept_bytes_per_row(cache, shapes, 10) == layer_kv * (layers * (10 + 7) * 5 // 4)


@pytest.mark.parametrize("device", ["cpu"])
def test_the_free_memory_off_cuda_is_the_available_ram(device, monkeypatch):
    from hf_rocketkv.memory import prefill_rows

    monkeypatch.setattr(prefill_rows, "host_available", lambda: 12345)
    assert prefill_rows.free_for_prefill(torch.device(device)) == 12345


def test_a_config_without_the_usual_sizes_keeps_the_whole_batch(llama_pair, monkeypatch):
    from types import SimpleNamespace

    rocket, _ = llama_pair
    ids, mask = _batch()
    monkeypatch.setattr(row_groups, "free_for_prefill", lambda device: 1)  # would split, could it estimate
    odd = SimpleNamespace(config=SimpleNamespace(hidden_size=64, num_hidden_layers=2), parameters=rocket.parameters)
    assert row_groups.rows_per_forward(odd, RocketKVCache(compressing_config()), ids, {"attention_mask": mask}) is None
    with pytest.raises(ValueError, match="names no integer num_attention_heads: the prefill's memory cannot be"):
        PrefillShapes.of(odd.config, 2)
