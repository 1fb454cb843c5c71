"""hf_rocketkv: RocketKV KV-cache compression as a drop-in for Hugging Face transformers.

    import hf_rocketkv                                    # registers attn_implementation="rocketkv"
    from hf_rocketkv import RocketKVCache, RocketKVConfig

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="rocketkv")
    out = model.generate(ids, past_key_values=RocketKVCache(RocketKVConfig(prompt_budget=256, topk=16)))

Data flow: generate -> integration/attention.py (the registered attention function) -> cache/layer.py (the layer
contract) -> cache/stage1.py after prefill, cache/stage2.py per decode step -> policies/ and selection/ (the math,
PyTorch reference) -> kernels/ (Triton twins); pages from memory/ (KVBlockPool). docs/design.md has every floor and
module. Every private transformers symbol used is listed in integration/compat.py; the seam is docs/seam.md.
"""

from .cache import RocketKVCache, RocketKVLayer, SlidingWindowLayer
from .config import RocketKVConfig
from .integration.generate import get_config, set_config
from .integration.names import ATTN_NAME
from .integration.registration import enable, register
from .integration.regions import compile_regions
from .integration.warmup import use_compile_cache, warmup
from .memory import KVBlockPool
from .serving.batch import generate_batch

__version__ = "0.1.0"
__all__ = [
    "ATTN_NAME",
    "KVBlockPool",
    "RocketKVCache",
    "RocketKVConfig",
    "RocketKVLayer",
    "SlidingWindowLayer",
    "compile_regions",
    "enable",
    "generate_batch",
    "get_config",
    "register",
    "set_config",
    "use_compile_cache",
    "warmup",
]

register()
