"""AdaKV's per-head budgets inside RocketKVLayer (``lengths`` ``[B, Hkv]``), checked against oracles that do not run
the layer: kept positions from the scores by hand (flattened top-k across the heads of a row), the stored K/V and KT
pages slot by slot, decode attention in float64 over each head's own tokens (every page, and the pages a float64
brute-force oracle picks per head), decode-time compression against the single-head path run head by head, crop and
beam reordering against snapshots, and the Triton backend (interpreter) against the PyTorch one.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hf_rocketkv import RocketKVConfig, RocketKVLayer
from hf_rocketkv.cache.layer import GenerationHints
from hf_rocketkv.policies import AdaKVPolicy, ScorerPolicy
from hf_rocketkv.policies.decode_compression import decode_keep_slots
from tests.policies import oracle
from tests.policies.helpers import Ragged
from tests.support.stage2_oracle import ref_page_scores, ref_sparse_attention

HKV, G, D = 2, 2, 8
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the Triton test: compiled on a GPU
pytestmark = pytest.mark.gpu  # the model and kernels run on the GPU where one is present (pytest -m gpu)
BUDGET, WINDOW = 10, 3


def first_channel(inputs):
    """Scores = each key's first channel (a scorer whose choice is easy to compute by hand)."""
    return inputs.keys[..., 0].float()


def adakv_config(**overrides) -> RocketKVConfig:
    kwargs = dict(prompt_budget=BUDGET, window_size=WINDOW, kernel_size=3, topk=1000, topr=D, page_size=2,
                  kt_cache_dtype="float32", backend="torch",
                  stage1=AdaKVPolicy(ScorerPolicy(first_channel, "first_channel")))
    kwargs.update(overrides)
    return RocketKVConfig(**kwargs)


def case(seed: int, batch: int = 2, slots: int = 30, dim: int = D) -> oracle.Case:
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, HKV * G, slots, dim, generator=g)
    keys = torch.randn(batch, HKV, slots, dim, generator=g)
    keys[:, 1, :, 0] -= 0.7  # head 1 scores lower on average: the heads keep clearly different counts
    start = [0] + [7 * b for b in range(1, batch)]
    return oracle.Case(queries, keys, start, [slots] * batch, WINDOW, BUDGET, None, dim**-0.5)


def prefilled(config: RocketKVConfig, c: oracle.Case, max_length: int = 60) -> RocketKVLayer:
    layer = RocketKVLayer(config, GenerationHints(max_length=max_length))
    values = c.keys * -0.5 + 0.25  # values distinct from the keys
    layer.update(c.keys, values)
    layer.observe_prefill(c.queries, torch.tensor(c.start, device=c.keys.device), c.scaling)
    layer.compress()
    return layer


def expected_positions(c: oracle.Case, b: int) -> list[list[int]]:
    """The oracle of AdaKV over the first-channel scores: every head keeps its window; the Hkv * (budget - w) best
    prefix slots of the row across both heads (no ties: random floats)."""
    s, e, w = c.start[b], c.end[b], WINDOW
    if e - s <= BUDGET:
        return [list(range(s, e))] * HKV
    flat = [(float(c.keys[b, h, j, 0]), h, j) for h in range(HKV) for j in range(s, e - w)]
    chosen = sorted(flat, reverse=True)[: HKV * (BUDGET - w)]
    return [sorted(j for _, hh, j in chosen if hh == h) + list(range(e - w, e)) for h in range(HKV)]


def held(layer, b: int, h: int) -> list[int]:
    return layer.positions[b, h, : int(layer.lengths[b, h])].tolist()


# ------------------------------------------------------------------------------------------------ stage 1
def test_per_head_counts_positions_pages_and_kt_equal_the_oracle():
    c = case(0)
    layer = prefilled(adakv_config(), c)
    assert layer.lengths.shape == (2, HKV) and layer.per_head_lengths
    values = c.keys * -0.5 + 0.25
    differ = False
    for b in range(2):
        want = expected_positions(c, b)
        assert sum(len(p) for p in want) == HKV * BUDGET
        differ |= len(want[0]) != len(want[1])
        for h in range(HKV):
            n = len(want[h])
            assert held(layer, b, h) == want[h]
            assert bool((layer.positions[b, h, n:] == -1).all())
            keys, vals, kt = layer.keys, layer.values, layer.kt
            assert torch.equal(keys[b, h, :n], c.keys[b, h, want[h]]) and torch.equal(vals[b, h, :n],
                                                                                       values[b, h, want[h]])
            assert not keys[b, h, n:].any() and not vals[b, h, n:].any()
            for page in range(kt.shape[2]):
                chunk = keys[b, h, page * 2 : min(page * 2 + 2, n)]
                if chunk.shape[0] == 0:
                    assert not kt[b, h, page].any()
                else:
                    assert torch.equal(kt[b, h, page, 0], chunk.min(0).values)
                    assert torch.equal(kt[b, h, page, 1], chunk.max(0).values)
    assert differ, "the case must give the heads different counts"
    assert layer.kept_tokens().tolist() == layer.lengths.tolist()
    assert layer.host_max_length == int(layer.lengths.max())


def test_undeclared_per_head_counts_are_refused_and_declared_ones_are_stored():
    c = case(1, slots=20)
    with pytest.raises(ValueError, match=r"'ragged' returned different kept counts .* per_head_budgets = True"):
        prefilled(adakv_config(stage1=Ragged()), c)

    class DeclaredRagged(Ragged):
        per_head_budgets = True

    layer = prefilled(adakv_config(stage1=DeclaredRagged()), c)
    assert layer.lengths.tolist() == [[BUDGET - 1, BUDGET]] * 2
    assert held(layer, 0, 0) == list(range(BUDGET - 1)) and held(layer, 1, 1) == list(range(BUDGET))


# ------------------------------------------------------------------------------------------------ decode
def per_head_attention(layer, q, scaling):
    """float64 attention of each query head over its KV head's stored tokens [0, lengths[b, h])."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(HKV):
            n = int(layer.lengths[b, h])
            k, v = layer.keys[b, h, :n].double(), layer.values[b, h, :n].double()
            for g in range(G):
                out[b, h, g] = torch.softmax(k @ q[b, h, g].double() * scaling, dim=0) @ v
    return out


@pytest.mark.parametrize("stage2", ["none", "kt_pages"])
def test_decode_attends_each_heads_own_tokens(stage2):
    """Every page read (stage2 none, or a topk above the pages): exact attention over each head's own tokens; the
    appended tokens land at slot lengths[b, h] of each head."""
    layer = prefilled(adakv_config(stage2=stage2), case(2))
    before = layer.lengths.clone()
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        k, v = torch.randn(2, HKV, 1, D, generator=g), torch.randn(2, HKV, 1, D, generator=g)
        layer.update(k, v)
        for b in range(2):
            for h in range(HKV):
                slot = int(before[b, h]) + step
                assert torch.equal(layer.keys[b, h, slot], k[b, h, 0]) and int(layer.positions[b, h, slot]) == 30 + step
        query = torch.randn(2, HKV * G, 1, D, generator=g)
        out = layer.attend_decode(query, D**-0.5)
        q = query.reshape(2, HKV, G, D)
        torch.testing.assert_close(out.transpose(1, 2).reshape(q.shape).double(), per_head_attention(layer, q, D**-0.5),
                                   rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.lengths, before + 4)


def brute_force_pages_per_head(q, kt, lengths, page_size, topr, topk):
    """Stage 2's choice per (row, KV head) with that head's own page count: float64 scores by loops, the newest page
    plus the best-scoring others."""
    batch = q.shape[0]
    k = min(topk, kt.shape[2])
    page_idx = torch.zeros(batch, HKV, k, dtype=torch.long)
    valid = torch.zeros(batch, HKV, k, dtype=torch.bool)
    for h in range(HKV):
        n_pages = [-(-int(n) // page_size) for n in lengths[:, h]]
        probs = ref_page_scores(q[:, h : h + 1], kt[:, h : h + 1], torch.tensor(n_pages), topr)
        for b in range(batch):
            newest = n_pages[b] - 1
            others = sorted(range(newest), key=lambda j: (-probs[b, 0, j].item(), j))
            chosen = ([newest] + others)[: min(k, n_pages[b])]
            page_idx[b, h, : len(chosen)] = torch.tensor(chosen)
            valid[b, h, : len(chosen)] = True
    return page_idx, valid


def test_sparse_decode_picks_the_oracle_pages_of_each_head():
    layer = prefilled(adakv_config(topk=2, topr=4), case(3))
    layer.update(torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))
    query = torch.randn(2, HKV * G, 1, D, generator=torch.Generator().manual_seed(9))
    out = layer.attend_decode(query, D**-0.5)
    q = query.reshape(2, HKV, G, D)
    page_idx, valid = brute_force_pages_per_head(q, layer.kt, layer.lengths, 2, 4, 2)
    assert bool((valid.sum(-1) == 2).all())
    want = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(HKV):  # ref_sparse_attention takes one length per row: run it head by head
        want[:, h : h + 1] = ref_sparse_attention(q[:, h : h + 1], layer.keys[:, h : h + 1], layer.values[:, h : h + 1],
                                                  page_idx[:, h : h + 1], valid[:, h : h + 1], layer.lengths[:, h], 2,
                                                  D**-0.5)
    torch.testing.assert_close(out.transpose(1, 2).reshape(q.shape).double(), want, rtol=1e-5, atol=1e-5)


def test_crop_and_beam_reorder_with_per_head_lengths():
    layer = prefilled(adakv_config(), case(4))
    layer.update(torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))
    snapshot = (layer.lengths.clone(), layer.positions.clone(), layer.keys.clone(), layer.kt.clone())
    layer.update(torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))
    layer.crop(-1)
    for got, want in zip((layer.lengths, layer.positions, layer.keys, layer.kt), snapshot):
        assert torch.equal(got, want)
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.lengths, snapshot[0].flip(0)) and torch.equal(layer.keys, snapshot[2].flip(0))
    assert torch.equal(layer.positions, snapshot[1].flip(0))


def test_decode_compression_with_per_head_lengths_equals_each_head_alone():
    """decode_keep_slots with [B, Hkv] lengths / gen_start: for every KV head, what the one-length-per-row path
    chooses for that head alone (its query group, its keys, its lengths)."""
    g = torch.Generator().manual_seed(11)
    batch, capacity, w, budget = 2, 40, 3, 6
    keys = torch.randn(batch, HKV, capacity, D, generator=g)
    queries = torch.randn(batch, HKV * G, w, D, generator=g)
    gen_start = torch.tensor([[10, 14], [7, 9]])
    lengths = gen_start + torch.tensor([[12], [5]])  # row 0 over the budget, row 1 not; same count per head
    slots, new_lengths = decode_keep_slots(queries, keys, lengths, gen_start, budget, D**-0.5, kernel_size=3)
    assert new_lengths.shape == (batch, HKV)
    for h in range(HKV):
        alone, alone_lengths = decode_keep_slots(queries[:, h * G : (h + 1) * G], keys[:, h : h + 1], lengths[:, h],
                                                 gen_start[:, h], budget, D**-0.5, kernel_size=3)
        assert torch.equal(slots[:, h], alone[:, 0]) and torch.equal(new_lengths[:, h], alone_lengths)
    assert new_lengths.tolist() == [[16, 20], [12, 14]]


def test_decode_compression_in_the_layer_keeps_each_heads_prompt():
    config = adakv_config(decode_budget=4, decode_interval=3, decode_window=2, decode_kernel_size=1)
    layer = prefilled(config, case(6))
    prompt = [[held(layer, b, h) for h in range(HKV)] for b in range(2)]
    counts = layer.lengths.clone()
    for step in range(12):
        layer.update(torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))
        layer.attend_decode(torch.randn(2, HKV * G, 1, D), D**-0.5)
        generated = layer.lengths - counts
        assert bool((generated == generated[0, 0]).all()) and int(generated[0, 0]) <= 4 + 3
        for b in range(2):
            for h in range(HKV):
                positions = held(layer, b, h)
                assert positions[: int(counts[b, h])] == prompt[b][h]
                assert positions == sorted(positions) and positions[-1] == 30 + step
    assert int((layer.lengths - counts)[0, 0]) < 12  # compressed at least once


# ------------------------------------------------------------------------------------------------ Triton
def test_triton_backend_equals_torch_backend():
    """On the GPU when there is one (compiled kernels: head_dim 16, the smallest the kernels take there), else under
    the interpreter."""
    dim = 16
    c = case(7, dim=dim)
    c = dataclasses.replace(c, queries=c.queries.to(DEVICE), keys=c.keys.to(DEVICE))
    layers = [prefilled(adakv_config(backend=backend, topk=2, topr=8, kt_cache_dtype="bfloat16"), c)
              for backend in ("torch", "triton")]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        k, v, query = (torch.randn(2, HKV, 1, dim, generator=g).to(DEVICE),
                       torch.randn(2, HKV, 1, dim, generator=g).to(DEVICE),
                       torch.randn(2, HKV * G, 1, dim, generator=g).to(DEVICE))
        outs = []
        for layer in layers:
            layer.update(k, v)
            outs.append(layer.attend_decode(query, dim**-0.5))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch_layer, triton_layer = layers
    for name in ("lengths", "positions", "keys", "values", "kt"):
        assert torch.equal(getattr(triton_layer, name), getattr(torch_layer, name)), name
    assert math.isclose(float(triton_layer.lengths.float().sum()), float(torch_layer.lengths.float().sum()))
