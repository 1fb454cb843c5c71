"""The methods compared on the same samples, all derived from one RocketKVConfig ``base``.

Budgets, per layer and KV head (P = base.page_size, B = base.prompt_budget, K = base.topk):

    kept tokens  prompt tokens stored after prefill (stage 1); generated tokens are always appended on top
    read tokens  stored tokens whose K/V the attention reads at a decode step (stage 2; KT summaries not counted)

| method          | cache                                    | kept          | read per step        |
|-----------------|------------------------------------------|---------------|----------------------|
| full            | sdpa + DynamicCache                      | all           | all                  |
| rocketkv        | RocketKVCache(base): both stages         | B             | K*P                  |
| stage1          | SnapKV eviction only (topk = all pages)  | B             | all kept (B + gen.)  |
| stage2          | page top-k only (prompt_budget = inf)    | all           | K*P                  |
| streaming       | stage1="streaming": 4 sinks + recent     | B             | all kept (B + gen.)  |
| stage1_read     | SnapKV eviction to K*P tokens            | K*P           | all kept (K*P + gen.)|
| streaming_read  | sink + recent to K*P tokens              | K*P           | all kept (K*P + gen.)|
| full_bf16kv     | full cache stored in bf16 pages          | all           | all                  |
| full_fp8kv      | full cache in fp8 e4m3 pages, scale/page | all           | all                  |
| full_fp8kv_head | the same, one scale per page and KV head | all           | all                  |
| rocketkv_fp8kv  | rocketkv on a KVBlockPool of fp8 pages   | B             | K*P                  |
| rocketkv_fp8kv_head | the same, one scale per page and KV head | B         | K*P                  |

The ``full_*kv`` methods measure what a KVBlockPool storage dtype costs in fidelity (``eval/kv_formats.py``: pages
of 16 tokens re-quantized as they fill, exactly the pool's rule), against ``full`` in the model's own dtype. The
``rocketkv_fp8kv*`` methods run RocketKVCache itself on a ``KVBlockPool(dtype=torch.float8_e4m3fn)`` sized for the
prompt (``kv_formats.fp8_pool``): RocketKV's compression and the pool's fp8 pages together.

"Equal kept" compares rocketkv, stage1 and streaming (same memory). "Equal read" compares rocketkv, stage2,
stage1_read and streaming_read (same K/V traffic per decode step at the start of decode). stage1_read's budget is
raised to window_size when K*P is smaller (the observation window is always kept).

Policy comparisons (docs/policies.md; POLICY below is one of snapkv, streaming, knorm, h2o, adakv, random):

| method                 | stage 1            | kept          | stage 2                                      | read per step        |
|------------------------|--------------------|---------------|----------------------------------------------|----------------------|
| evict:POLICY           | POLICY             | B             | none (every kept token)                      | all kept (B + gen.)  |
| evict_read:POLICY      | POLICY             | K*P           | none                                         | all kept (K*P + gen.)|
| rocketkv:POLICY        | POLICY             | B             | page top-k with base's stage-2 options       | K*P                  |
| rocketkv_plain[:POLICY]| POLICY (snapkv)    | B             | page top-k, no forced sinks / recent window  | K*P                  |
| stage2_plain           | keep all           | all           | page top-k, no forced sinks / recent window  | K*P                  |

Any method takes config overrides after "@": ``rocketkv@prompt_budget=256,topk=16`` or
``rocketkv@stage2_sink_tokens=4,stage2_recent_tokens=64`` builds the method from ``base`` with those fields changed
(validated like --set; integer values, or names for stage2/stage1), so one run can compare budgets and stage-2
options on the same samples, sharing the prefill and the full-cache reference.

"rocketkv" and "stage2" use base's stage-2 options as configured (``stage2_sink_tokens``, ``stage2_recent_tokens``);
the "_plain" variants switch them off, so one run compares RocketKV with and without them. When a method forces
sink tokens, the cache layer makes its stage 1 keep the prompt's first s tokens so that the sink pages hold them
(``RocketKVConfig.stage1_keep_first``; docs/policies.md); its stage-1 label reads ``POLICY+keep_first=s``. The
baselines that read everything they keep carry no stage-2 options, like kvpress' presses: the evict ones, and
stage1, streaming, stage1_read and streaming_read (every kept page attended, so no stage-1 sinks forced either).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import STAGE1_POLICY_NAMES, RocketKVConfig
from .streaming import streaming_config

# Methods are named, built and checked without torch or transformers (the command line checks them before anything
# heavy loads); the caches they make import what they need in new_cache().

ALL_PAGES = 1 << 30  # a topk larger than any page count: every stored token is attended
KEEP_ALL = 1 << 30  # a prompt_budget larger than any prompt: stage 1 keeps everything

METHOD_NAMES = ("full", "rocketkv", "stage1", "stage2", "streaming", "stage1_read", "streaming_read", "full_bf16kv",
                "full_fp8kv", "full_fp8kv_head", "rocketkv_fp8kv", "rocketkv_fp8kv_head")
ROCKETKV_POOL_METHODS = {"rocketkv_fp8kv": "fp8_page", "rocketkv_fp8kv_head": "fp8_head"}
KV_FORMAT_METHODS = {"full_bf16kv": "bf16", "full_fp8kv": "fp8_page", "full_fp8kv_head": "fp8_head"}
POLICY_METHODS = ("evict", "evict_read", "rocketkv", "rocketkv_plain")  # used as KIND:POLICY
PLAIN_METHODS = ("rocketkv_plain", "stage2_plain")


@dataclass(frozen=True)
class Method:
    name: str
    attn_implementation: str  # "sdpa" (full) or "rocketkv"
    config: RocketKVConfig | None  # None: DynamicCache
    kept_budget: int | None  # prompt tokens kept per KV head, None = all
    read_budget: int | None  # tokens attended per decode step, None = every stored token
    kv_format: str | None = None  # full: stored as bf16 / fp8 pages (kv_formats.py); rocketkv: on an fp8 pool

    @property
    def streaming(self) -> bool:
        """Stage 1 keeps sinks + recent tokens (the config's stage1 policy is "streaming")."""
        return self.config is not None and _policy_name(self.config.stage1) == "streaming"

    @property
    def needs_full_prefill(self) -> bool:
        """The stage-1 policy scores with every prompt query (H2O): the shared dense prefix cannot be used."""
        return self.config is not None and _accumulates(self.config.stage1)

    def new_cache(self, model=None, tokens: int | None = None):
        """A fresh cache; ``model`` and ``tokens`` (prompt + new tokens) size the fp8 pool of ``rocketkv_fp8kv*``."""
        from ..cache import RocketKVCache

        if self.config is None:
            from transformers import DynamicCache

            from .kv_formats import RoundTripCache

            return DynamicCache() if self.kv_format is None else RoundTripCache(self.kv_format)
        if self.kv_format is None:  # the model's layers: sliding ones, and budget_schedule's shares
            return RocketKVCache(self.config, model_config=model.config if model is not None else None)
        if model is None or tokens is None:
            raise ValueError(f"method {self.name!r} runs on a KVBlockPool: new_cache needs the model and the tokens")
        from .kv_formats import fp8_pool

        return RocketKVCache(self.config, pool=fp8_pool(model, self.config, self.kv_format, tokens))

    def read_tokens(self, stored: int) -> int:
        """Tokens one decode step reads (per layer and KV head) with ``stored`` tokens in the cache."""
        return stored if self.read_budget is None else min(self.read_budget, stored)

    def describe(self) -> dict:
        config = None
        if self.config is not None:
            config = self.config.to_dict()
            config["stage1"] = _policy_label(self.config)  # JSON-safe: a name, with its forced sinks
        return {
            "name": self.name,
            "attn_implementation": self.attn_implementation,
            "kept_budget": self.kept_budget,
            "read_budget": self.read_budget,
            "kv_format": self.kv_format,
            "config": config,
        }


def _policy_name(stage1) -> str:
    return stage1 if isinstance(stage1, str) else stage1.name


def _policy_label(config: RocketKVConfig) -> str:
    """The stage-1 policy's name, with the first tokens it keeps whether a ``KeepFirst`` object or the cache layer
    (``stage1_keep_first``) forces them: the layer keeps the larger count."""
    stage1 = config.stage1
    keep_first = 0
    if not isinstance(stage1, str):  # a policy object: the policies are loaded already
        from ..policies import KeepFirst

        keep_first = stage1.tokens if isinstance(stage1, KeepFirst) else 0
    tokens = max(keep_first, config.stage1_keep_first)
    return _policy_name(stage1) + (f"+keep_first={tokens}" if tokens else "")


def _accumulates(stage1) -> bool:
    if isinstance(stage1, str):
        return stage1 == "h2o"
    return hasattr(stage1, "accumulate")


def _plain(config: RocketKVConfig) -> RocketKVConfig:
    """RocketKV's own stage 2: no forced sinks, only the newest page forced."""
    return config.replace(stage2_sink_tokens=0, stage2_recent_tokens=0)


def _every_kept_page(config: RocketKVConfig) -> RocketKVConfig:
    """Stage 2 attends every kept page (topk above any page count), so forced pages would change nothing: they are
    dropped, and with them the sinks stage 1 would otherwise keep (``stage1_keep_first``), so these baselines keep
    what their policy alone picks."""
    return _plain(config).replace(topk=ALL_PAGES)


def _evicting(config: RocketKVConfig, policy: str, budget: int) -> RocketKVConfig:
    """Eviction only (stage2="none"): ``policy`` keeps ``budget`` prompt tokens and every kept token is read."""
    return _plain(config).replace(prompt_budget=budget, stage1=policy, stage2="none")


def _build_policy_method(kind: str, policy: str, base: RocketKVConfig) -> Method:
    if policy not in STAGE1_POLICY_NAMES:
        raise ValueError(f"unknown stage-1 policy {policy!r} in method '{kind}:{policy}'; allowed: "
                         f"{list(STAGE1_POLICY_NAMES)}")
    name = f"{kind}:{policy}"
    read = base.topk * base.page_size
    if kind == "evict":
        return Method(name, "rocketkv", _evicting(base, policy, base.prompt_budget), base.prompt_budget, None)
    if kind == "evict_read":
        small = max(read, base.window_size)
        return Method(name, "rocketkv", _evicting(base, policy, small), small, None)
    config = _plain(base) if kind == "rocketkv_plain" else base
    return Method(name, "rocketkv", config.replace(stage1=policy), base.prompt_budget, read)


def parse_overrides(name: str, text: str) -> dict:
    """``"prompt_budget=256,topk=16"`` -> ``{"prompt_budget": 256, "topk": 16}`` (values: integers or names)."""
    changes = {}
    for item in text.split(","):
        field, sep, value = item.partition("=")
        if not sep or not field.strip() or not value.strip():
            raise ValueError(f"expected FIELD=VALUE[,FIELD=VALUE...] after '@', got {item!r}")
        value = value.strip()
        changes[field.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return changes


def build_method(name: str, base: RocketKVConfig, sink_tokens: int = 4) -> Method:
    """The method ``name`` (tables above), optionally ``NAME@FIELD=VALUE,...`` with config overrides."""
    plain_name, sep, overrides = name.partition("@")
    if sep:
        try:
            base = RocketKVConfig.from_dict({**base.to_dict(), **parse_overrides(name, overrides)})
        except ValueError as err:
            raise ValueError(f"method {name!r}: {err}") from err
        return dataclasses.replace(_build_method(plain_name, base, sink_tokens), name=name)
    return _build_method(name, base, sink_tokens)


def _build_method(name: str, base: RocketKVConfig, sink_tokens: int = 4) -> Method:
    read = base.topk * base.page_size
    small = max(read, base.window_size)
    if name == "full":
        return Method(name, "sdpa", None, None, None)
    if name in KV_FORMAT_METHODS:
        return Method(name, "sdpa", None, None, None, kv_format=KV_FORMAT_METHODS[name])
    kind, sep, policy = name.partition(":")
    if sep:
        if kind not in POLICY_METHODS:
            raise ValueError(f"unknown method {name!r}; KIND:POLICY takes KIND in {list(POLICY_METHODS)}")
        return _build_policy_method(kind, policy, base)
    if name == "rocketkv":
        return Method(name, "rocketkv", base, base.prompt_budget, read)
    if name in ROCKETKV_POOL_METHODS:
        from ..cache import check_pool_policy

        try:  # refused by the pool at the first cache: say so before any model runs
            check_pool_policy(base)
        except ValueError as err:
            raise ValueError(f"method {name!r} runs on an fp8 KVBlockPool: {err}") from None
        if base.token_budget is not None:
            raise ValueError(f"method {name!r} runs on an fp8 KVBlockPool, which refuses token_budget (it fixes the "
                             f"page size before prefill); set prompt_budget / topk / page_size instead")
        return Method(name, "rocketkv", base, base.prompt_budget, read, kv_format=ROCKETKV_POOL_METHODS[name])
    if name == "rocketkv_plain":
        return dataclasses.replace(_build_policy_method("rocketkv_plain", base.stage1, base), name=name)
    if name == "stage2_plain":
        return Method(name, "rocketkv", _plain(base).replace(prompt_budget=KEEP_ALL), None, read)
    if name == "stage1":
        return Method(name, "rocketkv", _every_kept_page(base), base.prompt_budget, None)
    if name == "stage2":
        return Method(name, "rocketkv", base.replace(prompt_budget=KEEP_ALL), None, read)
    if name == "streaming":
        config = streaming_config(_every_kept_page(base), sink_tokens)
        return Method(name, "rocketkv", config, base.prompt_budget, None)
    if name == "stage1_read":
        return Method(name, "rocketkv", _every_kept_page(base).replace(prompt_budget=small), small, None)
    if name == "streaming_read":
        config = streaming_config(_every_kept_page(base).replace(prompt_budget=small), sink_tokens)
        return Method(name, "rocketkv", config, small, None)
    raise ValueError(
        f"unknown method {name!r}; known: {list(METHOD_NAMES + PLAIN_METHODS)} or KIND:POLICY with KIND in "
        f"{list(POLICY_METHODS)} and POLICY in {list(STAGE1_POLICY_NAMES)}"
    )


def build_methods(names: list[str], base: RocketKVConfig, sink_tokens: int = 4) -> list[Method]:
    if len(set(names)) != len(names):
        raise ValueError(f"methods listed twice: {names}")
    return [build_method(n, base, sink_tokens) for n in names]
