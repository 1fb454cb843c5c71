"""Peak live tensor bytes of a row-group prefill (benchmarks.probes.peak_memory_cpu, CPU): one row's activations, not
the batch's, and no [tokens, vocab] logits.

The bound is worked out from the shapes: a cold row of T tokens holds at most the MLP's three [T, intermediate]
tensors, a few [T, hidden] hidden states and the rotary tables at once; the logits generate() asks for are one
position per row ([rows, 1, vocab], logits_to_keep=1). Row groups after the first hit the shared prefix and compute
only their own suffix.
"""

from __future__ import annotations

import pytest
import torch

MIB = 2**20
DIMS = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=256, vocab=8192, prefix=512,
            suffix=32)


@pytest.fixture(scope="module")
def tool():
    from benchmarks.probes import peak_memory_cpu

    return peak_memory_cpu


def measure(tool, batch: int) -> dict:
    argv = [f"--{key.replace('_', '-')}={value}" for key, value in DIMS.items()]
    argv += [f"--batch={batch}", "--new-tokens=3", "--prompt-budget=64", "--window=16", "--topk=4"]
    return tool.run(tool.parse_args(argv))


def test_live_bytes_counts_what_is_alive_between_ops(tool):
    with tool.LiveBytes(static_ptrs=set(), stack_bytes=0) as mode:
        a = torch.ones(1000)  # 4,000 bytes
        b = a + 1  # 8,000 live
        del a
        c = b * 2  # 8,000 live again (a is gone)
        view = c[10:]  # no new storage
        assert mode.current == 8000
        del b, c, view
    assert mode.peak == 8000 and mode.current == 0


def test_row_group_prefill_peak_is_one_cold_row(tool):
    tokens = DIMS["prefix"] + DIMS["suffix"]
    activations = tokens * (3 * DIMS["intermediate"] + 5 * DIMS["hidden"] + 4 * DIMS["head_dim"]) * 4  # float32
    all_logits = tokens * DIMS["vocab"] * 4  # what a prefill that kept every position's logits would add
    small, large = measure(tool, 2), measure(tool, 6)
    for report in (small, large):
        assert report["peak_phase"] == f"prefill group 0 ({tokens} tokens)"
        assert report["transient_peak_mib"] * MIB <= activations + 0.25 * MIB < all_logits
        hits = [mib for phase, mib in report["phase_peaks_mib"].items() if phase.startswith("prefill group ")
                and not phase.startswith("prefill group 0 ")]
        assert hits and max(hits) < report["transient_peak_mib"] / 2  # the hits compute their suffix only
        assert report["cache_stats"]["reused_tokens"] > 0
    # three times the rows, the same peak: it is one row's (plus a few [1, 1, vocab] logits per extra row)
    extra_rows = 4
    assert large["transient_peak_mib"] - small["transient_peak_mib"] <= extra_rows * 3 * DIMS["vocab"] * 4 / MIB
