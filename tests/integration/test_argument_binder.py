"""``compat_calls.ArgumentBinder`` against ``inspect.Signature.bind`` (the oracle: the standard library's rules).

For transformers' own forwards that the fused paths wrap and for synthetic signatures (keyword-only parameters,
``**kwargs``, ``*args``, positional-only), every call shape gives the same bound values in the same order (by
identity), or the same TypeError: positional and keyword calls, defaults, extra keywords into ``**kwargs``, a name
given twice, a required argument missing, an unknown keyword, too many positional values.
"""

from __future__ import annotations

import inspect

import pytest
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3DecoderLayer
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm

from hf_rocketkv.integration.compat_calls import ArgumentBinder


def keyword_only(self, a, b=2, *, c, d=4):
    return a


def open_keywords(self, a, b=None, **kwargs):
    return a


def closed(self, a, b=None, c=3):
    return a


def star_args(self, a, *args, b=1):
    return a


def positional_only(self, a, /, b=1):
    return a


FORWARDS = [LlamaAttention.forward, LlamaDecoderLayer.forward, Gemma3Attention.forward, Gemma3DecoderLayer.forward,
            LlamaMLP.forward, LlamaRMSNorm.forward, keyword_only, open_keywords, closed, star_args, positional_only]
TOKENS = [object() for _ in range(8)]  # distinct values, compared by identity


def oracle(signature, args, kwargs):
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return TypeError
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def calls(signature):
    """Call shapes over the signature's names: every split into a positional prefix and keywords, with some
    parameters left out, one name twice, an unknown keyword and one positional value too many."""
    names = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    values = dict(zip(names, TOKENS))
    for given in range(len(names) + 1):
        for left_out in [()] + [(name,) for name in names]:
            chosen = [name for name in names[:given] if name not in left_out]
            for split in range(len(chosen) + 1):
                positional = [values[name] for name in chosen[:split]]
                keywords = {name: values[name] for name in chosen[split:]}
                yield positional, keywords
                yield positional, {**keywords, "unknown": TOKENS[-1]}
                if chosen[:split]:
                    yield positional, {**keywords, chosen[0]: TOKENS[-2]}  # a name given twice
    yield list(TOKENS[: len(names) + 1]), {}  # one positional value too many


def same(left, right):
    """The same bound values: each by identity; a ``*args`` tuple or ``**kwargs`` dict by its items' identities."""
    if left is TypeError or right is TypeError:
        return left is right
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(left[key] is right[key] for key in left)
    if isinstance(left, tuple) and isinstance(right, tuple):
        return len(left) == len(right) and all(
            same(a, b) if isinstance(a, (tuple, dict)) else a is b for a, b in zip(left, right))
    return False


@pytest.mark.parametrize("forward", FORWARDS, ids=lambda f: f.__qualname__)
def test_the_binder_binds_as_inspect_does(forward):
    signature = inspect.signature(forward)
    binder = ArgumentBinder(signature)
    count = 0
    for args, kwargs in calls(signature):
        expected = oracle(signature, args, kwargs)
        try:
            got = binder.values(tuple(args), dict(kwargs))
        except TypeError:
            got = TypeError
        assert same(got, expected), (forward.__qualname__, len(args), sorted(kwargs))
        count += 1
    assert count > 10


def test_the_binder_leaves_its_arguments_untouched():
    signature = inspect.signature(open_keywords)
    kwargs = {"a": TOKENS[0], "extra": TOKENS[1]}
    values = ArgumentBinder(signature).values((TOKENS[2],), kwargs)
    assert values == (TOKENS[2], TOKENS[0], None, {"extra": TOKENS[1]})
    assert kwargs == {"a": TOKENS[0], "extra": TOKENS[1]}
    values = ArgumentBinder(signature).values((TOKENS[2], TOKENS[3]), {"b": TOKENS[0]})
    assert values == (TOKENS[2], TOKENS[3], TOKENS[0], {})
