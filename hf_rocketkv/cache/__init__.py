"""cache/: the KV cache floor (below integration, above memory and policies).

Public API (what serving/, eval/, bench/ and the CLI import; integration/ may use the modules directly):
    RocketKVCache       transformers ``Cache`` of RocketKV layers (cache.py)
    RocketKVLayer       one decoder layer's KV store (layer.py)
    GenerationHints     what generate() tells a cache before prefill (hints.py)
    BatchedDecodeCache  one decode batch over the rows of several pool-backed caches (batch_view.py)
    PackedStepCache     the decode rows of a batch and one prompt chunk in one forward (packed_step.py)
    CacheStats          ``cache.stats``: tokens reused and computed, bytes moved (stats.py)
    layer_of            the layer whose ``update()`` returned a key tensor (the attention function's seam, seam.py)
    request_pages       a request's pool pages at its prefill peak and once compressed (page_budget.py)
    check_pool_policy   refuse a config a pool cannot account for (per-head budgets, per-layer layouts)
    pool_policy_refusal the same refusal as one short phrase naming the field (None when a pool can)
    decode_read_bytes   bytes one decode step reads from a layer (read_accounting.py; benchmarks' GB/s)
    SlidingWindowLayer  a sliding-window layer's store: its last tokens, dense, then its decode ring (sliding_layer.py)
    sliding_windows     each layer's sliding window from a model config, None = full attention (memory/layer_kinds.py)
    chunked_layers      which of those windows are attention chunks (Llama 4; memory/layer_kinds.py)
    position_scaled_layers  the layers whose attention scales its queries by position (Llama 4's NoPE layers)
"""

from ..memory.layer_kinds import chunked_layers, position_scaled_layers, sliding_windows
from .batch_view import BatchedDecodeCache
from .cache import RocketKVCache
from .layer import GenerationHints, RocketKVLayer, layer_of
from .packed_step import PackedStepCache
from .page_budget import check_pool_policy, pool_policy_refusal, request_pages
from .read_accounting import decode_read_bytes
from .sliding_layer import SlidingWindowLayer
from .stats import CacheStats

__all__ = ["BatchedDecodeCache", "CacheStats", "GenerationHints", "PackedStepCache", "RocketKVCache", "RocketKVLayer",
           "SlidingWindowLayer", "check_pool_policy", "chunked_layers", "decode_read_bytes", "layer_of",
           "pool_policy_refusal", "position_scaled_layers", "request_pages", "sliding_windows"]
