"""How many bytes of pages a KVBlockPool takes when no size is given: a fraction of the memory that is free.

The rule (``pool_bytes``) is a plain function of the device type, the free bytes and a fraction:

    CUDA          fraction x (free device memory - prefill reserve), fraction 0.9 by default (TensorRT-LLM's
                  ``free_gpu_memory_fraction``; vLLM's ``gpu_memory_utilization`` is a share of the whole GPU, weights
                  included): measured after the model is loaded, so the weights are already counted out. The
                  prefill reserve (``prefill_reserve_bytes``, given by the pool from the model's config) is what a
                  prompt of ``PREFILL_RESERVE_TOKENS`` needs outside the pool while it is prefilled: its dense K/V
                  in every layer until stage 1, and the activations of one ``PREFILL_RESERVE_CHUNK``-token forward.
                  The other 10% of the rest is left for CUDA graphs, the allocator's fragmentation and other
                  processes. Without the reserve the default left too little for long prompts (64 x 32k at
                  Llama-3.1-8B shapes on an H100: out of memory in the first prefill chunk, docs/pool-cache.md).
    CPU (other)   fraction x available RAM (MemAvailable in /proc/meminfo, within a cgroup memory limit; psutil's
                  ``available`` where there is no /proc), fraction 0.25 by default, and the default capped at
                  ``HOST_DEFAULT_CAP`` (2 GiB): the pages are filled when first used, so they take real RAM from
                  every other process, and a CPU serves small models. A fraction given explicitly is not capped.

``free_bytes(device)`` reads the free memory; ``auto_pool_size(device, fraction)`` applies the rule and says how it
chose (``PoolSize.describe()``, the line ``hf-rocketkv serve`` prints at start).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .geometry import ModelGeometry, model_geometry, split_model_and_config

DEVICE_FRACTION = 0.9  # CUDA: of the free device memory, as TensorRT-LLM's free_gpu_memory_fraction default
HOST_FRACTION = 0.25  # CPU: of the available RAM
HOST_DEFAULT_CAP = 2 << 30  # CPU: the default fraction never takes more than this
GIB = 1 << 30
PREFILL_RESERVE_TOKENS = 32768  # CUDA: the prompt whose prefill the default size leaves room for, outside the pool
PREFILL_RESERVE_CHUNK = 8192  # tokens per prefill forward counted in the reserve (the batching engine's default chunk)


def prefill_reserve_bytes(num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int,
                          intermediate_size: int, dtype_bytes: int, tokens: int = PREFILL_RESERVE_TOKENS,
                          chunk: int = PREFILL_RESERVE_CHUNK) -> int:
    """Device bytes a prefill of ``tokens`` takes outside the pool: the prompt's dense K and V in every layer
    (``2 x layers x kv_heads x head_dim x tokens x bytes``, kept until stage 1 writes the survivors into pages) plus
    one forward of ``chunk`` tokens' activations, counted as ``chunk x (8 x hidden + 4 x intermediate) x bytes`` (the
    residual stream, normed input, q/k/v, attention output, and the MLP's gate, up and product; an upper bound of what
    eager transformers holds at once)."""
    dense_kv = 2 * num_layers * num_kv_heads * head_dim * tokens * dtype_bytes
    activations = chunk * (8 * hidden_size + 4 * intermediate_size) * dtype_bytes
    return dense_kv + activations


def check_fraction(fraction: float, field: str = "kv_memory_fraction") -> float:
    """``fraction`` if it is a number in (0, 1], else ValueError naming ``field``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"{field} must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def default_fraction(device_type: str) -> float:
    """The fraction of free memory the pool takes when none is given: 0.9 on CUDA, 0.25 elsewhere (host RAM)."""
    return DEVICE_FRACTION if device_type == "cuda" else HOST_FRACTION


def pool_bytes(device_type: str, free: int, fraction: float | None = None) -> int:
    """The rule: ``floor(fraction x free)`` bytes, ``fraction`` defaulting by device type (``default_fraction``);
    on a device other than CUDA the default is capped at ``HOST_DEFAULT_CAP``. ``free``: free bytes of that device
    (host RAM for the CPU)."""
    if isinstance(free, bool) or not isinstance(free, int) or free < 0:
        raise ValueError(f"free memory must be an integer number of bytes >= 0, got {free!r}")
    given = fraction is not None
    fraction = check_fraction(fraction) if given else default_fraction(device_type)
    size = int(free * fraction)
    if device_type != "cuda" and not given:
        size = min(size, HOST_DEFAULT_CAP)
    return size


def meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable of ``/proc/meminfo`` in bytes, None when the file or the line is missing."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            parts = value.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * 1024  # kB
    return None


def cgroup_memory_left(folder: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes a cgroup v2 memory limit still allows (``memory.max - memory.current``), None when unlimited or
    unknown (containers report the host's MemAvailable, not their limit)."""
    try:
        limit = (folder / "memory.max").read_text().strip()
        current = (folder / "memory.current").read_text().strip()
    except OSError:
        return None
    if limit == "max" or not limit.isdigit() or not current.isdigit():
        return None
    return max(0, int(limit) - int(current))


def host_available() -> int:
    """Available host RAM in bytes: MemAvailable within any cgroup limit, else psutil's ``available``."""
    available = meminfo_available()
    if available is None:
        try:
            import psutil
        except ImportError:
            psutil = None
        if psutil is not None:
            available = int(psutil.virtual_memory().available)
    if available is None:
        raise ValueError("cannot tell the available RAM (no /proc/meminfo and no psutil): give the pool's size in "
                         "bytes (KVBlockPool(max_gpu_bytes=...), hf-rocketkv serve --pool-gib)")
    left = cgroup_memory_left()
    return available if left is None else min(available, left)


def free_bytes(device: torch.device | str) -> int:
    """Free memory of ``device``: CUDA's free device bytes, or the available host RAM for any other device."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available()


@dataclass(frozen=True)
class PoolSize:
    """An automatic pool size and how it was chosen."""

    bytes: int
    device: str
    free: int
    fraction: float
    capped: bool  # the CPU default cap applied
    reserve: int = 0  # bytes kept out before the fraction (CUDA: a long prompt's prefill, prefill_reserve_bytes)

    def describe(self) -> str:
        """E.g. ``0.25 of 19.6 GiB available RAM, capped at 2 GiB``, ``0.9 of 70.2 GiB free on cuda:0`` or
        ``0.9 of (70.2 GiB free on cuda:0 - 5.5 GiB kept for prefill)``."""
        where = f"free on {self.device}" if self.device.startswith("cuda") else "available RAM"
        if self.reserve:
            text = f"{self.fraction:g} of ({self.free / GIB:.1f} GiB {where} - {self.reserve / GIB:.1f} GiB kept for prefill)"
        else:
            text = f"{self.fraction:g} of {self.free / GIB:.1f} GiB {where}"
        return text + (f", capped at {HOST_DEFAULT_CAP / GIB:g} GiB" if self.capped else "")


def auto_pool_size(device: torch.device | str, fraction: float | None = None, free: int | None = None,
                   reserve: int = 0) -> PoolSize:
    """The pool size of the rule for ``device`` (``free``: its free bytes, read now when None; ``reserve``: bytes
    kept out of a CUDA device's free memory before the fraction, ``prefill_reserve_bytes``; ignored elsewhere)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    free = free_bytes(device) if free is None else free
    if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise ValueError(f"reserve must be an integer number of bytes >= 0, got {reserve!r}")
    reserve = min(reserve, free) if device.type == "cuda" else 0
    size = pool_bytes(device.type, free - reserve, fraction)
    used = check_fraction(fraction) if fraction is not None else default_fraction(device.type)
    return PoolSize(size, str(device), free, used, capped=size < int((free - reserve) * used), reserve=reserve)


def activation_widths(config: Any, geometry: ModelGeometry) -> tuple[int, int]:
    """``(hidden, intermediate)`` of a (text) config for ``prefill_reserve_bytes``: its ``hidden_size`` (else the
    geometry's KV heads x head_dim) and ``intermediate_size`` (else 4 x hidden)."""
    hidden = getattr(config, "hidden_size", None) or geometry.num_kv_heads * geometry.head_dim
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    return int(hidden), int(intermediate)


def geometry_prefill_reserve(geometry: ModelGeometry, hidden_size: int, intermediate_size: int) -> int:
    """``prefill_reserve_bytes`` of a geometry already read (a pool's ``geometry``, whose KV heads are a
    tensor-parallel shard's when it was planned for one): its layers, KV heads, head_dim and dtype (2 bytes when it
    names none), with the activation widths given (``activation_widths``)."""
    dtype_bytes = geometry.dtype.itemsize if geometry.dtype is not None else 2
    return prefill_reserve_bytes(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, hidden_size,
                                 intermediate_size, dtype_bytes)


def model_prefill_reserve(model_or_config: Any, num_kv_heads: int | None = None) -> int:
    """``prefill_reserve_bytes`` for a model (or its config): its layers, KV heads (``num_kv_heads`` when given: a
    tensor-parallel shard's), head_dim, hidden and intermediate sizes (4 x hidden when the config names none) and
    dtype (2 bytes when it names none)."""
    # Under tensor parallelism only the K/V part shrinks to the shard's heads: a rank's dense prompt K/V holds the KV
    # heads its k_proj/v_proj shard yields. The activations are counted whole on purpose (conservative): transformers'
    # tp plans shard q/k/v, the attention output and the MLP's gate/up (colwise), but the residual stream, the normed
    # input and the rowwise o_proj/down_proj outputs are full hidden-size tensors on every rank, and a plan may leave
    # the attention or the MLP whole (gpt-oss, MoE experts), so dividing them by the ranks could reserve too little.
    geometry, _model = model_geometry(model_or_config, num_kv_heads)
    config = split_model_and_config(model_or_config)[1]
    return geometry_prefill_reserve(geometry, *activation_widths(config, geometry))


def model_device(model: torch.nn.Module | None, device: torch.device | str | None) -> torch.device:
    """Where an automatically sized pool's pages will live: ``device`` when given, else the model's first
    parameter's device, else the current CUDA device when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    if model is not None:
        for parameter in model.parameters():
            return parameter.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["DEVICE_FRACTION", "HOST_DEFAULT_CAP", "HOST_FRACTION", "PREFILL_RESERVE_CHUNK", "PREFILL_RESERVE_TOKENS",
           "PoolSize", "activation_widths", "auto_pool_size", "check_fraction", "default_fraction", "free_bytes",
           "geometry_prefill_reserve", "host_available", "model_device", "model_prefill_reserve", "pool_bytes",
           "prefill_reserve_bytes"]
