"""How a caller's ``cfg`` becomes the plain per-row numbers the pool plans with.

The pool's admission methods (``pages_needed``, ``can_admit``, ``admit``, ``admit_batch``, ``check_config``) take a
``cfg`` argument that the pool never reads itself: ``as_budget(cfg, spec)`` (a ``functools.singledispatch``
function) checks it against the pool's ``PoolSpec`` and returns a ``Budget``, whose ``rows`` gives one
``RowDemand`` per row once the rows are validated. The pool therefore knows no compression policy and no config
class; a policy brings its own conversion.

Registered here, the plain-number entry:

    RowDemand                   the same numbers for every row (each row's prompt_len / max_new_tokens must match)
    list or tuple of RowDemand  one per row

``hf_rocketkv.cache`` registers RocketKV's conversion (``cache/page_budget.py``) when it is imported, which
``from hf_rocketkv import KVBlockPool`` (or ``RocketKVCache``, or any serving entry point) does: a RocketKVConfig (or
any object with its fields) becomes the RocketKV page arithmetic, with the KT geometry and per-head-budget checks.
That registration covers every other type too, so this module's own refusal of an unknown type is what a caller sees
only where hf_rocketkv.cache was never imported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

from .accounting import RowDemand


@dataclass(frozen=True)
class PoolSpec:
    """What a conversion may check a request's configuration against: the pool's page geometry and mode.

    page_size     tokens per pool page
    kt_page_size  tokens per KT page of the pool's KT slab
    kt_dtype      the KT slab's dtype name (e.g. "float8_e5m2")
    prefix_reuse  whether prompt pages are hashed and kept for reuse
    """

    page_size: int
    kt_page_size: int
    kt_dtype: str
    prefix_reuse: bool = True


class Budget(Protocol):
    """A checked configuration: the per-row numbers of a batch."""

    def rows(self, prompt_tokens: list[int], new_tokens: list[int], keep_prompt: bool | None) -> list[RowDemand]:
        """One RowDemand per row (inputs already validated); ``keep_prompt`` None: the configuration's default."""


@dataclass(frozen=True)
class Demands:
    """The plain-number budget: RowDemands given by the caller (one for every row, or one per row)."""

    demands: tuple[RowDemand, ...]

    def rows(self, prompt_tokens: list[int], new_tokens: list[int], keep_prompt: bool | None) -> list[RowDemand]:
        demands = list(self.demands) * len(prompt_tokens) if len(self.demands) == 1 else list(self.demands)
        if len(demands) != len(prompt_tokens):
            raise ValueError(f"cfg has {len(self.demands)} RowDemands for {len(prompt_tokens)} rows")
        for row, (demand, length, new) in enumerate(zip(demands, prompt_tokens, new_tokens)):
            if (demand.prompt_tokens, demand.new_tokens) != (length, new):
                raise ValueError(
                    f"RowDemand of row {row} is for {demand.prompt_tokens} prompt + {demand.new_tokens} new tokens, "
                    f"but the row has prompt_len={length}, max_new_tokens={new}")
            if keep_prompt is not None and demand.keep_prompt != keep_prompt:
                raise ValueError(f"keep_all={keep_prompt} contradicts RowDemand.keep_prompt={demand.keep_prompt} "
                                 f"of row {row}")
        return demands


@functools.singledispatch
def as_budget(cfg: Any, spec: PoolSpec) -> Budget:
    """Check ``cfg`` against ``spec`` and return its Budget; ValueError when it cannot be used with the pool."""
    raise ValueError(
        f"cfg must be a RowDemand, a list of RowDemand, or a configuration registered with "
        f"hf_rocketkv.memory.as_budget (importing hf_rocketkv.cache registers RocketKV's); got {type(cfg).__name__}")


@as_budget.register
def _(cfg: RowDemand, spec: PoolSpec) -> Budget:
    return Demands((cfg,))


@as_budget.register(list)
@as_budget.register(tuple)
def _(cfg, spec: PoolSpec) -> Budget:
    if not cfg or not all(isinstance(demand, RowDemand) for demand in cfg):
        return as_budget.dispatch(object)(cfg, spec)  # not plain numbers: whatever handles other objects decides
    return Demands(tuple(cfg))
