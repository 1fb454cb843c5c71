"""Stage-1 policies by name: ``get_stage1_policy("snapkv" | "streaming" | ... | policy_object)``."""

from __future__ import annotations

from typing import Callable

# the names and the object test live in config.py, which validates ``stage1`` with them; re-exported here
from ..config import STAGE1_POLICY_NAMES, is_stage1_policy
from .adakv import AdaKVPolicy
from .base import Stage1Policy
from .h2o import H2OPolicy
from .keep_first import KeepFirst
from .knorm import KnormPolicy
from .random_policy import RandomPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingPolicy

__all__ = ["STAGE1_POLICY_NAMES", "get_stage1_policy", "is_stage1_policy"]


def get_stage1_policy(
    spec: str | Stage1Policy,
    *,
    kernel_size: int = 63,
    sink_tokens: int = 4,
    window_scores_fn: Callable | None = None,
    keep_first: int = 0,
) -> Stage1Policy:
    """The policy named ``spec`` (built from the keyword hyper-parameters it uses), or ``spec`` itself when it is
    already a policy object (then the keywords are ignored: the object carries its own).

    kernel_size and window_scores_fn feed SnapKV (also AdaKV's default scorer); sink_tokens feeds streaming.
    keep_first > 0 wraps the policy in ``KeepFirst`` (every row keeps its first ``keep_first`` tokens: stage 2's
    sinks, ``RocketKVConfig.stage2_sink_tokens``); it applies to policy objects too. A policy object that already is
    a ``KeepFirst`` keeps one wrapper, forcing the larger of its count and ``keep_first``.
    """
    policy = _named_or_object(spec, kernel_size, sink_tokens, window_scores_fn)
    return _with_keep_first(policy, keep_first)


def _with_keep_first(policy: Stage1Policy, keep_first: int) -> Stage1Policy:
    """``policy`` forcing at least its row's first ``keep_first`` slots (itself when it already does)."""
    if keep_first == 0:
        return policy
    if isinstance(policy, KeepFirst):
        # one wrapper, not two: the same kept slots (max of the counts) with one check instead of two (each reads
        # its result back from the device)
        return policy if policy.tokens >= keep_first else KeepFirst(policy.policy, keep_first)
    return KeepFirst(policy, keep_first)


def _named_or_object(spec, kernel_size: int, sink_tokens: int, window_scores_fn: Callable | None) -> Stage1Policy:
    if isinstance(spec, str):
        factories: dict[str, Callable[[], Stage1Policy]] = {
            "snapkv": lambda: SnapKVPolicy(kernel_size=kernel_size, scores_fn=window_scores_fn),
            "streaming": lambda: StreamingPolicy(sink_tokens=sink_tokens),
            "knorm": KnormPolicy,
            "h2o": H2OPolicy,
            "adakv": lambda: AdaKVPolicy(SnapKVPolicy(kernel_size=kernel_size, scores_fn=window_scores_fn)),
            "random": RandomPolicy,
        }
        if spec not in factories:
            raise ValueError(
                f"unknown stage-1 policy {spec!r}; allowed: {list(STAGE1_POLICY_NAMES)} or a policy object"
            )
        return factories[spec]()
    if not is_stage1_policy(spec):
        raise ValueError(
            f"a stage-1 policy must be one of {list(STAGE1_POLICY_NAMES)} or an object with a `name` and a "
            f"select(inputs) -> list[KeptSlots] method, got {type(spec).__name__}"
        )
    return spec
