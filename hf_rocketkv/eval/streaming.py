"""StreamingLLM baseline (attention sinks + recent window): a RocketKVCache whose stage-1 policy is "streaming".

The policy lives in ``hf_rocketkv/policies/streaming.py`` (what it keeps, and how it differs from the paper on
purpose). Stage 2 is unchanged: with ``topk`` at least the number of pages it attends every kept token (see
eval/methods.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import RocketKVConfig

if TYPE_CHECKING:
    from ..cache import RocketKVCache


def streaming_config(config: RocketKVConfig | None = None, sink_tokens: int = 4) -> RocketKVConfig:
    """``config`` with stage 1 keeping ``sink_tokens`` sinks + the most recent tokens."""
    base = config if config is not None else RocketKVConfig()
    return base.replace(stage1="streaming", sink_tokens=sink_tokens)


def StreamingCache(  # noqa: N802 (kept under its old class name)
    config: RocketKVConfig | None = None, sink_tokens: int = 4, **overrides
) -> RocketKVCache:
    """A ``RocketKVCache`` whose stage 1 is the streaming policy."""
    from ..cache import RocketKVCache

    return RocketKVCache(streaming_config(config, sink_tokens), **overrides)
