"""Token sampling with a per-request ``torch.Generator``: temperature, top-k, top-p. Pure functions over tensors.

generate() has no per-call generator (its sampling draws from torch's process-global RNG), so requests sharing a
process could not each be reproducible from their own seed. The engines therefore decode greedily and let
``sample_tokens`` pick the token (``generate_hooks.SamplingLogitsProcessor`` forces it); a batched engine calls it
per row with that row's parameters and generator.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams

MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)  # the smallest temperature the scores are divided by


def new_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device``, seeded with ``seed`` or (None) with fresh OS entropy; global RNG untouched."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed % 2**64)  # negative 64-bit seeds map onto the unsigned range
    return generator


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[..., V]`` (float32) that ``sample_tokens`` draws from, for a non-greedy ``params``.

    Order: temperature, then top-k (ties with the k-th logit are kept), then top-p (the smallest prefix of tokens by
    descending probability whose mass reaches top_p; the most likely token is always kept), then renormalise.

    Any temperature in (0, 2] and top_p in (0, 1] gives a distribution: the scores are shifted so that the largest is
    0 before the division (a tiny temperature sends the others to -inf, never the top one to inf or NaN), the
    temperature is at least float32's smallest normal number (a smaller one, or one that rounds to 0 in float32,
    draws among the tied top tokens, as that one does), and the top token survives any top_p.
    """
    scores = logits.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / max(params.temperature, MIN_TEMPERATURE)
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p  # the tokens before already reach top_p
        drop_sorted[..., 0] = False  # the most likely token, even when top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of ``logits`` ``[B, V]``: argmax when ``params.is_greedy``, else a draw from
    ``sampling_distribution`` with ``generator``. Returns LongTensor ``[B]``."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if params.is_greedy:
        return logits.argmax(dim=-1)
    probs = sampling_distribution(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
