"""The benchmarks' memory check (hf_rocketkv/bench/fit.py): the parameter count against transformers' own model and
Llama-3.1-8B's published size, the KV and activation terms against hand-computed bytes, and the refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_rocketkv.bench import fit
from hf_rocketkv.bench.options import decode_parser, workload_parser

GiB = 2**30


def test_parameter_count_matches_the_model_transformers_builds():
    for shapes in (fit.TINY, {**fit.TINY, "num_key_value_heads": 4, "num_hidden_layers": 3},
                   {**fit.TINY, "tie_word_embeddings": True}, {**fit.TINY, "head_dim": 32}):
        model = LlamaForCausalLM(LlamaConfig(**shapes))
        assert fit.Shapes.of(shapes).parameters() == sum(p.numel() for p in model.parameters())
        assert fit.Shapes.of(model.config).parameters() == sum(p.numel() for p in model.parameters())


def test_parameter_count_of_llama_31_8b_is_its_published_size():
    assert fit.Shapes.of(fit.LLAMA_31_8B).parameters() == 8_030_261_248  # the checkpoint's safetensors index
    assert fit.Shapes.of(fit.LLAMA_31_8B, layers=2).layers == 2


def test_state_bytes_by_hand():
    shapes = fit.Shapes.of(fit.TINY)  # 2 layers, 2 KV heads x 64, hidden 256, intermediate 512
    kv_token_layer = 2 * 2 * 64 * 4  # K and V, fp32
    activations = 100 * (8 * 256 + 4 * 512) * 4
    assert fit.state_bytes(shapes, 4, "dynamic", 1, 100, 10, 48) == 2 * 110 * kv_token_layer + activations
    rocket = 2 * (48 + 10) * kv_token_layer * 2 + 2 * 100 * kv_token_layer + activations
    assert fit.state_bytes(shapes, 4, "rocketkv-graphs", 1, 100, 10, 48) == rocket
    # prefill rows: the activations of one row at a time; automatic rows (None) count one row, the least they go to
    assert (fit.state_bytes(shapes, 4, "rocketkv", 4, 100, 10, 48, prefill_batch_size=1)
            < fit.state_bytes(shapes, 4, "rocketkv", 4, 100, 10, 48, prefill_batch_size=4))
    assert (fit.state_bytes(shapes, 4, "rocketkv", 4, 100, 10, 48, prefill_batch_size=1)
            == fit.state_bytes(shapes, 4, "rocketkv", 4, 100, 10, 48))


def test_state_bytes_by_hand_at_batch_3():
    """Every term scales with the batch (the prefill's dense layer and the activations too), the activations with the
    prefill rows."""
    shapes = fit.Shapes.of(fit.TINY)
    kv_token_layer = 2 * 2 * 64 * 4
    row_activations = 100 * (8 * 256 + 4 * 512) * 4
    assert fit.state_bytes(shapes, 4, "dynamic", 3, 100, 10, 48) == 2 * 3 * 110 * kv_token_layer + 3 * row_activations
    kept = 2 * 3 * (48 + 10) * kv_token_layer * 2 + 2 * 3 * 100 * kv_token_layer
    assert fit.state_bytes(shapes, 4, "rocketkv", 3, 100, 10, 48) == kept + row_activations  # automatic: one row
    assert fit.state_bytes(shapes, 4, "rocketkv", 3, 100, 10, 48, prefill_batch_size=3) == kept + 3 * row_activations
    assert fit.state_bytes(shapes, 4, "rocketkv", 3, 100, 10, 48, prefill_batch_size=2) == kept + 2 * row_activations
    assert fit.state_bytes(shapes, 4, "rocketkv", 3, 30, 10, 48, prefill_batch_size=3) == (
        2 * 3 * (30 + 10) * kv_token_layer * 2 + 2 * 3 * 30 * kv_token_layer + 3 * 30 * (8 * 256 + 4 * 512) * 4)


def test_check_fits_refuses_with_the_estimate_and_what_to_pass():
    args = decode_parser().parse_args([])
    with pytest.raises(fit.WontFit) as refused:
        fit.check_bench(args, workload=False, device_type="cpu", available=16 * GiB, where="the CPU (test)",
                        prompt_budget=2048, prefill_batch_size=None)
    first, second = str(refused.value).splitlines()
    # the smallest point: weights 8.03e9 x 4 B = 29.9 GiB alone exceed 16 GiB
    assert first.startswith("the smallest point (rocketkv, batch 1 x 8192 prompt tokens + 32 new)")
    assert "weights 29.9 GiB" in first and "of the 16.0 GiB free on the CPU (test)" in first
    assert second.startswith("pass --quick") and "run it on a CUDA GPU" in second


def test_check_fits_passes_what_fits_and_refuses_nothing_on_a_guess():
    quick = decode_parser().parse_args(["--quick"])
    assert fit.check_bench(quick, workload=False, device_type="cpu", available=GiB, where="x", prompt_budget=48,
                           prefill_batch_size=None) < GiB
    big = decode_parser().parse_args([])
    assert fit.check_bench(big, workload=False, device_type="cpu", available=None, where="x", prompt_budget=2048,
                           prefill_batch_size=None) is None


def test_the_workload_is_checked_at_its_largest_call():
    args = workload_parser().parse_args(["--workload", "--layers", "1", "--batches", "1", "8"])
    points = fit.bench_points(args, workload=True)
    largest = max(points, key=lambda p: fit.state_bytes(fit.Shapes.of(fit.LLAMA_31_8B, 1), 2, p.cache, p.batch,
                                                         p.context, p.new_tokens, 2048))
    assert largest.batch == 8  # with one layer, RocketKV's dense prefill layer outweighs a dense cache
    with pytest.raises(fit.WontFit, match=rf"^the largest call \({largest.cache}, batch 8 x {largest.context} "):
        fit.check_bench(args, workload=True, device_type="cuda", available=3 * GiB, where="cuda:0",
                        prompt_budget=2048, prefill_batch_size=None)


def test_cgroup_room(tmp_path):
    assert fit.cgroup_room(tmp_path) is None  # no files: no limit known
    (tmp_path / "memory.max").write_text("max\n")
    assert fit.cgroup_room(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{4 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{GiB}\n")
    assert fit.cgroup_room(tmp_path) == 3 * GiB


def test_decode_benchmark_refuses_before_building_the_model(monkeypatch, capsys):
    from hf_rocketkv.bench import decode

    monkeypatch.setattr(decode, "free_memory", lambda device: (GiB, "the CPU (test)"))
    monkeypatch.setattr(decode, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    assert decode.main(["--device", "cpu", "--context", "1024", "--batch", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("hf-rocketkv bench: error: the smallest point"), err
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("workload, quick, device_type, instead", [
    (False, False, "cpu", "pass --quick (a tiny model: seconds on a CPU), or fewer --layers (32 by default), a shorter "
                          "--context or a smaller --batch; or run it on a CUDA GPU"),
    (False, True, "cpu", "fewer --layers (32 by default), a shorter --context or a smaller --batch; or run it on a "
                         "CUDA GPU"),
    (True, False, "cuda", "pass --quick (a tiny model: seconds on a CPU), or fewer --layers (32 by default), a lower "
                          "--max-context or smaller --batches"),
    (True, True, "cuda", "fewer --layers (32 by default), a lower --max-context or smaller --batches"),
])
def test_the_refusal_says_what_to_pass_instead_word_for_word(workload, quick, device_type, instead):
    parser = workload_parser() if workload else decode_parser()
    args = parser.parse_args(["--quick"] if quick else [])
    with pytest.raises(fit.WontFit) as refused:
        fit.check_bench(args, workload=workload, device_type=device_type, available=1, where="x", prompt_budget=48,
                        prefill_batch_size=None)
    first, second = str(refused.value).splitlines()
    assert second == instead
    assert f" of a {'tiny Llama' if quick else 'Llama-3.1-8B-shaped'} model (" in first


def test_a_run_needing_exactly_the_allowed_bytes_fits():
    """The boundary: an estimate equal to ``fraction`` of what is free starts; one byte less free refuses."""
    args = decode_parser().parse_args(["--quick"])
    need = fit.check_bench(args, workload=False, device_type="cpu", available=10 * GiB, where="x", prompt_budget=48,
                           prefill_batch_size=None, fraction=1.0)
    assert fit.check_bench(args, workload=False, device_type="cpu", available=need, where="x", prompt_budget=48,
                           prefill_batch_size=None, fraction=1.0) == need
    with pytest.raises(fit.WontFit):
        fit.check_bench(args, workload=False, device_type="cpu", available=need - 1, where="x", prompt_budget=48,
                        prefill_batch_size=None, fraction=1.0)
