"""How many bytes of pages a KVBlockPool takes when no size is given: a fraction of the memory that is free.

The rule (``pool_bytes``) is a plain function of the device type, the free bytes and a fraction:

    CUDA          fraction x free device memory (``torch.cuda.mem_get_info``), fraction 0.9 by default (TensorRT-LLM's
                  ``free_gpu_memory_fraction``; vLLM's ``gpu_memory_utilization`` is a share of the whole GPU, weights
                  included): measured after the model is loaded, so the weights are already counted out and the other
                  10% is left for activations, CUDA graphs and other processes.
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

import torch

DEVICE_FRACTION = 0.9  # CUDA: of the free device memory, as TensorRT-LLM's free_gpu_memory_fraction default
HOST_FRACTION = 0.25  # CPU: of the available RAM
HOST_DEFAULT_CAP = 2 << 30  # CPU: the default fraction never takes more than this
GIB = 1 << 30


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

    def describe(self) -> str:
        """E.g. ``0.25 of 19.6 GiB available RAM, capped at 2 GiB`` or ``0.9 of 70.2 GiB free on cuda:0``."""
        where = f"free on {self.device}" if self.device.startswith("cuda") else "available RAM"
        text = f"{self.fraction:g} of {self.free / GIB:.1f} GiB {where}"
        return text + (f", capped at {HOST_DEFAULT_CAP / GIB:g} GiB" if self.capped else "")


def auto_pool_size(device: torch.device | str, fraction: float | None = None, free: int | None = None) -> PoolSize:
    """The pool size of the rule for ``device`` (``free``: its free bytes, read now when None)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    free = free_bytes(device) if free is None else free
    size = pool_bytes(device.type, free, fraction)
    used = check_fraction(fraction) if fraction is not None else default_fraction(device.type)
    return PoolSize(size, str(device), free, used, capped=size < int(free * used))


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


__all__ = ["DEVICE_FRACTION", "HOST_DEFAULT_CAP", "HOST_FRACTION", "PoolSize", "auto_pool_size", "check_fraction",
           "default_fraction", "free_bytes", "host_available", "model_device", "pool_bytes"]
