"""The keep_all history (cache/history.py; RocketKVConfig(multi_turn="keep_all"), RocketKV-MT): the whole
conversation stays in pages and every later turn re-runs stage 1 over all of it, so tokens an earlier turn evicted
can come back.

Oracle of a later turn: a cold run of the concatenated conversation with the same config. They agree exactly when
every token of the history was computed by a prefill (turn 1 generates one token, which is fed back only in turn 2)
and the new turn has at least ``window_size`` tokens (stage 1's window is that turn's queries).
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache
from tests.cache.helpers import kept
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, left_pad, random_ids

CFG = compressing_config(kt_cache_dtype="float32")  # budget 24, window 8
KEEP_ALL = CFG.replace(multi_turn="keep_all")


def two_turns(model, cfg, pool=None, first_new=1, prompt=None, extra=None):
    cache = RocketKVCache(cfg, pool=pool)
    prompt = prompt if prompt is not None else random_ids(1, 60, seed=3)
    out = greedy(model, prompt, max_new_tokens=first_new, cache=cache)
    turn1 = kept(cache)
    conversation = torch.cat([out, extra if extra is not None else random_ids(1, 12, seed=4)], dim=1)
    out2 = greedy(model, conversation, max_new_tokens=5, cache=cache)
    return cache, turn1, conversation, out2


@pytest.mark.parametrize("with_pool", [False, True])
def test_evicted_tokens_come_back_and_turn_two_equals_a_cold_run(model, with_pool):
    pool = cpu_pool(model.config, KEEP_ALL) if with_pool else None
    cache, turn1, conversation, out2 = two_turns(model, KEEP_ALL, pool)
    prompt_len = 60
    turn2 = kept(cache)
    came_back = 0
    for layer1, layer2 in zip(turn1, turn2):
        for heads1, heads2 in zip(layer1[0], layer2[0]):
            evicted = set(range(prompt_len)) - set(heads1)
            came_back += len(evicted & set(heads2))
    assert came_back > 0  # positions turn 1 dropped are attended again in turn 2

    cold = RocketKVCache(KEEP_ALL)
    want = greedy(model, conversation, max_new_tokens=5, cache=cold)
    assert torch.equal(out2, want)
    assert turn2 == kept(cold)
    if pool is not None:
        cache.close()
        assert pool.free_pages() == pool.total_pages()


def test_evict_mode_never_brings_tokens_back(model):
    cache, turn1, conversation, _ = two_turns(model, CFG)
    for layer1, layer2 in zip(turn1, kept(cache)):
        for heads1, heads2 in zip(layer1[0], layer2[0]):
            assert set(heads2) <= set(heads1) | set(range(60, conversation.shape[1] + 5))  # + turn 2's decode


@pytest.mark.parametrize("with_pool", [False, True])
def test_history_holds_every_fed_token_through_decode_and_turns(model, with_pool):
    """Padded batch, several decode steps, two later turns: the history of every layer holds each row's real tokens
    (prompt, fed-back generated tokens, later turns) with their input columns; pool == private tokens."""
    pool = cpu_pool(model.config, KEEP_ALL) if with_pool else None
    ids, mask = left_pad([random_ids(1, 50, seed=5)[0], random_ids(1, 33, seed=6)[0]])
    cache = RocketKVCache(KEEP_ALL, pool=pool)
    private = RocketKVCache(KEEP_ALL)
    outs = []
    for c in (cache, private):
        out = greedy(model, ids, attention_mask=mask, max_new_tokens=4, cache=c)
        pads = (mask == 0).sum(1).tolist()
        for layer in c.layers:
            history = layer.history
            assert history.lengths.tolist() == [50 - pads[0] + 3 + pads[0], 33 + 3]
            for b, pad in enumerate(pads):
                n = int(history.lengths[b])
                assert history.positions[b, 0, :n].tolist() == list(range(pad, pad + n))
                assert torch.all(history.positions[b, :, n:] == -1)
        new = random_ids(2, 10, seed=7)
        conversation = torch.cat([out, new], dim=1)
        full_mask = torch.cat([mask, torch.ones(2, out.shape[1] - mask.shape[1] + 10, dtype=mask.dtype)], dim=1)
        outs.append(greedy(model, conversation, attention_mask=full_mask, max_new_tokens=3, cache=c))
        for layer in c.layers:
            assert layer.history.lengths.tolist() == [50 + 4 + 10 + 2, 33 + 4 + 10 + 2]
    assert torch.equal(outs[0], outs[1])
    assert kept(cache) == kept(private)
    if pool is not None:
        cache.close()
        assert pool.free_pages() == pool.total_pages()


def test_keep_all_with_row_groups_and_pool(model):
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (44, 60, 35)])
    cfg = KEEP_ALL.replace(prefill_batch_size=2)
    want = greedy(model, ids, attention_mask=mask, max_new_tokens=4, cache=RocketKVCache(cfg))
    pool = cpu_pool(model.config, cfg)
    cache = RocketKVCache(cfg, pool=pool)
    got = greedy(model, ids, attention_mask=mask, max_new_tokens=4, cache=cache)
    assert torch.equal(got, want)
    assert [layer.history.lengths.tolist() for layer in cache.layers] == [[44 + 3, 60 + 3, 35 + 3]] * 2
    cache.close()
    assert pool.free_pages() == pool.total_pages()


@pytest.mark.parametrize("with_pool", [False, True])
def test_keep_all_beam_search(model, with_pool):
    ids = random_ids(1, 50, seed=8)
    kwargs = dict(num_beams=3, num_return_sequences=1, max_new_tokens=5, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    want = model.generate(ids, cache=RocketKVCache(CFG), **kwargs)
    pool = cpu_pool(model.config, KEEP_ALL) if with_pool else None
    cache = RocketKVCache(KEEP_ALL, pool=pool)
    got = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got, want)  # within one turn keep_all decodes exactly like evict mode
    if pool is not None:
        cache.close()
        assert pool.free_pages() == pool.total_pages()
