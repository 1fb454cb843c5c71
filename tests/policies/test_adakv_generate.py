"""AdaKV (``stage1="adakv"`` / ``AdaKVPolicy``: per-KV-head budgets, ``lengths`` ``[B, Hkv]``) through generate() on
the tiny random Llama (2 KV heads, prompt_budget 24, window 8).

Oracles, none of which runs the code under test:
- kept positions: AdaKV's rule computed here in float64 from the sdpa model's post-RoPE prompt keys with a key-norm
  scorer (every head keeps its window; the ``Hkv * (budget - window)`` best prefix slots of the row across both heads
  by ``-||k||``), and a declared ``per_head_budgets`` policy whose choice is fixed by construction;
- decode logits: the sdpa model with a float64 attention function registered with transformers' AttentionInterface
  that lets each KV head of each layer see only its kept prompt positions plus every generated token, fed the rocket
  model's tokens teacher-forced;
- beams: each returned beam replayed teacher-forced through a fresh cache has the log probability beam search reports;
- metamorphic checks: a left-padded batch equals each row alone, chunked prefill equals one forward, a keep_all
  later turn equals a cold run of the conversation, the Triton backend (interpreted on CPU) equals the PyTorch one;
- decode-time compression: the budget arithmetic simulated on the host, and the prompt part of every head compared
  with a prefill-only run.
Refusals: a pool and an evicting later turn raise clear errors, the latter without touching the cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVLayer
from hf_rocketkv.policies import AdaKVPolicy, KeptSlots, ScorerPolicy
from tests.policies import oracle
from tests.policies.helpers import prompt_keys
from tests.support.tiny_models import (
    compressing_config,
    greedy,
    left_pad,
    make_models,
    random_ids,
    teacher_forced_logits,
)
from hf_rocketkv.integration.compat import cache_kwargs

HKV, PROMPT, BUDGET, WINDOW = 2, 40, 24, 8
PREFIX = PROMPT - WINDOW  # selectable prefix slots 0..31 of an unpadded 40-token prompt


def neg_norm(inputs):
    return -inputs.keys.float().norm(dim=-1)


def neg_norm_adakv() -> AdaKVPolicy:
    return AdaKVPolicy(ScorerPolicy(neg_norm, "neg_norm"))


class StridedHeads:
    """A full-control policy that declares per-head budgets: KV head h keeps every (h + 2)-th prefix slot of the row
    plus its window (40-token prompt: head 0 keeps 16 + 8, head 1 keeps 11 + 8)."""

    name = "strided_heads"
    per_head_budgets = True

    def select(self, inputs):
        kept = []
        for s, e, w in inputs.rows():
            per_head = [strided_slots(s, e, w, h, inputs.budget) for h in range(inputs.num_kv_heads)]
            width = max(len(p) for p in per_head)
            slots = torch.tensor([p + [-1] * (width - len(p)) for p in per_head], dtype=torch.long)
            kept.append(KeptSlots(slots, torch.tensor([len(p) for p in per_head])))
        return kept


def strided_slots(s: int, e: int, w: int, h: int, budget: int) -> list[int]:
    if e - s <= budget:
        return list(range(s, e))
    return [j for j in range(s, e - w) if (j - s) % (h + 2) == 0] + list(range(e - w, e))


def held(cache, layer_idx: int, b: int = 0) -> list[list[int]]:
    """Per KV head: the input positions of the slots the layer holds (its first kept_tokens[b, h] slots)."""
    counts = cache.kept_tokens(layer_idx)[b].tolist()
    positions = cache.kept_positions(layer_idx)
    return [positions[b, h, :n].tolist() for h, n in enumerate(counts)]


def assert_adakv_neg_norm_choice(prompt_part: list[list[int]], keys: torch.Tensor) -> None:
    """AdaKV's rule from its definition, float64: every head keeps the window 32..39, and the heads' prefix slots
    together are a top-(Hkv * (budget - window)) set of the row's ``[Hkv * 32]`` scores -||k|| (up to float ties)."""
    flat_scores = [-float(keys[0, h, j].double().norm()) for h in range(HKV) for j in range(PREFIX)]
    chosen = []
    for h, positions in enumerate(prompt_part):
        assert positions[-WINDOW:] == list(range(PREFIX, PROMPT)), f"head {h} keeps its window"
        prefix = positions[:-WINDOW]
        assert prefix == sorted(set(prefix)) and all(0 <= j < PREFIX for j in prefix), prefix
        chosen += [h * PREFIX + j for j in prefix]
    oracle.assert_top_up_to_ties(chosen, flat_scores, HKV * (BUDGET - WINDOW))


# ------------------------------------------------------------------------------------------------ stage 1 in generate
def test_generate_keeps_the_adakv_oracles_positions_per_head():
    rocket, sdpa = make_models("llama")
    ids = random_ids(1, PROMPT)
    new = 5
    cache = RocketKVCache(compressing_config(stage1=neg_norm_adakv()))
    out = greedy(rocket, ids, max_new_tokens=new, cache=cache)
    assert out.shape == (1, PROMPT + new)
    fed_back = list(range(PROMPT, PROMPT + new - 1))  # generate() never feeds back its last token
    differ = False
    for layer_idx, keys in enumerate(prompt_keys(sdpa, ids)):
        counts = cache.kept_tokens(layer_idx)
        assert counts.shape == (1, HKV)
        assert int(counts.sum()) == HKV * BUDGET + HKV * len(fed_back)  # the row total of a uniform policy
        heads = held(cache, layer_idx)
        prompt_part = [positions[: len(positions) - len(fed_back)] for positions in heads]
        for h, positions in enumerate(heads):
            assert positions[len(prompt_part[h]):] == fed_back, "every head stores every decode token"
            assert bool((cache.kept_positions(layer_idx)[0, h, len(positions):] == -1).all()), "empty slots are -1"
        assert_adakv_neg_norm_choice(prompt_part, keys)
        differ |= len(prompt_part[0]) != len(prompt_part[1])
    assert differ, "the heads must keep different counts in some layer (else nothing per-head was shown)"


def oracle_attention_name(kept: dict[int, list[list[int]]], prompt_len: int) -> str:
    """Register a float64 attention with transformers: prefill is causal over everything; a decode step (one query)
    of layer l, KV head h sees prompt column j only when j is in ``kept[l][h]``, and every column >= prompt_len.
    Batch 1, no padding (the mask transformers passes is not needed)."""
    name = "adakv_test_oracle"

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q, k, v = query.double(), key.double(), value.double()
        batch, num_q_heads, n, dim = q.shape
        assert batch == 1
        group = num_q_heads // k.shape[1]
        length = k.shape[2]
        scale = scaling if scaling is not None else dim**-0.5
        out = torch.empty(batch, n, num_q_heads, dim, dtype=torch.float64)
        columns = torch.arange(length)
        causal = columns[None, :] <= (length - n + torch.arange(n))[:, None]  # [n, L]
        for hq in range(num_q_heads):
            h = hq // group
            visible = causal.clone()
            if n == 1:
                allowed = columns >= prompt_len
                allowed[kept[module.layer_idx][h]] = True
                visible &= allowed[None, :]
            logits = (q[0, hq] @ k[0, h].T) * scale
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            out[0, :, hq] = probs @ v[0, h]
        return out.to(query.dtype), None

    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@pytest.mark.parametrize("policy", ["adakv_neg_norm", "declared_strided"])
def test_decode_logits_equal_attention_over_each_heads_kept_prompt_and_every_generated_token(policy):
    """stage2="none": every decode step attends exactly each KV head's kept prompt positions plus every generated
    token; the logits of every step equal the float64 masked-attention oracle on the sdpa model."""
    rocket, sdpa = make_models("llama")
    ids = random_ids(1, PROMPT, seed=3)
    new = 6
    stage1 = neg_norm_adakv() if policy == "adakv_neg_norm" else StridedHeads()
    cache = RocketKVCache(compressing_config(stage1=stage1, stage2="none"))
    out = greedy(rocket, ids, max_new_tokens=new, cache=cache, output_logits=True,
                 return_dict_in_generate=True)
    tokens = out.sequences[:, PROMPT:]

    kept = {}
    keys = prompt_keys(sdpa, ids)
    for layer_idx in range(rocket.config.num_hidden_layers):
        prompt_part = [positions[: len(positions) - (new - 1)] for positions in held(cache, layer_idx)]
        if policy == "adakv_neg_norm":
            assert_adakv_neg_norm_choice(prompt_part, keys[layer_idx])
        else:
            assert prompt_part == [strided_slots(0, PROMPT, WINDOW, h, BUDGET) for h in range(HKV)]
        assert len(prompt_part[0]) != len(prompt_part[1]) or policy == "adakv_neg_norm"
        kept[layer_idx] = prompt_part

    steps = oracle_logits(sdpa, ids, tokens, kept)
    torch.testing.assert_close(torch.stack(out.logits, 1), steps, rtol=1e-4, atol=1e-4)
    # the check can tell: every prompt token in every head (a dense decode) gives other logits
    dense = oracle_logits(sdpa, ids, tokens, {layer_idx: [list(range(PROMPT))] * HKV for layer_idx in kept})
    assert not torch.allclose(dense[:, 1:], steps[:, 1:], atol=1e-3)


def oracle_logits(sdpa, ids, tokens, kept) -> torch.Tensor:
    """``[1, n, V]``: the logits before each of ``tokens`` (teacher-forced) on the sdpa model's weights, every decode
    step attending only ``kept[layer][head]`` of the prompt plus every generated token."""
    sdpa.set_attn_implementation(oracle_attention_name(kept, ids.shape[1]))
    reference = DynamicCache()
    steps = []
    with torch.no_grad():
        logits = sdpa(ids, **cache_kwargs(reference), use_cache=True).logits[:, -1]
        for i in range(tokens.shape[1]):
            steps.append(logits)
            logits = sdpa(tokens[:, i : i + 1], **cache_kwargs(reference), use_cache=True).logits[:, -1]
    return torch.stack(steps, 1)


# ------------------------------------------------------------------------------------------------ batch, chunks, beams
def test_left_padded_batch_equals_each_row_alone():
    rocket, _ = make_models("llama")
    rows = [random_ids(1, 40, seed=40)[0], random_ids(1, 25, seed=25)[0]]  # both over the budget of 24
    ids, mask = left_pad(rows)
    config = compressing_config(stage1="adakv")
    cache = RocketKVCache(config)
    batch = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=5)
    for b, row in enumerate(rows):
        alone_cache = RocketKVCache(config)
        alone = greedy(rocket, row[None], cache=alone_cache, max_new_tokens=5)
        assert torch.equal(batch[b, ids.shape[1] :], alone[0, len(row) :]), f"row {b}"
        pad = ids.shape[1] - len(row)
        for layer_idx in range(rocket.config.num_hidden_layers):
            assert cache.kept_tokens(layer_idx)[b].tolist() == alone_cache.kept_tokens(layer_idx)[0].tolist()
            shifted = [[p - pad for p in positions] for positions in held(cache, layer_idx, b)]
            assert shifted == held(alone_cache, layer_idx), f"row {b} layer {layer_idx}"
    for layer_idx in range(rocket.config.num_hidden_layers):
        assert cache.kept_tokens(layer_idx).sum(dim=1).tolist() == [HKV * (BUDGET + 4)] * 2


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_equals_one_forward(chunk):
    rocket, _ = make_models("llama")
    ids = random_ids(1, PROMPT, seed=5)
    config = compressing_config(stage1="adakv")
    reference_cache = RocketKVCache(config)
    reference = greedy(rocket, ids, cache=reference_cache, max_new_tokens=5)
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, cache=cache, prefill_chunk_size=chunk, max_new_tokens=5)
    assert torch.equal(out, reference)
    for layer_idx in range(rocket.config.num_hidden_layers):
        assert cache.kept_tokens(layer_idx).tolist() == reference_cache.kept_tokens(layer_idx).tolist()
        assert held(cache, layer_idx) == held(reference_cache, layer_idx)


def test_beam_search_scores_match_a_replay_of_each_beam():
    rocket, _ = make_models("llama")
    config = compressing_config(stage1="adakv")
    ids = random_ids(2, PROMPT, seed=7)
    new = 6
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, cache=cache, num_beams=3, num_return_sequences=3, max_new_tokens=new,
                 length_penalty=0.0, output_scores=True, return_dict_in_generate=True)
    assert out.sequences.shape == (6, PROMPT + new)
    for layer_idx in range(rocket.config.num_hidden_layers):
        assert cache.kept_tokens(layer_idx).sum(dim=1).tolist() == [HKV * (BUDGET + new - 1)] * 6
    for row in range(6):
        prompt, beam = ids[row // 3 : row // 3 + 1], out.sequences[row : row + 1, PROMPT:]
        logits = teacher_forced_logits(rocket, prompt, beam, config)
        logprob = torch.log_softmax(logits[0].double(), dim=-1).gather(1, beam[0, :, None]).sum()
        torch.testing.assert_close(out.sequences_scores[row].double(), logprob, rtol=1e-4, atol=1e-4)
    assert len({tuple(r) for r in out.sequences[:3, PROMPT:].tolist()}) == 3  # three different beams


# ------------------------------------------------------------------------------------------------ decode compression
def simulated_generated(steps: int, budget: int, interval: int) -> list[int]:
    """Generated tokens each head holds after each decode step: compress to ``budget`` when ``budget + interval``
    are held, before the next token is stored."""
    held_now, trace = 0, []
    for _ in range(steps):
        if held_now >= budget + interval:
            held_now = budget
        held_now += 1
        trace.append(held_now)
    return trace


def test_decode_compression_keeps_each_heads_prompt_and_bounds_its_generated_tokens(monkeypatch):
    rocket, _ = make_models("llama")
    ids = random_ids(1, PROMPT, seed=9)
    budget, interval, window, new = 8, 4, 4, 30
    config = compressing_config(stage1="adakv", decode_budget=budget, decode_interval=interval, decode_window=window)
    layers = rocket.config.num_hidden_layers

    prefill_cache = RocketKVCache(config)
    greedy(rocket, ids, max_new_tokens=1, cache=prefill_cache)  # stage 1 only, no decode step
    prompt = [held(prefill_cache, layer_idx) for layer_idx in range(layers)]
    prompt_counts = [[len(p) for p in heads] for heads in prompt]
    assert any(c[0] != c[1] for c in prompt_counts)

    generated_per_step = {layer_idx: [] for layer_idx in range(layers)}
    original = RocketKVLayer.attend_decode

    def recording(layer, query, scaling):
        kept = layer.kept_tokens()[0].tolist()
        generated_per_step[layer.layer_idx].append([n - c for n, c in zip(kept, prompt_counts[layer.layer_idx])])
        return original(layer, query, scaling)

    monkeypatch.setattr(RocketKVLayer, "attend_decode", recording)
    cache = RocketKVCache(config)
    greedy(rocket, ids, max_new_tokens=new, cache=cache)

    expected = simulated_generated(new - 1, budget, interval)
    assert max(expected) == budget + interval and expected[-1] < budget + interval  # compression happened
    for layer_idx in range(layers):
        assert generated_per_step[layer_idx] == [[g] * HKV for g in expected], f"layer {layer_idx}"
        assert cache.kept_tokens(layer_idx)[0].tolist() == [c + expected[-1] for c in prompt_counts[layer_idx]]
        for h, positions in enumerate(held(cache, layer_idx)):
            n = prompt_counts[layer_idx][h]
            assert positions[:n] == prompt[layer_idx][h], "the prompt part is never re-scored or moved"
            generated = positions[n:]
            assert generated == sorted(set(generated)) and all(PROMPT <= p < PROMPT + new - 1 for p in generated)
            assert generated[-window:] == list(range(PROMPT + new - 1 - window, PROMPT + new - 1)), "newest kept"


# ------------------------------------------------------------------------------------------------ later turns
@pytest.mark.parametrize("first_new", [1, 4])
def test_keep_all_later_turn(first_new):
    """multi_turn="keep_all": turn 2 re-runs stage 1 over the whole conversation. With one token generated in turn 1
    every stored token came from a prefill, so turn 2 equals a cold run of the conversation exactly."""
    rocket, _ = make_models("llama")
    config = compressing_config(stage1="adakv", multi_turn="keep_all")
    cache = RocketKVCache(config)
    first = greedy(rocket, random_ids(1, PROMPT, seed=11), max_new_tokens=first_new, cache=cache)
    conversation = torch.cat([first, random_ids(1, 10, seed=12)], dim=1)
    new = 5
    second = greedy(rocket, conversation, max_new_tokens=new, cache=cache)
    assert torch.equal(second[:, : conversation.shape[1]], conversation)
    width = conversation.shape[1]
    for layer_idx in range(rocket.config.num_hidden_layers):
        counts = cache.kept_tokens(layer_idx)
        assert counts.sum(dim=1).tolist() == [HKV * BUDGET + HKV * (new - 1)]
        for positions in held(cache, layer_idx):
            assert positions[-(new - 1) :] == list(range(width, width + new - 1))
            assert positions[-(new - 1) - WINDOW : -(new - 1)] == list(range(width - WINDOW, width)), "turn-2 window"
    if first_new == 1:
        cold_cache = RocketKVCache(config)
        cold = greedy(rocket, conversation, max_new_tokens=new, cache=cold_cache)
        assert torch.equal(second, cold)
        for layer_idx in range(rocket.config.num_hidden_layers):
            assert held(cache, layer_idx) == held(cold_cache, layer_idx)


def test_evicting_later_turn_is_refused_and_leaves_the_cache_usable():
    rocket, _ = make_models("llama")
    config = compressing_config(stage1="adakv")  # multi_turn="evict", the default
    ids = random_ids(1, PROMPT, seed=13)
    cache = RocketKVCache(config)
    first = greedy(rocket, ids, max_new_tokens=4, cache=cache)
    before = [(cache.kept_tokens(i).clone(), cache.kept_positions(i).clone()) for i in range(len(cache.layers))]
    with pytest.raises(NotImplementedError, match="multi_turn='keep_all'"):
        greedy(rocket, torch.cat([first, random_ids(1, 10, seed=14)], dim=1), max_new_tokens=3,
               cache=cache)
    for i, (counts, positions) in enumerate(before):
        assert torch.equal(cache.kept_tokens(i), counts) and torch.equal(cache.kept_positions(i), positions)

    # the refused call changed nothing: one more decode step on this cache equals a replay on a fresh one
    with torch.no_grad():
        continued = rocket(first[:, -1:], **cache_kwargs(cache)).logits[:, -1]
    replay = teacher_forced_logits(rocket, ids, torch.cat([first[:, PROMPT:], first[:, -1:]], dim=1), config)
    torch.testing.assert_close(continued, replay[:, -1], rtol=1e-5, atol=1e-5)
    # and a fresh cache serves the same conversation's first turn again
    assert torch.equal(greedy(rocket, ids, max_new_tokens=4, cache=RocketKVCache(config)), first)


@pytest.mark.parametrize("stage1", ["adakv", "declared_object"])
def test_pool_refuses_per_head_budgets(stage1):
    rocket, _ = make_models("llama")
    policy = "adakv" if stage1 == "adakv" else StridedHeads()
    config = compressing_config(stage1=policy, kt_cache_dtype="float32")
    pool = KVBlockPool(rocket.config, max_gpu_bytes=4 << 20, page_size=8, dtype=torch.float32, device="cpu",
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)
    with pytest.raises(ValueError, match=r"stage1=.*gives each KV head its own number of kept tokens"):
        RocketKVCache(config, pool=pool)
    assert pool.free_pages() == pool.total_pages()
    uniform = RocketKVCache(config.replace(stage1="snapkv"), pool=pool)  # the same pool takes a uniform policy
    greedy(rocket, random_ids(1, PROMPT), max_new_tokens=2, cache=uniform)
    uniform.close()


# ------------------------------------------------------------------------------------------------ triton backend
@pytest.mark.gpu  # compiled kernels on a GPU where one is present (pytest -m gpu); interpreted on CPU
def test_kt_pages_on_the_triton_backend_equal_the_torch_backend():
    """Stage 2 selects 3 of the pages of each head's own length (compiled kernels on a GPU, interpreted on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rocket, _ = make_models("llama", seed=2)
    rocket = rocket.to(device)
    with torch.no_grad():  # sharper attention: page scores far from ties, so both backends pick the same pages
        for layer in rocket.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    ids = random_ids(1, 32, seed=4).to(device)
    config = compressing_config(stage1="adakv", prompt_budget=16, window_size=4, kernel_size=3, topk=3,
                                page_size=2, kt_cache_dtype="float32")
    want_cache = RocketKVCache(config)
    want = greedy(rocket, ids, 4, cache=want_cache)
    cache = RocketKVCache(config.replace(backend="triton"))
    got = greedy(rocket, ids, 4, cache=cache)
    assert cache.layers[0].ops.name == "triton"
    assert torch.equal(got, want)
    for layer_idx in range(rocket.config.num_hidden_layers):
        assert cache.kept_tokens(layer_idx).tolist() == want_cache.kept_tokens(layer_idx).tolist()
        assert held(cache, layer_idx) == held(want_cache, layer_idx)
    assert any(len(set(want_cache.kept_tokens(i)[0].tolist())) > 1 for i in range(rocket.config.num_hidden_layers))
    assert max(int(want_cache.kept_tokens(i).max()) for i in range(2)) > 2 * config.topk  # pages are selected


@pytest.mark.parametrize("prefill_batch_size", [1, 2])
def test_row_group_prefill_equals_one_batch(prefill_batch_size):
    """prefill_batch_size splits the prefill into row groups whose compressed layers are stacked (stack_rows): the
    [B, Hkv] lengths, kept positions and tokens equal a single-batch prefill."""
    rocket, _ = make_models("llama")
    ids, mask = left_pad([random_ids(1, 40, seed=1)[0], random_ids(1, 33, seed=2)[0], random_ids(1, 45, seed=3)[0]])
    runs = []
    for size in (None, prefill_batch_size):
        cache = RocketKVCache(compressing_config(stage1="adakv", prefill_batch_size=size))
        out = greedy(rocket, ids, attention_mask=mask, max_new_tokens=5, cache=cache)
        runs.append((out, cache))
    (want, want_cache), (got, cache) = runs
    assert torch.equal(got, want)
    for layer_idx in range(len(cache.layers)):
        assert cache.layers[layer_idx].lengths.shape == (3, 2)
        assert torch.equal(cache.kept_tokens(layer_idx), want_cache.kept_tokens(layer_idx))
        width = min(cache.kept_positions(layer_idx).shape[-1], want_cache.kept_positions(layer_idx).shape[-1])
        assert torch.equal(cache.kept_positions(layer_idx)[..., :width], want_cache.kept_positions(layer_idx)[..., :width])


def test_token_budget_with_adakv_keeps_the_derived_total_per_row():
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config(stage1="adakv", token_budget=32))
    greedy(rocket, random_ids(2, 60), max_new_tokens=5, cache=cache)
    derived = cache.layers[0].config.prompt_budget
    for layer_idx in range(len(cache.layers)):
        kept = cache.kept_tokens(layer_idx)
        assert kept.shape == (2, 2) and kept.sum(dim=1).tolist() == [2 * (derived + 4)] * 2
