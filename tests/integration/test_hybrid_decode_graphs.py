"""Decode steps of models with sliding-window layers, soft-capping and sinks captured as graphs
(integration/decode_graphs.py), on CPU with the stand-in for torch.cuda graphs (tests/support/decode_runners.py:
a replay re-runs the step on the same static buffers with the host bookkeeping off).

Oracles: transformers' eager attention with its own cache where every page is read (keep-all), and RocketKV's own
eager decode where prompts are compressed; the sliding layers' rings and the layers' counters must match too.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from hf_rocketkv import RocketKVCache, SlidingWindowLayer
from tests.support.markers import slow_except
from tests.cache.test_host_syncs import HostReads
from tests.support.decode_runners import (
    StandInBackend,
    eager_compile_config,
    graphed_cache,
)
from tests.support.hybrid_models import HYBRID_ARCHS, WINDOW, make_hybrid_models
from tests.support.tiny_models import (
    compressing_config,
    greedy,
    keep_all_config,
    left_pad,
    random_ids,
)


@pytest.fixture(scope="module", params=list(HYBRID_ARCHS))
def pair(request):
    return request.param, *make_hybrid_models(request.param)


def _graphed(rocket, ids, config, new, **kwargs):
    backend = StandInBackend()
    cache = graphed_cache(config, backend)
    out = greedy(rocket, ids, cache=cache, max_new_tokens=new, compile_config=eager_compile_config(),
                 **kwargs)
    return out, cache, backend


@pytest.mark.parametrize("length", [5, 40])  # shorter than the window (its ring fills while decoding), longer
def test_graphed_keep_all_decode_equals_the_oracle(pair, length):
    _, rocket, oracle = pair
    ids = random_ids(1, length, seed=length)
    dynamo_utils.counters.clear()
    out, cache, backend = _graphed(rocket, ids, keep_all_config(), 14)
    assert torch.equal(out, greedy(oracle, ids, max_new_tokens=14))
    assert backend.captures == 1 and backend.replays == 12  # 13 decode steps: 1 warm-up, 1 capture + replay, 11
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 0  # nothing compiled
    for layer in cache.layers:
        assert layer.get_seq_length() == length + 13 and layer.host_seen == length + 13


def test_graphed_compressed_padded_batch_equals_eager(pair):
    _, rocket, _ = pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (46, 29, 6)])
    config = compressing_config(kt_cache_dtype="float32")
    eager_cache = RocketKVCache(config)
    eager = greedy(rocket, ids, attention_mask=mask, cache=eager_cache, max_new_tokens=12,
                   disable_compile=True)
    out, cache, backend = _graphed(rocket, ids, config, 12, attention_mask=mask)
    assert torch.equal(out, eager)
    assert backend.captures == 1
    for graphed_layer, eager_layer in zip(cache.layers, eager_cache.layers):
        assert graphed_layer.get_seq_length() == eager_layer.get_seq_length()
        if isinstance(graphed_layer, SlidingWindowLayer):
            assert graphed_layer.ring and int(graphed_layer.position) == graphed_layer.seen_tokens
            assert torch.equal(graphed_layer.keys, eager_layer.keys)
        else:
            assert torch.equal(graphed_layer.lengths, eager_layer.lengths)
    # chunked prefill, then graphed decode
    chunked = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(config), max_new_tokens=12,
                     disable_compile=True, prefill_chunk_size=10)
    out, _, backend = _graphed(rocket, ids, config, 12, attention_mask=mask, prefill_chunk_size=10)
    assert torch.equal(out, chunked) and backend.captures == 1


def test_a_later_turn_after_graphed_decode_equals_the_oracle():
    """The ring turns back into ordered columns for a later turn's prompt; the next turn captures again."""
    rocket, oracle = make_hybrid_models("gpt_oss")
    backend = StandInBackend()
    cache = graphed_cache(keep_all_config(), backend)
    first = greedy(rocket, random_ids(1, 20, seed=1), cache=cache, max_new_tokens=9,
                   compile_config=eager_compile_config())
    ids = torch.cat([first, random_ids(1, WINDOW + 3, seed=2)], 1)
    second = greedy(rocket, ids, cache=cache, max_new_tokens=9, compile_config=eager_compile_config())
    assert torch.equal(second, greedy(oracle, ids, max_new_tokens=9))
    assert backend.captures == 2


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3"])
def test_beam_search_with_the_graph_runner_equals_the_oracle(arch):
    """Beam search reorders the rows between decode steps (in place on the ring); generate() runs its steps
    eagerly, graph runner or not."""
    rocket, oracle = make_hybrid_models(arch)
    ids = random_ids(1, 30, seed=7)
    kwargs = {"num_beams": 2, "max_new_tokens": 10}
    backend = StandInBackend()
    beams = greedy(rocket, ids, cache=graphed_cache(keep_all_config(), backend),
                   compile_config=eager_compile_config(), **kwargs)
    assert torch.equal(beams, greedy(oracle, ids, **kwargs))


class SyncCountingBackend(StandInBackend):
    """The stand-in, counting the host reads of the device (``tests/cache/test_host_syncs.HostReads``) while a
    captured step replays: a real CUDA graph can hold none of them."""

    def __init__(self):
        super().__init__()
        self.reads = HostReads()

    def replay(self, graph):
        with self.reads:
            super().replay(graph)


@pytest.mark.parametrize("arch", slow_except(list(HYBRID_ARCHS), keep=["gemma3"]))  # the others: 10-19 s each
def test_a_replayed_hybrid_step_reads_nothing_back_from_the_device(arch):
    """Sliding rings, soft-capping and sinks included: every op of a replayed decode step stays on the device. The
    Triton backend (interpreted here), as on a GPU: the PyTorch twin of the append checks its slots on the host
    where it may (``append_token._can_sync``: never while a CUDA graph is captured)."""
    rocket, _ = make_hybrid_models(arch)
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (37, 12)])
    backend = SyncCountingBackend()
    cache = graphed_cache(compressing_config(kt_cache_dtype="float32", backend="triton"), backend)
    greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=8,
           compile_config=eager_compile_config())
    assert backend.replays == 6
    assert backend.reads.total == 0, dict(backend.reads.counts)
