"""Left-padded rows SHORTER than the sliding window (every hybrid kind: Gemma 2, Gemma 3, Cohere 2, gpt-oss with
sinks, Mistral with a window, Llama 4's chunked layers), through ``model.generate()`` with and without a
``KVBlockPool``: greedy fp32 tokens on tiny random models.

Why these prompts: the padding sits at positions ``0 .. pad - 1`` and stays inside a sliding layer's window until the
decode position passes ``pad + window - 1``, while the decode ring (``window`` slots, position ``p`` in slot
``p % window``) has wrapped from position ``window`` on. Between the two, a decode query's mask over the ring must hide
exactly the padding slots: a mask shifted by one slot shows it a padding token and hides a real one. Prompts longer
than the window (the other padded-batch tests) have left the padding behind by decode time, so no mask error shows.

Oracle: each row ALONE, unpadded, through transformers' own attention and cache (eager, ``DynamicCache`` with
``DynamicSlidingWindowLayer``): nothing of hf_rocketkv computes the expected tokens. Llama 4 is the exception:
transformers counts its chunks from the batch's first column, so a padded row's chunk boundaries move with its
padding and the row alone is another computation (the 1-token row's tokens differ from step 12 on); its oracle is
the same padded batch through transformers' own attention and cache. The budget is above every prompt and every page
is attended (``keep_all_config``), so RocketKV must equal dense attention.

The batching engine's rows (no padding: a batch row's ring reads the slots each row has filled) are covered by
tests/serving/test_hybrid_short_prompts.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import masking_utils

from hf_rocketkv import RocketKVCache
from tests.support.hybrid_models import HYBRID_ARCHS, WINDOW, make_hybrid_models, make_llama4_models
from tests.support.tiny_models import cpu_pool, greedy, keep_all_config, left_pad, random_ids

LENGTHS = (7, 2, 5, 1)  # every prompt shorter than the window (8): pads of 0, 5, 2 and 6 tokens
NEW = 14  # decode positions 7 .. 20: the ring wraps at 8 while padding is still in the window (up to position 13)

# transformers 5.17's generate() passes block_sequence_ids to create_chunked_causal_mask, which does not take it
LLAMA4_GENERATE_BROKEN = "block_sequence_ids" not in inspect.signature(
    masking_utils.create_chunked_causal_mask).parameters

KINDS = [*HYBRID_ARCHS, pytest.param("llama4", marks=pytest.mark.skipif(
    LLAMA4_GENERATE_BROKEN, reason="this transformers' generate() cannot run Llama 4"))]
POOLED_KINDS = list(HYBRID_ARCHS)  # Llama 4's chunked layers take no pool (refused: tests/integration/test_chunked_models.py)


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    """``(name, rocket, oracle, rows, expected)``: the models, the short prompts and each row's oracle tokens (alone;
    Llama 4: in the padded batch, module docstring)."""
    name = request.param
    rocket, oracle = make_llama4_models() if name == "llama4" else make_hybrid_models(name)
    rows = [random_ids(1, n, seed=40 + n)[0] for n in LENGTHS]
    if name == "llama4":
        ids, mask = left_pad(rows)
        padded = greedy(oracle, ids, attention_mask=mask, max_new_tokens=NEW)
        return name, rocket, oracle, rows, [padded[i, ids.shape[1]:] for i in range(len(rows))]
    alone = [greedy(oracle, row[None], max_new_tokens=NEW)[0, len(row):] for row in rows]
    return name, rocket, oracle, rows, alone


def assert_rows_alone(name, out, width, alone):
    for i, expected in enumerate(alone):
        assert torch.equal(out[i, width:], expected), f"{name}: row {i} ({LENGTHS[i]} tokens, {width - LENGTHS[i]} pad)"


def test_the_prompts_leave_padding_inside_the_window_after_the_ring_wraps():
    """The case the tests are for, by arithmetic: some decode step writes at a position >= window (the ring has
    wrapped) while the longest padding (positions ``0 .. pad - 1``) still reaches into that step's window."""
    width = max(LENGTHS)
    pad = width - min(LENGTHS)
    decode_positions = range(width, width + NEW - 1)  # the last sampled token is never written
    assert width < WINDOW
    assert any(p >= WINDOW and p - WINDOW + 1 <= pad - 1 for p in decode_positions)


def test_padded_rows_shorter_than_the_window_equal_the_oracle(kind):
    name, rocket, _, rows, alone = kind
    ids, mask = left_pad(rows)
    out = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(keep_all_config()),
                 max_new_tokens=NEW)
    assert_rows_alone(name, out, ids.shape[1], alone)


@pytest.mark.parametrize("chunk", [1, 3])
def test_chunked_prefill_of_short_padded_rows_equals_the_oracle(kind, chunk):
    """Chunks of 3, and of 1: the first chunk is one token on empty layers, whose mask transformers sizes before the
    cache has any layer (one column), so it is a prefill, not a decode step over the ring."""
    name, rocket, _, rows, alone = kind
    ids, mask = left_pad(rows)
    out = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(keep_all_config()),
                 max_new_tokens=NEW, prefill_chunk_size=chunk)
    assert_rows_alone(name, out, ids.shape[1], alone)


@pytest.mark.parametrize("chunk", [None, 1])
def test_short_padded_rows_on_a_pool_equal_the_oracle_and_give_everything_back(kind, chunk):
    """The pooled sliding layer (its ring in the pool's slab, one slot per row), one prefill forward or chunks of 1."""
    name, rocket, _, rows, alone = kind
    if name not in POOLED_KINDS:
        pytest.skip("chunked-attention layers take no pool")
    config = keep_all_config()
    pool = cpu_pool(rocket, config, 2 << 20, 8)
    ids, mask = left_pad(rows)
    cache = RocketKVCache(config, pool=pool)
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, prefill_chunk_size=chunk)
    assert_rows_alone(name, out, ids.shape[1], alone)
    cache.close()
    assert pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()
