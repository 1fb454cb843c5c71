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

"Equal kept" compares rocketkv, stage1 and streaming (same memory). "Equal read" compares rocketkv, stage2,
stage1_read and streaming_read (same K/V traffic per decode step at the start of decode). stage1_read's budget is
raised to window_size when K*P is smaller (the observation window is always kept).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import DynamicCache

from ..cache.cache import RocketKVCache
from ..config import RocketKVConfig
from .streaming import streaming_config

ALL_PAGES = 1 << 30  # a topk larger than any page count: every stored token is attended
KEEP_ALL = 1 << 30  # a prompt_budget larger than any prompt: stage 1 keeps everything

METHOD_NAMES = ("full", "rocketkv", "stage1", "stage2", "streaming", "stage1_read", "streaming_read")


@dataclass(frozen=True)
class Method:
    name: str
    attn_implementation: str  # "sdpa" (full) or "rocketkv"
    config: RocketKVConfig | None  # None: DynamicCache
    kept_budget: int | None  # prompt tokens kept per KV head, None = all
    read_budget: int | None  # tokens attended per decode step, None = every stored token

    @property
    def streaming(self) -> bool:
        """Stage 1 keeps sinks + recent tokens (the config's stage1 policy is "streaming")."""
        return self.config is not None and self.config.stage1 == "streaming"

    def new_cache(self):
        if self.config is None:
            return DynamicCache()
        return RocketKVCache(self.config)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "attn_implementation": self.attn_implementation,
            "kept_budget": self.kept_budget,
            "read_budget": self.read_budget,
            "config": None if self.config is None else self.config.to_dict(),
        }


def build_method(name: str, base: RocketKVConfig, sink_tokens: int = 4) -> Method:
    read = base.topk * base.page_size
    small = max(read, base.window_size)
    if name == "full":
        return Method(name, "sdpa", None, None, None)
    if name == "rocketkv":
        return Method(name, "rocketkv", base, base.prompt_budget, read)
    if name == "stage1":
        return Method(name, "rocketkv", base.replace(topk=ALL_PAGES), base.prompt_budget, None)
    if name == "stage2":
        return Method(name, "rocketkv", base.replace(prompt_budget=KEEP_ALL), None, read)
    if name == "streaming":
        config = streaming_config(base.replace(topk=ALL_PAGES), sink_tokens)
        return Method(name, "rocketkv", config, base.prompt_budget, None)
    if name == "stage1_read":
        return Method(name, "rocketkv", base.replace(prompt_budget=small, topk=ALL_PAGES), small, None)
    if name == "streaming_read":
        config = streaming_config(base.replace(prompt_budget=small, topk=ALL_PAGES), sink_tokens)
        return Method(name, "rocketkv", config, small, None)
    raise ValueError(f"unknown method {name!r}; known: {list(METHOD_NAMES)}")


def build_methods(names: list[str], base: RocketKVConfig, sink_tokens: int = 4) -> list[Method]:
    if len(set(names)) != len(names):
        raise ValueError(f"methods listed twice: {names}")
    return [build_method(n, base, sink_tokens) for n in names]
