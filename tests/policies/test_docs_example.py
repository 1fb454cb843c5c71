"""The runnable example of docs/policies.md ("Write your own") runs as written and keeps what it says."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "policies.md"


def test_write_your_own_example_runs():
    section = DOC.read_text().split("## Write your own", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    cache, ids = namespace["cache"], namespace["ids"]
    assert namespace["out"].shape == (1, 44)
    for layer_idx in range(len(cache.layers)):
        kept = cache.kept_positions(layer_idx)[0, :, :24]
        assert torch.all(kept[:, 16:] == torch.arange(32, 40))
        assert torch.all(kept[:, :16] < 32) and torch.all(kept[:, :16].diff(dim=-1) > 0)
    assert ids.shape == (1, 40)
