"""Kernel launches a pool-backed prefill issues per layer (benchmarks.probes.launch_counts), on the Triton backend under
the interpreter: on a slow host every launch is host time of a prefill or a prefix hit, so the count must not grow
back. The model's own launches and generate()'s per-request ones are not counted against RocketKV."""

import os

import pytest

from benchmarks.probes.launch_counts import count_prefill
from tests.support.markers import slow_except

NOT_ROCKETKV = ("model", "integration.compat._prefill_handler", "integration.generate.RocketKVGenerateHooks.generate",
                "integration.generate.RocketKVGenerateHooks.prepare_inputs",
                # transformers' own RoPE, which the fused-RoPE wrapper hands every prefill call back to
                "integration.rope._compute",
                # transformers' own RMSNorm, which the fused-norm wrapper hands every prefill call back to
                "integration.compat_calls.install_forward.<locals>.forward.<locals>.<lambda>")
# measured 2026-11-24 (2 layers, so the per-request launches count half a layer each): 27.5 per layer after the
# compaction kernel, 42.5 before it
ROCKETKV_LAUNCHES_PER_LAYER = 28


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts on the CPU, under Triton's interpreter")
def test_a_prefill_launches_one_compaction_kernel_per_layer_and_few_others():
    report = count_prefill(prompt_len=256, layers=2, backend="triton")
    per_function = report["per_function"]
    layers = report["layers"]
    assert per_function.get("kernels.compact.paged_compact_row_triton") == layers  # one row: one launch per layer
    assert "cache.compaction.compact" not in per_function  # no zero fills, gathers or copies of its own
    assert "kernels.paged.scatter_pages" not in per_function
    ours = {where: n for where, n in per_function.items() if not where.startswith(NOT_ROCKETKV)}
    assert sum(ours.values()) / layers <= ROCKETKV_LAUNCHES_PER_LAYER, ours


def test_only_the_package_folder_counts_as_the_package(tmp_path):
    """A clone folder named ``hf_rocketkv`` with its ``.venv`` inside: torch's files there are not the package's."""
    from benchmarks.probes.launch_counts import package_module

    package = str(tmp_path / "hf_rocketkv" / "hf_rocketkv") + os.sep
    venv_torch = tmp_path / "hf_rocketkv" / ".venv" / "lib" / "site-packages" / "torch" / "nn" / "functional.py"
    assert package_module(str(venv_torch), package) is None
    assert package_module(package + os.path.join("cache", "compaction.py"), package) == "cache.compaction"
    assert package_module(package + "config.py", package) == "config"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts on the CPU, under Triton's interpreter")
@pytest.mark.parametrize("model_name", slow_except(["gemma-3-12b", "gpt-oss-20b"], keep=["gemma-3-12b"]))
def test_a_sliding_layer_decodes_in_fewer_launches_than_a_full_one(model_name):
    """A decode step of a sliding-window layer reads its ring in place: the token's append (its count advanced in the
    same launch) and one attention kernel (soft-capping and sinks inside it), below a full RocketKV layer's page
    selection. Before the ring kernels, Gemma 3's sliding layer took 44 launches against its full layer's 33
    (gpt-oss: 52 against 23)."""
    from benchmarks.probes.launch_counts import count_decode_attention

    report = count_decode_attention(model_name, backend="triton")
    per_kind = report["per_layer_kind"]
    assert per_kind["sliding_attention"] <= per_kind["full_attention"] - 2, report["per_op"]
    sliding = report["per_op"]["sliding_attention"]
    assert sliding.get("triton:_ring_append_kernel") == 1 and sliding.get("triton:_ring_decode_split_kernel") == 1
    assert not {"index_select", "index_copy_", "remainder", "_safe_softmax", "bmm", "add_"} & set(sliding), sliding
