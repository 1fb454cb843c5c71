"""Every kernel variant the kernel tests launch also compiles for the GPU (sm_90), with the installed Triton.

The interpreter runs the kernels' semantics but never Triton's GPU compiler; triton_compile_check.py (beside this
file) records the launches of the kernel tests and compiles each one for cuda:90 on the CPU (every MLIR pass and ptxas),
with the constexprs a GPU launch would use. A kernel that only the GPU compiler rejects fails here, in CI.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).with_name("triton_compile_check.py")
RECORDED_TESTS = [  # fast kernel tests covering every kernel (test_e2e_triton adds model runs, not new kernels)
    "tests/kernels/test_paged_ops.py", "tests/kernels/test_sparse_decode_attention.py",
    "tests/kernels/test_select_pages.py", "tests/kernels/test_page_scores.py", "tests/kernels/test_window_scores.py",
    "tests/kernels/test_append_token.py", "tests/kernels/test_kt.py", "tests/kernels/test_fp8_pages.py",
    "tests/kernels/test_fp8_append.py", "tests/kernels/test_fused_decode.py", "tests/kernels/test_rms_norm.py",
    "tests/kernels/test_ring_attention.py", "tests/kernels/test_ring_append.py",
]


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(CHECK), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # Triton + ptxas compile every recorded variant: 135 s alone on 2 cores, far more when busy
def test_every_recorded_kernel_variant_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the other kernel tests compile every kernel for it")
    launches = tmp_path / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")  # record on the CPU, even on a GPU machine
    recorded = _run("record", str(launches), *RECORDED_TESTS, "-q", env=env)
    assert recorded.returncode == 0, recorded.stdout[-3000:] + recorded.stderr[-3000:]
    kernels = {launch["kernel"] for launch in json.loads(launches.read_text())}
    assert {"_sparse_decode_split_kernel", "_append_token_kernel", "_page_logits_kernel", "_select_chunk_kernel",
            "_window_stats_kernel", "_build_kt_kernel", "_update_kt_kernel", "_fused_select_attend_kernel",
            "_fused_combine_kernel", "_rms_norm_kernel"} <= kernels
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    compiled = _run("compile", str(launches), "--arch", "90", "--out", str(tmp_path / "compiled.json"), env=env)
    failures = [r for r in json.loads((tmp_path / "compiled.json").read_text())["results"] if r["status"] != "ok"]
    assert compiled.returncode == 0 and not failures, "\n".join(f"{r['launch']}: {r['error']}" for r in failures[:10])
