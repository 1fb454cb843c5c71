"""hf_rocketkv: RocketKV KV-cache compression as a drop-in for Hugging Face transformers.

    import hf_rocketkv                                    # registers attn_implementation="rocketkv"
    from hf_rocketkv import RocketKVCache, RocketKVConfig

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="rocketkv")
    out = model.generate(ids, cache=RocketKVCache(RocketKVConfig(prompt_budget=256, topk=16)))

Data flow: generate -> integration/attention.py (the registered attention function) -> cache/layer.py (the layer
contract) -> cache/stage1.py after prefill, cache/stage2.py per decode step -> policies/ and selection/ (the math,
PyTorch reference) -> kernels/ (Triton twins); pages from memory/ (KVBlockPool). docs/design.md has every floor and
module. Every private transformers symbol used is listed in integration/compat.py; the seam is docs/seam.md.

Importing the package is cheap: the public names below load their modules on first use, and the registration with
transformers (the ``rocketkv`` attention, the generate() hooks) happens as soon as transformers' model code is loaded,
at once when it already is (integration/import_hook.py).
"""

from __future__ import annotations

import importlib

from .integration.import_hook import register_when_loaded
from .integration.names import ATTN_NAME

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use)
_PUBLIC = {
    "KVBlockPool": ".cache.page_budget",  # memory's class, loaded with the cache, which teaches it RocketKVConfig
    "RocketKVCache": ".cache",
    "RocketKVConfig": ".config",
    "RocketKVLayer": ".cache",
    "RuntimeSettings": ".runtime_settings",
    "SlidingWindowLayer": ".cache",
    "compile_regions": ".integration.regions",
    "enable": ".integration.registration",
    "generate_batch": ".serving.batch",
    "get_config": ".integration.generate",
    "register": ".integration.registration",
    "set_config": ".integration.generate",
    "use_compile_cache": ".integration.warmup",
    "warm_up_engine": ".serving.warm_start",
    "warmup": ".integration.warmup",
}
_SUBPACKAGES = ("bench", "cache", "cli", "config", "data", "eval", "host_copy", "integration", "kernels", "memory",
                "models", "policies", "runtime_settings", "selection", "serving")

__all__ = ["ATTN_NAME", *sorted(_PUBLIC)]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:  # hf_rocketkv.cache without importing it first, as with an eager package
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})


def _register() -> None:
    from .integration.registration import register

    register()


register_when_loaded(_register)
