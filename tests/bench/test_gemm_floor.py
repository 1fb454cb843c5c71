"""benchmarks.probes.gemm_floor on the CPU (``--cpu-smoke``: tiny shapes, the cuBLAS variant only): the record's fields and
its arithmetic (GB/s = weight bytes / ms, the fused layout's outputs equal the unfused ones)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.probes import gemm_floor


def test_cpu_smoke_writes_a_record_whose_rates_follow_from_its_times(tmp_path):
    assert gemm_floor.main(["--cpu-smoke", "--out", str(tmp_path), "--repeats", "2"]) == 0
    record = json.loads((tmp_path / "gemm_floor.json").read_text())
    assert record["device"] == "cpu" and record["peak_gb_per_s"] is None and record["floor_ms"] is None
    shapes = {k: (a // 64, b // 64) for k, (a, b) in gemm_floor.LAYER_SHAPES.items()}
    expected_bytes = 2 * (2 * sum(a * b for a, b in shapes.values()) + 64 * 2004)  # bf16: 2 bytes
    assert record["weight_bytes"] == expected_bytes
    assert [(r["batch"], r["variant"]) for r in record["rows"]] == [(1, "cublas"), (64, "cublas")]
    for row in record["rows"]:
        assert row["gb_per_s"] == pytest.approx(expected_bytes / row["ms_per_step"] / 1e6)
        assert 0 <= row["error_vs_float64"] < 0.1
        assert set(row["per_shape"]) == {f"{a}x{b}" for a, b in shapes.values()} | {"64x2004"}


def test_fused_layout_gives_the_unfused_outputs():
    shapes = {k: (a // 64, b // 64) for k, (a, b) in gemm_floor.LAYER_SHAPES.items()}
    weights = gemm_floor.step_gemms(2, shapes, (64, 100), torch.device("cpu"), torch.float64)
    inputs = {k: torch.randn(3, k, dtype=torch.float64) for k in {w.shape[1] for w in weights}}
    fused = gemm_floor.fuse_projections(weights, len(shapes))
    assert len(fused) == 2 * 4 + 1
    outputs = gemm_floor.run_step(torch.nn.functional.linear, fused, inputs)
    plain = [inputs[w.shape[1]] @ w.T for w in weights[:7]]  # the oracle: plain matrix products
    for got, want in zip(gemm_floor.unfuse_first_layer(outputs, weights), plain):
        torch.testing.assert_close(got, want)
