"""How many torch CPU threads the CLI uses when ``--threads`` is not given.

torch's default is one thread per core of the whole machine. On a machine where other processes already keep
cores busy, those threads wait on each other at every operation (OpenMP barriers): on a shared 2-core CPU under
load, SmolLM2 decoding took 1.8 s/token with torch's default against 80 ms with one thread. So the default here
is the number of physical cores this process may use, lowered to the cores that are idle according to the
1-minute load average, and never below one. ``OMP_NUM_THREADS`` set in the environment is respected as is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ThreadChoice:
    """``count`` threads, and why (shown in the generate report)."""

    count: int
    reason: str


def usable_cpus() -> int:
    """Logical CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (containers)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, quota) if quota else cpus)


def cgroup_cpu_quota(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """CPUs allowed by a cgroup v2 quota (``"200000 100000"`` -> 2), None when unlimited or unknown."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def physical_cores(cpuinfo: Path = Path("/proc/cpuinfo")) -> int | None:
    """Distinct (package, core) pairs in /proc/cpuinfo (hyper-threads counted once), None when unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "core id" in fields:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or None


def default_threads(load_average: float | None = None) -> ThreadChoice:
    """Physical cores this process may use, minus the cores other processes keep busy (at least 1).

    ``load_average``: the machine's 1-minute load average (read from the OS when None).
    """
    cpus = usable_cpus()
    cores = min(cpus, physical_cores() or cpus)
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except (AttributeError, OSError):
            load_average = 0.0
    machine_cpus = os.cpu_count() or cpus
    idle = machine_cpus - load_average
    count = max(1, min(cores, math.floor(idle + 0.5)))
    reason = f"auto: {cores} physical core(s) usable, load average {load_average:.1f} on {machine_cpus} CPU(s)"
    return ThreadChoice(count, reason)


def choose_threads(requested: int | None, environ: dict[str, str] | None = None) -> ThreadChoice | None:
    """``--threads N`` wins; else None when ``OMP_NUM_THREADS`` is set (torch already follows it); else the default."""
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return None
    return default_threads()
