"""The stage-1 policies' settings: each refusal is a ValueError naming the setting and the value given, and the
smallest valid values are accepted (messages and bounds as each class documents them)."""

from __future__ import annotations

import pytest

from hf_rocketkv.policies import (
    H2OPolicy,
    KnormPolicy,
    RandomPolicy,
    ScorerPolicy,
    SnapKVPolicy,
    StreamingPolicy,
)
from hf_rocketkv.policies.adakv import AdaKVPolicy
from hf_rocketkv.policies.keep_first import KeepFirst


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_streaming_sink_tokens(bad):
    with pytest.raises(ValueError, match=rf"^StreamingPolicy\.sink_tokens must be an integer >= 0, got {bad!r}$"):
        StreamingPolicy(sink_tokens=bad)


@pytest.mark.parametrize("bad", [0, -2, 1.5, False])
def test_h2o_block_size(bad):
    with pytest.raises(ValueError, match=rf"^H2OPolicy\.block_size must be an integer >= 1, got {bad!r}$"):
        H2OPolicy(block_size=bad)


@pytest.mark.parametrize("bad", [1.5, True, "0", None])
def test_random_seed(bad):
    with pytest.raises(ValueError, match=rf"^RandomPolicy\.seed must be an integer, got {bad!r}$"):
        RandomPolicy(seed=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_keep_first_tokens(bad):
    with pytest.raises(ValueError, match=rf"^KeepFirst\.tokens must be an integer >= 0, got {bad!r}$"):
        KeepFirst(KnormPolicy(), bad)


def test_keep_first_policy_and_scorer_name():
    with pytest.raises(ValueError, match=r"^KeepFirst\.policy must have a select\(inputs\) method, got object$"):
        KeepFirst(object(), 1)
    for bad in ("", 3, None):
        with pytest.raises(ValueError, match=rf"^ScorerPolicy\.name must be a non-empty string, got {bad!r}$"):
            ScorerPolicy(lambda inputs: inputs.keys, name=bad)
    with pytest.raises(ValueError, match=r"^AdaKVPolicy\.scorer must have a score\(inputs\) -> \[B, Hkv, N\] method, "
                                         r"got object$"):
        AdaKVPolicy(object())


def test_smallest_valid_settings_are_accepted():
    assert StreamingPolicy(sink_tokens=0).sink_tokens == 0
    assert H2OPolicy(block_size=1).block_size == 1
    assert RandomPolicy(seed=-7).seed == -7
    wrapped = KeepFirst(SnapKVPolicy(), 0)
    assert wrapped.tokens == 0 and wrapped.name == "snapkv"  # other attributes come from the wrapped policy
    assert ScorerPolicy(lambda inputs: inputs.keys, name="x").name == "x"
    assert AdaKVPolicy(H2OPolicy()).scorer == H2OPolicy()
