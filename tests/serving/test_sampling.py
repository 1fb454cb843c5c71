"""SamplingParams validation and the per-request sampler, against plain-Python oracles."""

from __future__ import annotations

import math

import pytest
import torch

from hf_rocketkv.serving import InvalidRequest, SamplingParams
from hf_rocketkv.serving.engines.sampler import new_generator, sample_tokens, sampling_distribution


# ------------------------------------------------------------------------------------------------ SamplingParams
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"),
    ("top_p", 0), ("top_p", 1.5), ("top_k", -1), ("top_k", 1.5),
    ("stop", [1]), ("stop", [""]), ("stop", ["s"] * 17), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("seed", 2**64), ("seed", "x"), ("ignore_eos", "yes"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert str(err.value).startswith(field)  # the message begins with the field's name


def test_params_are_frozen_and_normalised():
    params = SamplingParams(stop="END", stop_token_ids=[5, 6])
    assert params.stop == ("END",) and params.stop_token_ids == (5, 6)
    with pytest.raises(AttributeError):
        params.max_tokens = 3
    assert SamplingParams.greedy(7).is_greedy and SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy
    assert params.replace(max_tokens=9).max_tokens == 9
    with pytest.raises(InvalidRequest):
        params.replace(max_tokens=0)
    hash(params)


# ------------------------------------------------------------------------------------------------ sampler
def oracle_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Temperature, top-k (ties with the k-th kept), top-p (smallest prefix reaching top_p), renormalised."""
    scaled = [x / temperature for x in logits]
    keep = set(range(len(scaled)))
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        keep = {i for i in keep if scaled[i] >= kth}
    if top_p < 1.0:
        z = sum(math.exp(scaled[i]) for i in keep)
        order = sorted(keep, key=lambda i: -scaled[i])
        kept, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.add(i)
            mass += math.exp(scaled[i]) / z
        keep = kept
    z = sum(math.exp(scaled[i]) for i in keep)
    return [math.exp(scaled[i]) / z if i in keep else 0.0 for i in range(len(scaled))]


def test_to_dict_names_every_field_with_its_value_and_builds_the_same_params():
    """The dict written out by hand: every field by name (the server's request log and the engine's records read it),
    and the params it builds are equal to the original."""
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, stop=["a", "b"], stop_token_ids=[5],
                            seed=11, ignore_eos=True)
    assert params.to_dict() == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "stop": ("a", "b"),
                                "stop_token_ids": (5,), "seed": 11, "ignore_eos": True}
    assert SamplingParams(**params.to_dict()) == params
    assert SamplingParams().to_dict() == {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop": (),
                                          "stop_token_ids": (), "seed": None, "ignore_eos": False}


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (1.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (0.8, 5, 0.9), (1.0, 0, 0.01),
])
def test_distribution_matches_oracle(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 11, generator=generator)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = sampling_distribution(logits, params)
    for row in range(4):
        expected = oracle_distribution(logits[row].tolist(), temperature, top_k, top_p)
        torch.testing.assert_close(got[row], torch.tensor(expected), atol=1e-6, rtol=1e-5)


def test_samples_follow_the_distribution_and_the_seed():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.9, top_k=4)
    expected = sampling_distribution(logits, params)[0]
    generator = new_generator(7, "cpu")
    draws = torch.stack([sample_tokens(logits, params, generator) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    assert (freq[4:] == 0).all()  # outside the top 4: never
    assert torch.allclose(freq, expected.double(), atol=0.03)  # 4000 draws: sd < 0.008 per token
    again = new_generator(7, "cpu")
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(torch.stack([sample_tokens(logits, params, again) for _ in range(4000)]).flatten(), draws)


def test_greedy_is_argmax_and_needs_no_generator():
    logits = torch.randn(3, 20)
    assert torch.equal(sample_tokens(logits, SamplingParams.greedy(), None), logits.argmax(-1))
    with pytest.raises(ValueError, match="batch, vocab"):
        sample_tokens(logits[0], SamplingParams.greedy(), None)


@pytest.mark.parametrize("temperature, top_p", [
    (5e-324, 1.0), (1e-40, 1.0), (1e-30, 0.5), (1.0, 5e-324), (1.0, 1e-50), (2.0, 1e-45),
])
def test_extreme_valid_values_still_give_a_distribution(temperature, top_p):
    """Found by fuzzing the server (tests/serving/test_fuzz.py): a temperature or top_p that SamplingParams accepts
    but float32 cannot divide by or compare with (5e-324 rounds to 0) made the draw raise ("probability tensor
    contains inf, nan"), and the server answered 500. Now: the top token, alone (tiny temperature or top_p)."""
    logits = torch.tensor([[2.0, 1.0, 3.5, 0.0, 3.25], [0.1, 0.2, 0.3, 0.4, 0.0]])
    params = SamplingParams(temperature=temperature, top_p=top_p)
    probs = sampling_distribution(logits, params)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 5).float())
    assert sample_tokens(logits, params, new_generator(0, "cpu")).tolist() == [2, 3]


def test_a_tiny_temperature_draws_among_tied_top_tokens():
    logits = torch.tensor([[1.0, 4.0, 4.0, -2.0]])
    probs = sampling_distribution(logits, SamplingParams(temperature=1e-300))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0]]))
