"""RocketKV's page arithmetic: the one place where a RocketKVConfig becomes what a request asks of a KVBlockPool.

The pool (memory/) plans with plain per-row numbers (``memory.RowDemand``) and reads no config field. For one row of
P prompt tokens and N new tokens, in pool pages of p tokens (docs/memory.md, "Accounting" and "Hit cap"):

    kept                 min(P, prompt_budget)          prompt tokens a row keeps after stage 1
    view_tokens          kept + N                        the survivors and every generated token
    prompt_table_tokens  P, or P + N with keep_all       RocketKV-MT keeps the whole conversation
    hit_cap_tokens       floor((P - window_size) / p) * p when stage 1 will evict (P > prompt_budget),
                         else floor((P - 1) / p) * p    stage 1 needs the queries of the last window_size tokens
    N at admission       config.decode_headroom(max_new_tokens)   (decode-time compression bounds the view)

``check_pool_config`` refuses a config whose KT geometry differs from the pool's KT slab or whose stage-1 policy has
per-head budgets (``check_pool_policy``). Importing this module (``hf_rocketkv.cache`` does, and
``from hf_rocketkv import KVBlockPool`` imports it) registers both with ``memory.as_budget``, so
``pool.pages_needed(P, N, cfg)``, ``pool.can_admit``, ``pool.admit``, ``pool.admit_batch`` and ``pool.check_config``
take a RocketKVConfig. Any other
object goes through the same conversion: one with the config's fields works, one without is refused naming the
fields it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import RocketKVConfig
from ..memory import KVBlockPool, PoolSpec, RowDemand, RowPages, as_budget

__all__ = ["check_pool_config", "check_pool_policy", "decode_tokens", "hit_cap_tokens", "pool_policy_refusal",
           "request_pages", "row_demand"]

CONFIG_FIELDS = ("prompt_budget", "page_size", "window_size", "kt_cache_dtype")


def hit_cap_tokens(prompt_len: int, page_size: int, window_size: int | None, prompt_budget: int | None) -> int:
    """The most prompt tokens a prefix hit may cover (page aligned).

    Stage 1 scores the prompt with the queries of its last ``window_size`` tokens and queries are never cached, so
    when stage 1 will evict (``prompt_len > prompt_budget``) those tokens are always recomputed; otherwise only the
    last token is (its logits start generation). Without a window or a budget only the last-token rule applies.
    """
    evicts = window_size is not None and prompt_budget is not None and prompt_len > prompt_budget
    recompute = window_size if evicts else 1
    return max(0, (prompt_len - recompute) // page_size * page_size)


def row_demand(config: RocketKVConfig, prompt_len: int, max_new_tokens: int, page_size: int,
               keep_all: bool | None = None) -> RowDemand:
    """One row's demand on a pool of ``page_size``-token pages (module docstring); ``keep_all`` None: the config's
    ``multi_turn == "keep_all"``."""
    if keep_all is None:
        keep_all = getattr(config, "multi_turn", "evict") == "keep_all"
    kept = min(prompt_len, config.prompt_budget)
    return RowDemand(
        prompt_tokens=prompt_len,
        new_tokens=max_new_tokens,
        view_tokens=kept + max_new_tokens,
        hit_cap_tokens=hit_cap_tokens(prompt_len, page_size, config.window_size, config.prompt_budget),
        prompt_table_tokens=prompt_len + max_new_tokens if keep_all else prompt_len,
        keep_prompt=keep_all,
    )


def request_pages(config: RocketKVConfig, pool: KVBlockPool | PoolSpec, prompt_len: int, max_new_tokens: int, *,
                  keep_all: bool | None = None) -> RowPages:
    """One row's pages at its cold prefill peak and once compressed (``RowPages``), in ``pool``'s pages (a pool, or
    anything with its ``page_size`` and ``prefix_reuse``, e.g. a ``PoolSpec`` when the pool is not built yet).

    ``keep_all``: keep the whole conversation (default: ``config.multi_turn == "keep_all"``). A pool of a model
    whose layers all slide holds no pages (each row takes a sliding-window slot only): no pages."""
    if isinstance(pool, KVBlockPool) and pool.has_sliding_layers and not pool.hybrid.global_layers:
        return RowPages(0, 0, 0, 0)
    demand = row_demand(config, prompt_len, max_new_tokens, pool.page_size, keep_all)
    return demand.pages(pool.page_size, pool.prefix_reuse)


def decode_tokens(config: RocketKVConfig, max_new_tokens: int) -> int:
    """Generated tokens a view must hold for ``max_new_tokens``: all of them, or fewer with decode-time compression
    (``RocketKVConfig.decode_headroom``)."""
    return config.decode_headroom(max_new_tokens)


PER_LAYER_LAYOUTS = (("dense_layers", 0), ("budget_schedule", "flat"))  # fields a pool needs at these values


def _pool_policy_problem(cfg: RocketKVConfig) -> tuple[str, Any, Any] | None:
    """The first field a pool cannot account for: ``(name, value, the value a pool needs)`` for a per-layer layout
    (``PER_LAYER_LAYOUTS``: the pool lays out every layer alike), ``("stage1", policy name, None)`` for per-head
    budgets (AdaKV); None when a pool can."""
    for name, plain in PER_LAYER_LAYOUTS:
        value = getattr(cfg, name, plain)
        if value != plain:
            return name, value, plain
    if getattr(cfg, "per_head_budgets", False):
        return "stage1", getattr(cfg.stage1, "name", cfg.stage1), None
    return None


def pool_policy_refusal(cfg: RocketKVConfig) -> str | None:
    """Why a pool cannot account for ``cfg``, as one short phrase naming the field (the first such field), or None.
    ``check_pool_policy`` raises the long form of the same refusal."""
    problem = _pool_policy_problem(cfg)
    if problem is None:
        return None
    name, value, _ = problem
    if name == "stage1":
        return f"stage1={value!r} (each KV head keeps its own number of tokens, which pool pages cannot account for)"
    return f"{name}={value!r} (a pool gives every layer the same budgets and pages)"


def check_pool_policy(cfg: RocketKVConfig) -> None:
    """Refuse a config a pool cannot account for (``KVBlockPool.check_config``; the serve CLI and the eval harness
    call it before loading a model): the ValueError names the field of ``pool_policy_refusal`` and the way out."""
    problem = _pool_policy_problem(cfg)
    if problem is None:
        return
    name, value, plain = problem
    if name == "stage1":
        raise ValueError(
            f"RocketKVConfig.stage1={value!r} gives each KV head its own number "
            f"of kept tokens, which a KVBlockPool does not account for: a pool page holds every KV head of a row, "
            f"so admission would have to reserve the longest head's count for all of them. Use this policy "
            f"without pool= (RocketKVCache(cfg) stores per-head lengths), or a uniform policy with the pool "
            f"(snapkv, streaming, knorm, h2o, random)"
        )
    raise ValueError(
        f"RocketKVConfig.{name}={value!r}: a KVBlockPool (and the batching engine on it) gives every layer the "
        f"same budgets and pages; use RocketKVCache(config) without a pool (generate(), the sequential "
        f"engine), or {name}={plain!r}")


def check_pool_config(cfg: Any, spec: PoolSpec) -> None:
    """Refuse a RocketKVConfig a pool of ``spec`` cannot serve: fields missing, another KT page size or KT dtype
    than the pool's KT slab, per-head budgets."""
    missing = [name for name in CONFIG_FIELDS if not hasattr(cfg, name)]
    if missing:
        raise ValueError(f"cfg must be a RocketKVConfig; {type(cfg).__name__} lacks {missing}")
    if cfg.page_size != spec.kt_page_size:
        raise ValueError(
            f"RocketKVConfig.page_size (tokens per KT page) is {cfg.page_size}, but this pool's KT slab holds KT "
            f"pages of KVBlockPool.kt_page_size={spec.kt_page_size} tokens (KVBlockPool.page_size, tokens per "
            f"pool page, is {spec.page_size}); build the pool with kt_page_size={cfg.page_size} or use "
            f"RocketKVConfig(page_size={spec.kt_page_size})"
        )
    check_pool_policy(cfg)
    if cfg.kt_cache_dtype != spec.kt_dtype:
        raise ValueError(
            f"RocketKVConfig.kt_cache_dtype is {cfg.kt_cache_dtype!r}, but this pool's KT slab is "
            f"KVBlockPool.kt_dtype={spec.kt_dtype!r}; build the pool with "
            f"kt_dtype={cfg.kt_cache_dtype!r} or use RocketKVConfig(kt_cache_dtype={spec.kt_dtype!r})"
        )


@dataclass(frozen=True)
class RocketKVBudget:
    """A RocketKVConfig checked against a pool: ``memory.Budget`` of its rows (``row_demand`` for each)."""

    config: Any
    page_size: int

    def rows(self, prompt_tokens: list[int], new_tokens: list[int], keep_prompt: bool | None) -> list[RowDemand]:
        return [row_demand(self.config, length, new, self.page_size, keep_prompt)
                for length, new in zip(prompt_tokens, new_tokens)]


@as_budget.register(RocketKVConfig)
@as_budget.register(object)  # any other object: checked for the config's fields (refused naming those it lacks)
def rocketkv_budget(cfg: Any, spec: PoolSpec) -> RocketKVBudget:
    check_pool_config(cfg, spec)
    return RocketKVBudget(cfg, spec.page_size)
