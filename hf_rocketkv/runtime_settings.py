"""RuntimeSettings: how this machine runs RocketKV, apart from what the algorithm keeps and reads.

The backend, the decode runners and their buckets, the fused kernels and the prefill rows change speed and memory,
not what is kept and read (at most the kernels' rounding). A ``RocketKVConfig`` holds one as ``config.runtime`` and
reads its fields flat (``config.backend``); the config's constructor, ``replace``, ``to_dict`` and YAML take them flat
too, so error messages name them as users write them: ``RocketKVConfig.<field>``.

The package's ground floor, below config.py: it imports nothing of hf_rocketkv. Every field is described in
docs/configuration.md ("Runtime settings").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

BACKENDS = ("auto", "torch", "triton")
DECODE_GUARD_CHECKS = ("first_step", "every_step")
DECODE_RUNNERS = ("cuda_graphs", "torch_compile")
# how the Triton backend runs a plain layer's stage 2: "split" (page selection, then sparse attention: two ops),
# "fused" (one op: kernels/fused_decode.py, fewer launches) or "auto" (the project's measured choice)
STAGE2_KERNELS = ("auto", "fused", "split")
# Bucket fields (tuples; a YAML/JSON list is turned into one): None picks the runner's default below.
BUCKET_FIELDS = ("capacity_buckets", "batch_buckets")
# decode_runner="torch_compile" with batch_buckets=None: the batch sizes serving engines capture CUDA graphs for
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
SWITCHES = ("deferred_stop_check", "eager_layer_graphs", "fused_rope", "fused_norm", "fused_experts", "fused_mlp",
            "fused_qkv", "fused_residual", "flash_window_prefill")


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is no token count)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RuntimeSettings:
    """How the cache and generate() run on this machine (``RocketKVConfig.runtime``); validated, immutable.

    Change one with ``settings.replace(field=value)`` (validated), or through the config that holds it:
    ``config.replace(backend="torch")``.
    """

    backend: str = "auto"
    capacity_headroom: int = 256
    prefill_batch_size: int | None = None
    decode_guard_checks: str = "every_step"
    decode_runner: str = "cuda_graphs"
    deferred_stop_check: bool = True
    eager_layer_graphs: bool = True
    fused_rope: bool = True
    fused_norm: bool = True
    capacity_buckets: tuple[int, ...] | None = None
    batch_buckets: tuple[int, ...] | None = None
    stage2_kernel: str = "auto"
    fused_experts: bool = True
    fused_mlp: bool = True
    fused_qkv: bool = True
    fused_residual: bool = True
    flash_window_prefill: bool = True

    def __post_init__(self) -> None:
        for name in BUCKET_FIELDS:  # YAML and JSON (model.config.rocketkv) hold lists; the frozen settings a tuple
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, the value and what is allowed (the first failing check)."""
        _check_runtime(self)
        _check_stage2_kernel(self)
        _check_buckets(self)

    def replace(self, **changes: Any) -> RuntimeSettings:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _check_runtime(settings: RuntimeSettings) -> None:
    """capacity_headroom, backend, runners, switches, prefill rows."""
    headroom = settings.capacity_headroom
    if not is_int(headroom):
        raise ValueError(f"RocketKVConfig.capacity_headroom must be an integer, got {headroom!r} "
                         f"({type(headroom).__name__})")
    if settings.backend not in BACKENDS:
        raise ValueError(f"RocketKVConfig.backend must be one of {list(BACKENDS)}, got {settings.backend!r}")
    if headroom < 1:
        raise ValueError(f"RocketKVConfig.capacity_headroom must be >= 1, got {headroom}")
    if settings.decode_guard_checks not in DECODE_GUARD_CHECKS:
        raise ValueError(f"RocketKVConfig.decode_guard_checks must be one of {list(DECODE_GUARD_CHECKS)}, "
                         f"got {settings.decode_guard_checks!r}")
    if settings.decode_runner not in DECODE_RUNNERS:
        raise ValueError(f"RocketKVConfig.decode_runner must be one of {list(DECODE_RUNNERS)}, "
                         f"got {settings.decode_runner!r}")
    for name in SWITCHES:
        if not isinstance(getattr(settings, name), bool):
            raise ValueError(f"RocketKVConfig.{name} must be True or False, got {getattr(settings, name)!r}")
    if (rows := settings.prefill_batch_size) is not None and (not is_int(rows) or rows < 1):
        raise ValueError(f"RocketKVConfig.prefill_batch_size must be None (the whole batch, in row groups "
                         f"when it would not fit in the free memory) or an integer >= 1, "
                         f"got {rows!r}")


def _check_stage2_kernel(settings: RuntimeSettings) -> None:
    if settings.stage2_kernel not in STAGE2_KERNELS:
        raise ValueError(f"RocketKVConfig.stage2_kernel must be one of {list(STAGE2_KERNELS)} (how the Triton backend "
                         f"runs stage 2: \"fused\" one op, \"split\" selection then attention, \"auto\" the "
                         f"measured choice), got {settings.stage2_kernel!r}")


def _check_buckets(settings: RuntimeSettings) -> None:
    """capacity_buckets, batch_buckets: None, or a strictly ascending tuple of integers >= 1 (may be empty)."""
    for name in BUCKET_FIELDS:
        value = getattr(settings, name)
        if value is None:
            continue
        allowed = (f"None (the decode runner's default) or a strictly ascending tuple of integers >= 1, e.g. "
                   f"{DEFAULT_BATCH_BUCKETS if name == 'batch_buckets' else (2048, 4096)} (() turns it off)")
        if not isinstance(value, tuple) or not all(is_int(v) for v in value):
            raise ValueError(f"RocketKVConfig.{name} must be {allowed}, got {value!r}")
        if any(v < 1 for v in value) or any(a >= b for a, b in pairwise(value)):
            raise ValueError(f"RocketKVConfig.{name} must be {allowed}, got {value!r}")
