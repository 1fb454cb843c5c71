"""memory/: the KV block pool floor (knows nothing of transformers, of the cache classes or of any config).

Public API (docs/memory.md):
    KVBlockPool       the pool: pages, accounting, prefix index, host offload, prefix files (a facade over
                      core.py, planner.py, prefix_index.py, offload.py, prefix_file.py)
    BlockTable        one request's pages for one purpose ("prompt" or "view")
    Admission         what ``KVBlockPool.admit`` hands a request
    PagesNeeded       ``KVBlockPool.pages_needed``'s answer; RowPages: one row's table sizes
    RowDemand         what one row asks of the pool, in plain numbers: prompt tokens, new tokens, tokens its view
                      holds, the most prompt tokens a prefix hit may cover, tokens its prompt table holds, whether the
                      prompt table is kept. The plain-number entry: pass a RowDemand (or a list, one per row) as
                      ``cfg`` to ``pages_needed`` / ``can_admit`` / ``admit`` / ``admit_batch``.
    as_budget, PoolSpec, Budget   how any other ``cfg`` becomes RowDemands (functools.singledispatch; the cache
                      floor registers RocketKVConfig's conversion in cache/page_budget.py)
    PrefixKeys, MultimodalItem   what besides token ids keys a prefix page (salt, adapter, multimodal inputs)
    Reservation       free pages set aside (row-group prefill admits group by group out of one)
    SlotLease         one row's sliding-window slot (a model with sliding layers: ``Admission.slot``, sliding_slab.py;
                      how a pool splits its bytes by layer kind: hybrid.py)
    PoolStats, PageInfo          snapshots
    PoolSize, auto_pool_size, pool_bytes   a pool's size when none is given (sizing.py): a fraction of the free
                      device memory (CUDA) or of the available RAM
    PoolExhaustedError, PoolStateError, PrefixFileError
    FP8_DTYPE, quantize_pages, quantize_fp8, dequantize_fp8, fp8_scales   the fp8 storage format and its reference
"""

from .accounting import PagesNeeded, RowDemand, RowPages
from .admission import Admission
from .block_table import BlockTable
from .budget import Budget, PoolSpec, as_budget
from .errors import PoolExhaustedError, PoolStateError, PrefixFileError
from .fp8 import FP8_DTYPE, dequantize_fp8, fp8_scales, quantize_fp8, quantize_pages
from .hashing import MultimodalItem, PrefixKeys
from .layout import LayerShape, RecordLayout
from .page_meta import DEFAULT_PRIORITY, LOADED_PREFIX_PRIORITY, PageInfo
from .pool import KVBlockPool
from .prefix_file import LoadedPrefix
from .reservation import Reservation
from .sizing import PoolSize, auto_pool_size, model_prefill_reserve, pool_bytes, prefill_reserve_bytes
from .sliding_slab import SlotLease
from .stats import PoolStats
from .storage import LayerStorage

__all__ = [
    "DEFAULT_PRIORITY",
    "FP8_DTYPE",
    "LOADED_PREFIX_PRIORITY",
    "Admission",
    "BlockTable",
    "Budget",
    "KVBlockPool",
    "LayerShape",
    "LayerStorage",
    "LoadedPrefix",
    "MultimodalItem",
    "PageInfo",
    "PagesNeeded",
    "PoolExhaustedError",
    "PoolSize",
    "PoolSpec",
    "PoolStateError",
    "PoolStats",
    "PrefixFileError",
    "PrefixKeys",
    "RecordLayout",
    "Reservation",
    "RowDemand",
    "RowPages",
    "SlotLease",
    "as_budget",
    "auto_pool_size",
    "model_prefill_reserve",
    "prefill_reserve_bytes",
    "dequantize_fp8",
    "fp8_scales",
    "pool_bytes",
    "quantize_fp8",
    "quantize_pages",
]
