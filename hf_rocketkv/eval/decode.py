"""Running one method on one prompt with plain ``model(...)`` forwards: shared prefill, greedy decode, teacher forcing.

Prefix sharing. Every method's prefill is exact dense causal attention; RocketKV's stage 1 only needs the K/V of
the whole prompt and the queries of its last ``window_size`` tokens. So the prompt minus a ``tail`` (>= the
window) is prefilled once with sdpa + DynamicCache, and each method starts from a copy of those dense K/V and runs
the tail through its own cache: a RocketKVCache compresses at the end of that forward exactly as after a one-shot
prefill (``tests/eval/test_decode.py`` checks the answers equal ``model.generate``'s). This makes a comparison of
N methods cost one long prefill instead of N.

Positions are explicit (``position_ids``): after stage 1 the number of stored tokens is not the position.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..cache import RocketKVCache
from ..integration import compat
from .methods import Method


@dataclass
class SharedPrefix:
    ids: torch.LongTensor  # [1, L] the whole prompt
    split: int  # tokens ids[:, :split] are in kv
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer dense K/V [1, Hkv, split, D]
    seconds: float  # wall time of the shared prefill


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def shared_prefix(model, ids: torch.LongTensor, tail: int) -> SharedPrefix:
    """Dense prefill of all but the last ``tail`` tokens (none when the prompt is not longer than ``tail``)."""
    split = max(ids.shape[1] - tail, 0)
    start = time.perf_counter()
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    if split > 0:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache()
        model(ids[:, :split].to(_model_device(model)), use_cache=True, logits_to_keep=1, **compat.cache_kwargs(cache))
        kv = [(layer.keys, layer.values) for layer in cache.layers]
    return SharedPrefix(ids=ids, split=split, kv=kv, seconds=time.perf_counter() - start)


@dataclass
class Prefilled:
    cache: object
    logits: torch.Tensor  # [V] fp32 logits after the last prompt token
    seconds: float  # wall time of this method's own part of the prefill (the tail forward, stage 1 included)


@torch.no_grad()
def prefill(model, method: Method, prefix: SharedPrefix, max_new_tokens: int | None = None) -> Prefilled:
    """A fresh cache for ``method`` holding a copy of the shared prefix, then the tail forward through it.

    A method whose stage 1 scores with every prompt query (H2O, ``method.needs_full_prefill``) runs the whole prompt
    through its own cache instead: the shared prefix never passed through its attention.
    """
    cache = method.new_cache(model, prefix.ids.shape[1] + (max_new_tokens or 0))
    if method.needs_full_prefill:
        prefix = SharedPrefix(ids=prefix.ids, split=0, kv=[], seconds=0.0)
    kv = [(k.clone(), v.clone()) for k, v in prefix.kv]
    if hasattr(cache, "preload_prefix"):
        cache.preload_prefix(kv)  # RocketKV: stored without an attention call (no forward consumes them)
    else:
        for layer_idx, (k, v) in enumerate(kv):
            cache.update(k, v, layer_idx)
    model.set_attn_implementation(method.attn_implementation)
    device = _model_device(model)
    length = prefix.ids.shape[1]
    start = time.perf_counter()
    # a RocketKVCache's prefill knows the request's length (as generate() tells it); other caches need nothing
    max_length = length + max_new_tokens if max_new_tokens is not None else None
    with cache.prefill(max_length=max_length) if isinstance(cache, RocketKVCache) else contextlib.nullcontext():
        out = model(
            prefix.ids[:, prefix.split :].to(device),
            position_ids=torch.arange(prefix.split, length, device=device)[None],
            **compat.cache_kwargs(cache),
            use_cache=True,
            logits_to_keep=1,
        )
    return Prefilled(cache=cache, logits=out.logits[0, -1].float(), seconds=time.perf_counter() - start)


@torch.no_grad()
def step(model, cache, token: int, position: int) -> torch.Tensor:
    """One decode step: feed ``token`` at ``position``; returns the next fp32 logits ``[V]``."""
    device = _model_device(model)
    out = model(
        torch.tensor([[token]], device=device),
        position_ids=torch.tensor([[position]], device=device),
        **compat.cache_kwargs(cache),
        use_cache=True,
    )
    return out.logits[0, -1].float()


def greedy(model, prefilled: Prefilled, start_position: int, max_new_tokens: int, eos_ids: set[int]):
    """Greedy decode; returns ``(token ids, seconds per decode step)`` (stops after an eos token)."""
    tokens: list[int] = []
    logits = prefilled.logits
    start = time.perf_counter()
    steps = 0
    for i in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos_ids or i == max_new_tokens - 1:
            break
        logits = step(model, prefilled.cache, token, start_position + i)
        steps += 1
    return tokens, (time.perf_counter() - start) / steps if steps else 0.0


def teacher_forced_log_probs(model, prefilled: Prefilled, start_position: int, continuation: list[int]):
    """Yield the fp32 log-probabilities ``[V]`` predicting ``continuation[j]``, feeding the true tokens."""
    logits = prefilled.logits
    for j, token in enumerate(continuation):
        yield torch.log_softmax(logits, dim=-1)
        if j + 1 < len(continuation):
            logits = step(model, prefilled.cache, token, start_position + j)


def kept_tokens_per_layer(cache) -> list[float]:
    """Tokens stored per layer (mean over rows and KV heads); for a DynamicCache, its sequence length."""
    if hasattr(cache, "kept_tokens"):
        return [float(cache.kept_tokens(i).float().mean()) for i in range(len(cache.layers))]
    return [float(layer.keys.shape[-2]) for layer in cache.layers]


def cache_bytes(cache) -> int:
    """Bytes the cache holds: ``memory_bytes()`` for RocketKV caches, the K/V tensors of a DynamicCache."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )


def retention(cache, positions: list[int]) -> dict | None:
    """How much of a span (prompt token positions) stage 1 kept, over every layer and KV head of row 0.

    ``kept``: mean fraction of the span's tokens kept; ``whole``: fraction of (layer, KV head) pairs that kept all of
    them. None for caches without ``kept_positions`` (the full DynamicCache keeps everything) or an empty span.
    """
    if not positions or not hasattr(cache, "kept_positions"):
        return None
    span = torch.tensor(positions)
    fractions = []
    for layer_idx in range(len(cache.layers)):
        kept = cache.kept_positions(layer_idx)[0].cpu()  # [Hkv, C]
        for head in kept:
            fractions.append(float(torch.isin(span, head.long()).float().mean()))
    return {"kept": sum(fractions) / len(fractions), "whole": sum(f == 1.0 for f in fractions) / len(fractions)}
