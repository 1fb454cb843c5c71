"""Decode-time compression wired into the cache (cache/generated_tokens.py, RocketKVConfig.decode_budget;
docs/policies.md).

The oracle is a float64 re-implementation written from the definition: it keeps the full history of every key,
value and decode query, and at each compression re-scores the generated tokens it holds with the last ``window``
decode queries (softmax over everything it holds, causal inside the window, summed over the window and the query
group), keeping the newest ``window`` and the best ``budget - window`` others. The cache is driven directly through
the ``rocketkv`` attention function with random queries, keys and values, so the oracle sees exactly the same inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.cache.generated_tokens import decode_compression
from hf_rocketkv.cli import apply_overrides
from hf_rocketkv.integration.attention import rocketkv_attention
from tests.support.decode_runners import StandInBackend, eager_compile_config, graphed_cache
from tests.support.tiny_models import compressing_config, greedy, left_pad, make_models, random_ids


class FakeAttention(torch.nn.Module):
    """What rocketkv_attention reads of an attention module."""

    layer_idx = 0
    is_causal = True


class Oracle:
    """Float64 decode-time compression of one row, from the definition (kernel_size 1: no pooling)."""

    def __init__(self, prompt_kept: list[list[int]], budget: int, interval: int, window: int, group: int,
                 scaling: float):
        self.prompt = prompt_kept  # per KV head: positions stage 1 kept (not under test here)
        self.generated = [[] for _ in prompt_kept]  # per KV head: positions of the kept generated tokens
        self.budget, self.interval, self.window, self.group, self.scaling = budget, interval, window, group, scaling
        self.keys: dict[int, torch.Tensor] = {}  # position -> [Hkv, D]
        self.values: dict[int, torch.Tensor] = {}
        self.queries: list[torch.Tensor] = []  # decode queries [Hq, D], oldest first

    def held(self, h: int) -> list[int]:
        return self.prompt[h] + self.generated[h]

    def step(self, position: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """One decode token: compress first when due, then store it."""
        if len(self.generated[0]) >= self.budget + self.interval:
            self.generated = [self.compress(h) for h in range(len(self.prompt))]
        self.keys[position], self.values[position] = key.double(), value.double()
        self.queries.append(query.double())
        for kept in self.generated:
            kept.append(position)

    def compress(self, h: int) -> list[int]:
        held = self.held(h)
        w, length = self.window, len(held)
        scores = [0.0] * length
        for i, query in enumerate(self.queries[-w:]):
            visible = held[: length - w + i + 1]
            for qh in range(h * self.group, (h + 1) * self.group):
                logits = [float(query[qh] @ self.keys[p][h]) * self.scaling for p in visible]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for j, weight in enumerate(weights):
                    scores[j] += weight / total
        first = len(self.prompt[h])
        candidates = list(range(first, length - w))
        best = sorted(candidates, key=lambda j: -scores[j])[: self.budget - w]
        return [held[j] for j in sorted(best)] + held[length - w :]

    def attention(self, h_q: int, query: torch.Tensor) -> torch.Tensor:
        """Exact attention of one query head over every token the oracle holds: [D]."""
        h = h_q // self.group
        held = self.held(h)
        keys = torch.stack([self.keys[p][h] for p in held])
        values = torch.stack([self.values[p][h] for p in held])
        probs = torch.softmax(keys @ query.double() * self.scaling, dim=0)
        return probs @ values


def _drive(config: RocketKVConfig, prompt: int, steps: int, batch: int = 2, kv_heads: int = 2, group: int = 2,
           dim: int = 8, seed: int = 0):
    """Prefill ``prompt`` random tokens, then ``steps`` decode steps; yields (cache, oracles, outputs, step)."""
    g = torch.Generator().manual_seed(seed)
    scaling = dim ** -0.5
    module = FakeAttention()
    module.num_key_value_groups = group
    cache = RocketKVCache(config)
    k0 = torch.randn(batch, kv_heads, prompt, dim, generator=g)
    v0 = torch.randn(batch, kv_heads, prompt, dim, generator=g)
    q0 = torch.randn(batch, kv_heads * group, prompt, dim, generator=g)
    k, v = cache.update(k0, v0, 0)
    rocketkv_attention(module, q0, k, v, None, scaling=scaling)
    layer = cache.layers[0]
    oracles = []
    for b in range(batch):
        kept = [layer.positions[b, h, : int(layer.lengths[b])].tolist() for h in range(kv_heads)]
        oracle = Oracle(kept, config.decode_budget, config.decode_interval, config.decode_window, group, scaling)
        for p in range(prompt):
            oracle.keys[p], oracle.values[p] = k0[b, :, p].double(), v0[b, :, p].double()
        oracles.append(oracle)
    for t in range(steps):
        kt_ = torch.randn(batch, kv_heads, 1, dim, generator=g) * 2
        vt = torch.randn(batch, kv_heads, 1, dim, generator=g)
        qt = torch.randn(batch, kv_heads * group, 1, dim, generator=g) * 2
        for b, oracle in enumerate(oracles):
            oracle.step(prompt + t, qt[b, :, 0], kt_[b, :, 0], vt[b, :, 0])
        k, v = cache.update(kt_, vt, 0)
        out, _ = rocketkv_attention(module, qt, k, v, None, scaling=scaling)
        yield cache, oracles, out, qt, t


def _config(stage2: str = "none", **overrides) -> RocketKVConfig:
    kwargs = dict(prompt_budget=12, window_size=4, kernel_size=3, topk=4096, topr=8, page_size=4,
                  kt_cache_dtype="float32", backend="torch", stage2=stage2, decode_budget=10, decode_interval=6,
                  decode_window=4, decode_kernel_size=1)
    kwargs.update(overrides)
    return RocketKVConfig(**kwargs)


@pytest.mark.parametrize("stage2", ["none", "kt_pages"])
def test_kept_generated_tokens_and_attention_equal_the_float64_oracle(stage2):
    """After every step (over 4 compressions), each row and KV head holds exactly the oracle's tokens (positions,
    keys, values, in ascending order), the KT pages are the min/max of the kept keys, and the decode output is the
    exact attention over the oracle's tokens (every page is read: stage2 "none", or a topk above the page count)."""
    config = _config(stage2)
    compressions = 0
    for cache, oracles, out, query, t in _drive(config, prompt=20, steps=40):
        layer = cache.layers[0]
        compressions += t > 0 and layer.host_decoded == 1  # reset by a compression just before this token
        keys, values, kt = layer.keys, layer.values, layer.kt
        for b, oracle in enumerate(oracles):
            n = int(layer.lengths[b])
            for h in range(layer.num_kv_heads):
                held = oracle.held(h)
                assert layer.positions[b, h, :n].tolist() == held, (t, b, h)
                want_k = torch.stack([oracle.keys[p][h] for p in held]).float()
                want_v = torch.stack([oracle.values[p][h] for p in held]).float()
                assert torch.equal(keys[b, h, :n], want_k) and torch.equal(values[b, h, :n], want_v)
                assert bool((layer.positions[b, h, n:] == -1).all())
                for page in range(math.ceil(n / config.page_size)):
                    chunk = want_k[page * config.page_size : (page + 1) * config.page_size]
                    assert torch.equal(kt[b, h, page, 0], chunk.min(0).values)
                    assert torch.equal(kt[b, h, page, 1], chunk.max(0).values)
            for hq in range(query.shape[1]):
                want = oracle.attention(hq, query[b, hq, 0])
                torch.testing.assert_close(out[b, 0, hq].double(), want, rtol=1e-5, atol=1e-5)
    assert compressions == 4  # due at 16 generated tokens: steps 16, 22, 28, 34


def test_memory_stays_bounded_over_three_intervals():
    """Capacity is prompt_budget + decode_budget + decode_interval from the start; stored tokens never exceed it and
    the bytes held never change, over more than 3x the interval."""
    config = _config("kt_pages", topk=3)
    seen_bytes, lengths = set(), []
    for cache, _, _, _, t in _drive(config, prompt=30, steps=3 * config.decode_interval + 20):
        layer = cache.layers[0]
        assert layer.capacity == config.prompt_budget + config.decode_budget + config.decode_interval
        assert int(layer.lengths.max()) <= layer.capacity and layer.host_max_length == int(layer.lengths.max())
        seen_bytes.add(cache.memory_bytes())
        lengths.append(int(layer.lengths[0]))
    assert len(seen_bytes) == 1
    assert max(lengths) == config.prompt_budget + config.decode_budget + config.decode_interval
    assert lengths[-1] < lengths[-2] or lengths.count(config.prompt_budget + config.decode_budget + 1) >= 3


def test_capacity_is_independent_of_max_new_tokens():
    rocket, _ = make_models("llama")
    config = compressing_config(decode_budget=16, decode_interval=8, decode_window=4)
    ids = random_ids(1, 40)
    sizes = []
    for new in (30, 200):
        cache = RocketKVCache(config)
        greedy(rocket, ids, cache=cache, max_new_tokens=new)
        sizes.append((cache.layers[0].capacity, cache.memory_bytes()))
        assert int(cache.layers[0].lengths.max()) <= 24 + 16 + 8
    assert sizes[0] == sizes[1] and sizes[0][0] == 24 + 16 + 8


@pytest.mark.parametrize("decode_budget", [1000, 40])
def test_a_budget_never_reached_gives_the_uncompressed_tokens(decode_budget):
    """A huge decode budget (or one whose first compression lies past the last step) changes nothing."""
    rocket, _ = make_models("llama")
    ids, mask = left_pad([random_ids(1, 50, seed=1)[0], random_ids(1, 33, seed=2)[0]])
    plain = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(compressing_config()),
                   max_new_tokens=45)
    config = compressing_config(decode_budget=decode_budget, decode_interval=8, decode_window=8)
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=45)
    assert torch.equal(out, plain)
    assert cache.layers[0].generated.host_generated == 44


def test_compression_actually_evicts_in_generate():
    rocket, _ = make_models("llama")
    config = compressing_config(decode_budget=8, decode_interval=4, decode_window=4)
    cache = RocketKVCache(config)
    greedy(rocket, random_ids(1, 40), cache=cache, max_new_tokens=30)
    for layer in cache.layers:
        generated = layer.positions[0, :, int(layer.generated.gen_start[0]) : int(layer.lengths[0])]
        assert generated.shape[1] <= 12 and bool((generated[:, -4:] == torch.arange(65, 69)).all())


@pytest.mark.parametrize("runner", ["cuda_graphs", "torch_compile"])
def test_graphed_and_compiled_runners_equal_eager(runner):
    """The compaction runs between two graphed / compiled steps (count_decode_step); the step itself only records
    its query. Tokens and the whole cache state equal the eager run."""
    rocket, _ = make_models("llama", num_hidden_layers=1 if runner == "torch_compile" else 2)
    config = compressing_config(decode_budget=8, decode_interval=4, decode_window=4, kt_cache_dtype="float32",
                                decode_runner=runner)
    ids, mask = left_pad([random_ids(1, 40, seed=1)[0], random_ids(1, 31, seed=2)[0]])
    eager_cache = RocketKVCache(config)
    eager = greedy(rocket, ids, attention_mask=mask, cache=eager_cache, max_new_tokens=24,
                   disable_compile=True)
    backend = StandInBackend()
    cache = graphed_cache(config, backend)
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=24,
                 compile_config=eager_compile_config())
    assert torch.equal(out, eager)
    assert backend.captures == (1 if runner == "cuda_graphs" else 0)
    for la, lb in zip(cache.layers, eager_cache.layers):
        assert torch.equal(la.lengths, lb.lengths) and torch.equal(la.positions, lb.positions)
        assert torch.equal(la.kt, lb.kt) and la.generated.host_generated == lb.generated.host_generated
        assert la.capacity == 24 + 8 + 4


def test_pool_backed_cache_equals_private_and_reserves_the_bound():
    """Same tokens as the private store (kernel 1: the pool's view is wider, 40 slots of pages of 8 vs 36, and the
    top-k among equal max-pooled scores may break ties differently at another width), and the pool pages held do
    not depend on max_new_tokens."""
    rocket, _ = make_models("llama")
    config = compressing_config(decode_budget=8, decode_interval=4, decode_window=4, kt_cache_dtype="float32",
                                decode_kernel_size=1)
    ids = random_ids(1, 40)
    want = greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=30)
    held = []
    for new in (30, 120):
        pool = KVBlockPool(rocket.config, max_gpu_bytes=4 << 20, page_size=8, dtype=torch.float32, device="cpu",
                           kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)
        cache = RocketKVCache(config, pool=pool)
        out = greedy(rocket, ids, cache=cache, max_new_tokens=new)
        if new == 30:
            assert torch.equal(out, want)
        held.append(cache.stats.pages_held)
        cache.close()
    assert held[0] == held[1]  # view pages for 24 + 8 + 4 slots whatever max_new_tokens is


def test_beam_search_and_a_later_turn_keep_working():
    rocket, _ = make_models("llama")
    config = compressing_config(decode_budget=8, decode_interval=4, decode_window=4)
    cache = RocketKVCache(config)
    first = greedy(rocket, random_ids(1, 40), cache=cache, max_new_tokens=20)
    greedy(rocket, torch.cat([first, random_ids(1, 9, seed=5)], 1), cache=cache, max_new_tokens=20)
    layer = cache.layers[0]
    assert layer.capacity <= 24 + 8 + 4 + 4 and int(layer.lengths[0]) - int(layer.generated.gen_start[0]) <= 12
    beams = greedy(rocket, random_ids(1, 40), cache=RocketKVCache(config), max_new_tokens=20, num_beams=2)
    assert beams.shape == (1, 60)


def test_bad_values_raise_naming_the_field():
    with pytest.raises(ValueError, match=r"RocketKVConfig.decode_budget must be None \(off\) or an integer >= 1"):
        RocketKVConfig(decode_budget=0)
    with pytest.raises(ValueError, match=r"RocketKVConfig.decode_interval must be an integer >= 1, got 0"):
        RocketKVConfig(decode_budget=64, decode_interval=0)
    with pytest.raises(ValueError, match=r"RocketKVConfig.decode_window \(64\) must be <= decode_budget \(32\)"):
        RocketKVConfig(decode_budget=32, decode_window=64)
    with pytest.raises(ValueError, match="RocketKVConfig.decode_kernel_size must be odd"):
        RocketKVConfig(decode_budget=64, decode_kernel_size=4)
    with pytest.raises(ValueError, match="multi_turn='keep_all'"):
        RocketKVConfig(decode_budget=64, multi_turn="keep_all")
    with pytest.raises(ValueError, match="RocketKVConfig.decode_window must be an integer >= 1, got True"):
        RocketKVConfig(decode_window=True)


def test_yaml_and_cli_accept_the_fields():
    config = RocketKVConfig.from_yaml(
        "sparse_attention_config:\n  algorithm: rocket\n  decode_budget: 512\n  decode_interval: 128\n"
    )
    assert decode_compression(config).max_generated == 640
    assert RocketKVConfig.from_yaml(config.to_yaml()) == config
    assert apply_overrides(RocketKVConfig(), ["decode_budget=256"]).decode_budget == 256
    assert decode_compression(apply_overrides(config, ["decode_budget=null"])) is None
    with pytest.raises(ValueError, match="decode_budget"):
        RocketKVConfig.from_dict({"decode_budget": -1})


def test_row_group_prefill_equals_one_forward():
    """prefill_batch_size=1 stacks the rows' layers after stage 1: the stacked layer gets its own ring buffer and
    generated-token start, and the tokens equal a one-forward prefill's."""
    rocket, _ = make_models("llama")
    config = compressing_config(decode_budget=8, decode_interval=4, decode_window=4)
    ids, mask = left_pad([random_ids(1, 44, seed=3)[0], random_ids(1, 30, seed=4)[0]])
    want = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(config), max_new_tokens=25)
    cache = RocketKVCache(config.replace(prefill_batch_size=1))
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=25)
    assert torch.equal(out, want)
    assert cache.layers[0].generated.decode_queries.shape == (2, 4, 4, 16)


def test_adakv_decode_budget_tokens_do_not_depend_on_capacity_buckets():
    rocket, _ = make_models("llama", num_hidden_layers=1)
    ids, mask = left_pad([random_ids(1, 30 + 7 * r, seed=r)[0] for r in range(3)])
    config = compressing_config(kt_cache_dtype="float32", stage1="adakv", decode_budget=12, decode_interval=4,
                                decode_window=4, decode_runner="torch_compile", batch_buckets=())
    outs = [greedy(rocket, ids, attention_mask=mask, max_new_tokens=20, disable_compile=True,
                   cache=RocketKVCache(c)) for c in (config, config.replace(capacity_buckets=()))]
    assert torch.equal(outs[0], outs[1])
