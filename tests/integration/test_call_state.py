"""CallState (integration/call_state.py): what a new prefill resets, and the padding memo that lets every layer of
one forward share its first layer's padding offsets."""

from __future__ import annotations

import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration import attention
from hf_rocketkv.integration.call_state import CallState, call_state
from tests.support.tiny_models import (
    compressing_config,
    greedy,
    left_pad,
    make_models,
    random_ids,
)


def test_begin_prefill_resets_the_guards_and_the_captured_step_and_keeps_the_rest():
    state = CallState()
    step = object()
    state.set_batch_padding((1, 2))
    state.set_guards_checked()
    state.keep_step(step)
    state.warmed_up()
    state.use_graphs_on(("cpu",), backend="stand-in")
    state.defer_stop_check_on(("cpu",))
    assert (state.guards_checked, state.graphed_step, state.graph_warmed_up) == (True, step, True)
    state.begin_prefill()
    assert state.guards_checked is False and state.graphed_step is None and state.graph_warmed_up is False
    # what the caller configured, and the padding generate() chose, outlive a new prefill
    assert state.batch_padding == (1, 2)
    assert (state.graph_devices, state.graph_backend, state.deferred_stop_devices) == (("cpu",), "stand-in", ("cpu",))


def test_a_new_generate_call_runs_every_guard_again_and_drops_the_captured_step():
    """generate()'s prefill calls begin_prefill: a cache whose previous call had checked its guards and kept a captured
    step starts the next call with neither (an eager call never sets them again)."""
    rocket, _ = make_models("llama", num_hidden_layers=1)
    cache = RocketKVCache(compressing_config())
    state = call_state(cache)
    state.set_guards_checked()
    state.keep_step(object())
    state.warmed_up()
    greedy(rocket, random_ids(1, 40), max_new_tokens=2, cache=cache, disable_compile=True)
    assert state.guards_checked is False and state.graphed_step is None and state.graph_warmed_up is False


def test_one_forward_reads_the_padding_once_and_remembers_it_for_its_later_layers(monkeypatch):
    """A left-padded prefill of 3 layers computes the padding offsets once (the first layer); the memo holds that
    forward's mask (weakly), its length, the offsets and their host copy."""
    rocket, _ = make_models("llama", num_hidden_layers=3)
    ids, mask = left_pad([random_ids(1, 40, seed=3)[0], random_ids(1, 33, seed=4)[0]])
    calls = []
    original = attention.padding_offsets

    def counting(attention_mask, kv_length):
        calls.append(kv_length)
        return original(attention_mask, kv_length)

    monkeypatch.setattr(attention, "padding_offsets", counting)
    cache = RocketKVCache(compressing_config())
    greedy(rocket, ids, attention_mask=mask, max_new_tokens=1, cache=cache, disable_compile=True)
    assert calls == [40]  # one prefill forward, three layers
    memo = call_state(cache).mask_memos["padding"]
    assert memo is not None and memo[1] == (40,)
    assert memo[2][0].tolist() == [0, 7] and memo[2][1] == [0, 7]
    # the memo is read only for the same mask object and length: another forward computes its own
    calls.clear()
    layer = cache.layers[0]
    fresh = (mask[:, None, None, :].bool() & torch.ones(40, 40, dtype=torch.bool).tril()).expand(2, 1, 40, 40)
    start, host = attention.padding_of_forward(layer, fresh, 40)
    assert calls == [40] and host == [0, 7] and torch.equal(start, memo[2][0])
    assert call_state(cache).mask_memos["padding"][0]() is fresh
    assert attention.padding_of_forward(layer, fresh, 40)[1] == [0, 7] and calls == [40]


def test_the_causal_memo_holds_the_forwards_mask_and_its_answer():
    """lower_right_causal compares a mask once per forward: the answer is remembered with a weak reference to the mask,
    and a later layer given the same mask object gets it without comparing again."""
    rocket, _ = make_models("llama", num_hidden_layers=1)
    cache = RocketKVCache(compressing_config())
    greedy(rocket, random_ids(1, 40), max_new_tokens=1, cache=cache, disable_compile=True)
    layer = cache.layers[0]
    causal = torch.ones(40, 40, dtype=torch.bool).tril().expand(2, 1, 40, 40)
    assert attention.lower_right_causal(layer, causal, [0, 0], 40, 40) is True
    memo = call_state(cache).mask_memos["causal"]
    assert memo[0]() is causal and memo[1:] == ((40, 40), True)
    full = torch.ones(2, 1, 40, 40, dtype=torch.bool)
    assert attention.lower_right_causal(layer, full, [0, 0], 40, 40) is False
    assert call_state(cache).mask_memos["causal"][0]() is full and call_state(cache).mask_memos["causal"][2] is False
