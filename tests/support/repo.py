"""The repository root, and what a test needs to run this checkout in a subprocess (a script, ``python -m``, or two
ranks under torchrun with gloo on the CPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # two ranks here


def subprocess_env(**variables: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (so the subprocess imports this checkout,
    not an installed hf_rocketkv), plus ``variables``."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **variables}
