"""memory/: the KV block pool floor (knows nothing of transformers nor of the cache classes).

Public API (docs/memory.md):
    KVBlockPool       the pool: pages, accounting, prefix index, host offload, prefix files
    BlockTable        one request's pages for one purpose ("prompt" or "view")
    Admission         what ``KVBlockPool.admit`` hands a request
    PagesNeeded       ``KVBlockPool.pages_needed``'s answer
    PrefixKeys, MultimodalItem   what besides token ids keys a prefix page (salt, adapter, multimodal inputs)
    Reservation       free pages set aside (row-group prefill admits group by group out of one)
    PoolStats, PageInfo          snapshots
    PoolExhaustedError, PoolStateError, PrefixFileError
    FP8_DTYPE, quantize_pages, quantize_fp8, dequantize_fp8, fp8_scales   the fp8 storage format and its reference
"""

from .accounting import PagesNeeded
from .admission import Admission
from .block_table import BlockTable
from .errors import PoolExhaustedError, PoolStateError, PrefixFileError
from .fp8 import FP8_DTYPE, dequantize_fp8, fp8_scales, quantize_fp8, quantize_pages
from .hashing import MultimodalItem, PrefixKeys
from .layout import LayerShape, RecordLayout
from .page_meta import DEFAULT_PRIORITY, LOADED_PREFIX_PRIORITY, PageInfo
from .pool import KVBlockPool, LoadedPrefix
from .reservation import Reservation
from .stats import PoolStats
from .storage import LayerStorage

__all__ = [
    "DEFAULT_PRIORITY",
    "FP8_DTYPE",
    "LOADED_PREFIX_PRIORITY",
    "Admission",
    "BlockTable",
    "KVBlockPool",
    "LayerShape",
    "LayerStorage",
    "LoadedPrefix",
    "MultimodalItem",
    "PageInfo",
    "PagesNeeded",
    "PoolExhaustedError",
    "PoolStateError",
    "PoolStats",
    "PrefixFileError",
    "PrefixKeys",
    "RecordLayout",
    "Reservation",
    "dequantize_fp8",
    "fp8_scales",
    "quantize_fp8",
    "quantize_pages",
]
