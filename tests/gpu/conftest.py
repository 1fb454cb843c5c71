"""Every test in this folder checks hf_rocketkv on a CUDA GPU (compiled Triton kernels, CUDA graphs, host offload,
NCCL): each gets the ``gpu`` marker, and all of them skip where ``torch.cuda.is_available()`` is False, so the CPU
suite collects them and moves on. On a GPU machine ``bash scripts/gpu_tests.sh`` runs them with every other
``gpu``-marked test and writes a results file.
"""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False); run scripts/gpu_tests.sh on a GPU machine"


def pytest_collection_modifyitems(config, items):
    # a conftest's hook sees every collected item: only this folder's are marked here
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
