"""The benchmarks' memory check (hf_rocketkv/bench/fit.py): the parameter count against transformers' own model and
Llama-3.1-8B's published size, the KV and activation terms against hand-computed bytes, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_rocketkv.bench import fit
from hf_rocketkv.bench.options import decode_parser, plan_calls, workload_parser

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


# ---------------------------------------------------------------------------------- the memory check's own flags
# The weights and the per-element sizes below are written out from the shapes (an oracle independent of fit.py's
# Shapes.parameters and state_bytes): Llama-3.1-8B's hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128,
# vocabulary 128256; the tiny model's hidden 256, intermediate 512, 4 / 2 heads of 64, 2 layers, vocabulary 1024.
def llama_parameters(layers: int) -> int:
    attention = 2 * 4096 * 32 * 128 + 2 * 4096 * 8 * 128
    return 2 * 128256 * 4096 + layers * (attention + 3 * 4096 * 14336 + 2 * 4096) + 4096


TINY_PARAMETERS = 2 * 1024 * 256 + 2 * (2 * 256 * 4 * 64 + 2 * 256 * 2 * 64 + 3 * 256 * 512 + 2 * 256) + 256


def test_bench_dtype_is_the_flag_else_float32_on_the_cpu_and_bfloat16_elsewhere():
    assert fit.bench_dtype(decode_parser().parse_args([]), "cpu") == "float32"
    assert fit.bench_dtype(decode_parser().parse_args([]), "cuda") == "bfloat16"
    for dtype in ("float16", "bfloat16", "float32"):
        for device_type in ("cpu", "cuda"):
            assert fit.bench_dtype(decode_parser().parse_args(["--dtype", dtype]), device_type) == dtype
    workload = workload_parser().parse_args(["--workload"])  # no --dtype flag
    assert (fit.bench_dtype(workload, "cpu"), fit.bench_dtype(workload, "cuda")) == ("float32", "bfloat16")


@pytest.mark.parametrize("flags, device_type, elem", [
    ([], "cpu", 4), ([], "cuda", 2), (["--dtype", "float16"], "cpu", 2), (["--dtype", "bfloat16"], "cpu", 2),
    (["--dtype", "float32"], "cuda", 4),
])
def test_the_estimate_counts_the_bytes_of_the_dtype_picked(flags, device_type, elem):
    """--quick's smallest point (dynamic, batch 1 x 96 + 6) by hand: 2 layers x 102 tokens x K and V of 2 heads x 64,
    and 96 rows of activations (8 x hidden + 4 x intermediate), every element ``elem`` bytes."""
    args = decode_parser().parse_args(["--quick", *flags])
    kv = 2 * 102 * 2 * 2 * 64
    activations = 96 * (8 * 256 + 4 * 512)
    assert fit.check_bench(args, workload=False, device_type=device_type, available=GiB, where="x", prompt_budget=48,
                           prefill_batch_size=None) == (TINY_PARAMETERS + kv + activations) * elem


def test_memory_fraction_reaches_the_check():
    """The same free bytes: the run fits in 0.92 of them (the default) and not in --memory-fraction 0.5."""
    need = fit.check_bench(decode_parser().parse_args(["--quick"]), workload=False, device_type="cpu",
                           available=GiB, where="x", prompt_budget=48, prefill_batch_size=None)
    available = int(need / 0.7)
    assert fit.check_bench(decode_parser().parse_args(["--quick"]), workload=False, device_type="cpu",
                           available=available, where="x", prompt_budget=48, prefill_batch_size=None) == need
    assert fit.check_bench(decode_parser().parse_args(["--quick", "--memory-fraction", "0.92"]), workload=False,
                           device_type="cpu", available=available, where="x", prompt_budget=48,
                           prefill_batch_size=None) == need
    half = decode_parser().parse_args(["--quick", "--memory-fraction", "0.5"])
    with pytest.raises(fit.WontFit, match=r"\), more than 0\.5 of the 0\.0 GiB free on x\n"):
        fit.check_bench(half, workload=False, device_type="cpu", available=available, where="x", prompt_budget=48,
                        prefill_batch_size=None)
    # an explicit fraction (the workload passes 0.92) wins over the flag
    assert fit.check_bench(half, workload=False, device_type="cpu", available=available, where="x", prompt_budget=48,
                           prefill_batch_size=None, fraction=0.92) == need


def test_memory_fraction_reaches_the_check_from_the_decode_benchmark_and_the_command_line(monkeypatch):
    import importlib

    from hf_rocketkv.bench import decode
    from hf_rocketkv.cli.main import UsageError
    from hf_rocketkv.config import RocketKVConfig

    class Built(Exception):
        pass

    def build_model(*args, **kwargs):
        raise Built

    rocket = RocketKVConfig()
    quick = ["--quick", "--device", "cpu"]
    need = fit.check_bench(decode_parser().parse_args(quick), workload=False, device_type="cpu", available=GiB,
                           where="x", prompt_budget=decode.rocket_config(decode_parser().parse_args(quick), True,
                                                                         torch.device("cpu")).prompt_budget,
                           prefill_batch_size=None)
    monkeypatch.setattr(decode, "free_memory", lambda device: (int(need / 0.7), "the CPU (test)"))
    monkeypatch.setattr(decode, "build_model", build_model)
    with pytest.raises(Built):
        decode.main(quick)
    assert decode.main([*quick, "--memory-fraction", "0.5"]) == 2

    need = fit.check_bench(decode_parser().parse_args(quick), workload=False, device_type="cpu", available=GiB,
                           where="x", prompt_budget=rocket.prompt_budget, prefill_batch_size=rocket.prefill_batch_size)
    monkeypatch.setattr(fit, "host_available_bytes", lambda: (int(need / 0.7), "test"))
    cli = importlib.import_module("hf_rocketkv.cli.main")  # the module (the package's ``main`` is its function)
    cli.check_bench_fits(decode_parser().parse_args(quick), rocket)
    with pytest.raises(UsageError, match=r"more than 0\.5 of the 0\.0 GiB free on the CPU \(test\)"):
        cli.check_bench_fits(decode_parser().parse_args([*quick, "--memory-fraction", "0.5"]), rocket)


def test_quick_drops_the_static_compile_rows_from_the_workload():
    for quick in (False, True):
        args = workload_parser().parse_args(["--workload", "--calls", "3", *(["--quick"] if quick else [])])
        calls = plan_calls(args)
        caches = ["dynamic", "rocketkv-graphs", "rocketkv-compile"] if quick else [
            "dynamic", "static-compile", "rocketkv-graphs", "rocketkv-compile"]
        assert fit.bench_points(args, workload=True) == [fit.Point(c, *call) for c in caches for call in calls]
    only_static = workload_parser().parse_args(["--workload", "--quick", "--caches", "static-compile"])
    assert fit.bench_points(only_static, workload=True) == []
    # the decode grid keeps its static rows under --quick (it runs them on the CPU too)
    decode_quick = decode_parser().parse_args(["--quick"])
    assert {p.cache for p in fit.bench_points(decode_quick, workload=False)} == {"dynamic", "static-compile",
                                                                                "rocketkv"}


def gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def test_the_refusal_line_word_for_word_against_the_estimate_by_hand():
    # the decode grid's smallest point, dense, float32 on the CPU: 2 layers x 2 rows x 1010 tokens x K and V of 8 heads
    # x 128, and 2 x 1000 rows of activations
    args = decode_parser().parse_args(["--layers", "2", "--context", "1000", "--batch", "2", "--new-tokens", "10",
                                       "--caches", "dynamic"])
    weights = llama_parameters(2) * 4
    state = (2 * 2 * 1010 * 2 * 8 * 128 + 2 * 1000 * (8 * 4096 + 4 * 14336)) * 4
    assert (gib(weights + state), gib(weights), gib(state)) == ("6.2", "5.5", "0.7")
    with pytest.raises(fit.WontFit) as refused:
        fit.check_bench(args, workload=False, device_type="cpu", available=4 * GiB, where="the CPU (test)",
                        prompt_budget=2048, prefill_batch_size=None)
    assert str(refused.value) == (
        f"the smallest point (dynamic, batch 2 x 1000 prompt tokens + 10 new) of a Llama-3.1-8B-shaped model (2 layers,"
        f" float32) needs ~{gib(weights + state)} GiB (weights {gib(weights)} GiB + KV cache and activations "
        f"{gib(state)} GiB), more than 0.92 of the 4.0 GiB free on the CPU (test)\n"
        "pass --quick (a tiny model: seconds on a CPU), or fewer --layers (32 by default), a shorter --context or a "
        "smaller --batch; or run it on a CUDA GPU")

    # RocketKV in bfloat16 on a GPU, --memory-fraction 0.8: 2048 + 32 kept tokens twice (KT cache and positions) in
    # its one layer, the dense prefill layer and its compacted copy (2 x 4096 tokens), 4096 rows of activations
    args = decode_parser().parse_args(["--layers", "1", "--context", "4096", "--batch", "1", "--new-tokens", "32",
                                       "--caches", "rocketkv", "--dtype", "bfloat16", "--memory-fraction", "0.8"])
    kv_token_layer = 2 * 8 * 128
    weights = llama_parameters(1) * 2
    state = ((2048 + 32) * kv_token_layer * 2 + 2 * 4096 * kv_token_layer + 4096 * (8 * 4096 + 4 * 14336)) * 2
    assert (gib(weights + state), gib(weights), gib(state)) == ("3.1", "2.4", "0.7")
    with pytest.raises(fit.WontFit) as refused:
        fit.check_bench(args, workload=False, device_type="cuda", available=int(3.5 * GiB), where="cuda:0 (test)",
                        prompt_budget=2048, prefill_batch_size=None)
    assert str(refused.value) == (
        f"the smallest point (rocketkv, batch 1 x 4096 prompt tokens + 32 new) of a Llama-3.1-8B-shaped model (1 "
        f"layers, bfloat16) needs ~{gib(weights + state)} GiB (weights {gib(weights)} GiB + KV cache and activations "
        f"{gib(state)} GiB), more than 0.8 of the 3.5 GiB free on cuda:0 (test)\n"
        "pass --quick (a tiny model: seconds on a CPU), or fewer --layers (32 by default), a shorter --context or a "
        "smaller --batch")


def test_cgroup_room_floors_at_zero_and_reads_nothing_it_cannot_parse(tmp_path):
    (tmp_path / "memory.max").write_text(f"{GiB}\n")
    (tmp_path / "memory.current").write_text(f"{GiB + 4096}\n")
    assert fit.cgroup_room(tmp_path) == 0  # over the limit (reclaim pending): no room, not a negative number
    (tmp_path / "memory.current").write_text(f"{GiB}\n")
    assert fit.cgroup_room(tmp_path) == 0
    (tmp_path / "memory.current").write_text(f"{GiB - 1}\n")
    assert fit.cgroup_room(tmp_path) == 1
    (tmp_path / "memory.current").unlink()
    assert fit.cgroup_room(tmp_path) is None  # a limit but no usage read
    (tmp_path / "memory.current").write_text("0\n")
    for unreadable in ("", "1.5G\n", "none\n", " max extra\n"):
        (tmp_path / "memory.max").write_text(unreadable)
        assert fit.cgroup_room(tmp_path) is None, unreadable
    (tmp_path / "memory.max").write_text("  max  \n")
    assert fit.cgroup_room(tmp_path) is None
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory.max").mkdir()  # read_text raises IsADirectoryError
    assert fit.cgroup_room(tmp_path) is None


def test_host_available_bytes_reads_meminfo_else_free_pages_and_takes_a_lower_cgroup_room(monkeypatch, tmp_path):
    """/proc/meminfo's MemAvailable (kB), else free physical pages x page size (os.sysconf), else nothing; a cgroup
    room below that number wins, an equal one does not."""
    import types

    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(fit, "Path", lambda path: meminfo if path == "/proc/meminfo" else Path(path))
    sizes = {"SC_AVPHYS_PAGES": 3, "SC_PAGE_SIZE": 4096}

    def sysconf(name):
        if name not in sizes:
            raise ValueError(f"unrecognized configuration name {name!r}")
        return sizes[name]

    monkeypatch.setattr(fit, "os", types.SimpleNamespace(sysconf=sysconf))
    room = [None]
    monkeypatch.setattr(fit, "cgroup_room", lambda: room[0])
    meminfo.write_text("MemTotal:       16000 kB\nMemFree:  100 kB\nMemAvailable:    2048 kB\nBuffers: 7 kB\n")
    assert fit.host_available_bytes() == (2048 * 1024, "MemAvailable in /proc/meminfo")
    room[0] = 2048 * 1024 - 1
    assert fit.host_available_bytes() == (2048 * 1024 - 1, "the cgroup's memory.max less memory.current")
    room[0] = 2048 * 1024
    assert fit.host_available_bytes() == (2048 * 1024, "MemAvailable in /proc/meminfo")
    room[0] = None
    for unread in ("MemTotal: 16000 kB\n", "MemAvailable: many kB\n", "MemAvailable:\n"):
        meminfo.write_text(unread)
        assert fit.host_available_bytes() == (3 * 4096, "free physical pages"), unread
    meminfo.unlink()
    assert fit.host_available_bytes() == (3 * 4096, "free physical pages")
    room[0] = 5
    assert fit.host_available_bytes() == (5, "the cgroup's memory.max less memory.current")
    room[0] = None
    sizes.pop("SC_AVPHYS_PAGES")
    assert fit.host_available_bytes() == (None, "unknown")
    monkeypatch.setattr(fit, "os", types.SimpleNamespace())  # no sysconf at all (Windows)
    assert fit.host_available_bytes() == (None, "unknown")
    room[0] = 5
    assert fit.host_available_bytes() == (5, "the cgroup's memory.max less memory.current")


def test_shapes_of_an_object_without_the_optional_fields():
    """A config object (not a dict) lacking head_dim, num_key_value_heads and tie_word_embeddings: the defaults of a
    dict without them (head_dim = hidden / heads, an int; as many KV heads as heads; untied)."""
    import types

    fields = {k: v for k, v in fit.TINY.items() if k != "num_key_value_heads"}
    shapes = fit.Shapes.of(types.SimpleNamespace(**fields))
    assert shapes == fit.Shapes.of(fields) == fit.Shapes(hidden=256, intermediate=512, heads=4, kv_heads=4,
                                                         head_dim=64, layers=2, vocab=1024, tied=False)
    assert type(shapes.head_dim) is int and type(shapes.parameters()) is int


def test_the_prefill_rows_reach_the_estimate():
    """RocketKV rows prefilled one at a time (--prefill-batch-size 1): the activations of one row, not of the batch of
    4 (--quick shapes by hand, float32: 2 layers, K and V of 2 heads x 64). Without the flag generate() picks the row
    groups from the free memory, down to one row: the estimate counts one."""
    args = decode_parser().parse_args(["--quick", "--caches", "rocketkv", "--batch", "4", "--context", "96"])
    kv_token_layer = 2 * 2 * 64
    kv = 2 * 4 * (48 + 6) * kv_token_layer * 2 + 2 * 4 * 96 * kv_token_layer
    row = 96 * (8 * 256 + 4 * 512)
    for rows, activations in ((None, row), (1, row), (2, 2 * row), (8, 4 * row)):
        assert fit.check_bench(args, workload=False, device_type="cpu", available=GiB, where="x", prompt_budget=48,
                               prefill_batch_size=rows) == (TINY_PARAMETERS + kv + activations) * 4, rows


def test_a_run_without_a_memory_fraction_flag_is_held_to_0_92():
    """The workload's parser has no --memory-fraction: without ``fraction`` (the command line's check) it is 0.92."""
    args = workload_parser().parse_args(["--workload", "--quick", "--calls", "2"])
    need = fit.check_bench(args, workload=True, device_type="cpu", available=GiB, where="x", prompt_budget=48,
                           prefill_batch_size=None, fraction=1.0)
    assert fit.check_bench(args, workload=True, device_type="cpu", available=int(need / 0.92) + 1, where="x",
                           prompt_budget=48, prefill_batch_size=None) == need
    with pytest.raises(fit.WontFit, match=r"more than 0\.92 of the"):
        fit.check_bench(args, workload=True, device_type="cpu", available=int(need / 0.92) - 1, where="x",
                        prompt_budget=48, prefill_batch_size=None)
