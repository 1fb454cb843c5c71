"""Kernel tests: every Triton op against its PyTorch reference, on small shapes.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before triton
is first imported); everything here is skipped when triton is not installed.
"""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
