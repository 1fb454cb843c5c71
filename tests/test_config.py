"""RocketKVConfig: validation messages, TensorRT-LLM defaults and the YAML shape ``sparse_attention_config``."""

from __future__ import annotations

import re

import pytest
import torch
import yaml

from hf_rocketkv import RocketKVConfig
from hf_rocketkv.integration.batch_buckets import batch_bucket
from hf_rocketkv.kernels.dispatch import get_ops

INT_FIELDS = ("window_size", "kernel_size", "prompt_budget", "topk", "topr", "page_size", "capacity_headroom")


def _raises(match_all: list[str], **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        RocketKVConfig(**kwargs)
    message = str(info.value)
    for fragment in match_all:
        assert fragment in message, f"{fragment!r} missing from error message: {message}"
    return message


def test_defaults_are_tensorrt_llm_defaults():
    config = RocketKVConfig()
    assert (config.window_size, config.kernel_size, config.prompt_budget) == (32, 63, 2048)
    assert (config.topk, config.topr, config.page_size) == (64, 128, 4)
    assert config.kt_cache_dtype == "float8_e5m2"
    assert config.kt_torch_dtype == torch.float8_e5m2


@pytest.mark.parametrize("page_size", [0, 3, 6, 12, -4])
def test_page_size_must_be_power_of_two(page_size):
    _raises(["page_size", "power of 2", str(page_size)], page_size=page_size)


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 64])
def test_page_size_powers_of_two_accepted(page_size):
    assert RocketKVConfig(page_size=page_size).page_size == page_size


def test_window_larger_than_prompt_budget():
    message = _raises(["prompt_budget", "window_size", "64"], window_size=64, prompt_budget=32)
    assert "32" in message
    assert RocketKVConfig(window_size=32, prompt_budget=32).prompt_budget == 32  # equal is allowed


@pytest.mark.parametrize("kernel_size", [0, -1, 2, 64])
def test_kernel_size_odd_and_positive(kernel_size):
    _raises(["kernel_size", "odd", ">= 1", str(kernel_size)], kernel_size=kernel_size)


@pytest.mark.parametrize("kernel_size", [1, 3, 63])
def test_kernel_size_odd_accepted(kernel_size):
    assert RocketKVConfig(kernel_size=kernel_size).kernel_size == kernel_size


@pytest.mark.parametrize("field", ["topk", "topr"])
@pytest.mark.parametrize("value", [0, -3])
def test_topk_topr_at_least_one(field, value):
    _raises([field, ">= 1", str(value)], **{field: value})


def test_window_size_at_least_one():
    _raises(["window_size", ">= 1"], window_size=0)


def test_capacity_headroom_at_least_one():
    _raises(["capacity_headroom", ">= 1"], capacity_headroom=0)


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_prefill_batch_size_none_or_positive_int(value):
    _raises(["prefill_batch_size", "None", ">= 1", repr(value)], prefill_batch_size=value)


@pytest.mark.parametrize("field", ["capacity_buckets", "batch_buckets"])
@pytest.mark.parametrize("value", [(4, 2), (2, 2), (0, 8), (1.5,), ("8",), (True,), 8, "8"])
def test_buckets_are_none_or_strictly_ascending_positive_ints(field, value):
    _raises([f"RocketKVConfig.{field}", "None", "strictly ascending", ">= 1", repr(value)], **{field: value})


def test_bucket_defaults_follow_the_decode_runner_and_lists_become_tuples():
    graphs = RocketKVConfig(prompt_budget=100, capacity_headroom=28)
    assert graphs.effective_capacity_buckets == () and graphs.effective_batch_buckets == ()
    assert batch_bucket(graphs, 3) == 3  # exact: nothing to compile
    compiled = graphs.replace(decode_runner="torch_compile")
    assert compiled.effective_capacity_buckets == (128,)  # prompt_budget + capacity_headroom: one graph
    assert [batch_bucket(compiled, n) for n in (1, 3, 5, 100, 128, 129)] == [1, 4, 8, 128, 128, 129]
    explicit = RocketKVConfig(capacity_buckets=[30, 64], batch_buckets=[2, 6])
    assert explicit.capacity_buckets == (30, 64) and explicit.batch_buckets == (2, 6)
    assert [batch_bucket(explicit, n) for n in (1, 3, 7)] == [2, 6, 7]
    off = compiled.replace(capacity_buckets=(), batch_buckets=())
    assert batch_bucket(off, 3) == 3
    assert RocketKVConfig.from_yaml(explicit.to_yaml()) == explicit
    assert RocketKVConfig.from_dict(explicit.to_dict()) == explicit


@pytest.mark.parametrize("value", [1, "yes", None])
def test_deferred_stop_check_is_a_bool(value):
    _raises(["deferred_stop_check", "True or False", repr(value)], deferred_stop_check=value)


def test_decode_guard_checks_choices():
    _raises(["decode_guard_checks", "first_step", "every_step", "'always'"], decode_guard_checks="always")


def test_prefill_batch_size_accepts_none_and_ints():
    assert RocketKVConfig(prefill_batch_size=None).prefill_batch_size is None
    assert RocketKVConfig(prefill_batch_size=3).prefill_batch_size == 3


@pytest.mark.parametrize("dtype", ["fp8", "float8_e4m3fn", "int8", "bf16", ""])
def test_unknown_kt_cache_dtype(dtype):
    message = _raises(["kt_cache_dtype", repr(dtype)], kt_cache_dtype=dtype)
    for allowed in ("float8_e5m2", "bfloat16", "float16", "float32"):
        assert allowed in message


@pytest.mark.parametrize("dtype,torch_dtype", [
    ("float8_e5m2", torch.float8_e5m2), ("bfloat16", torch.bfloat16),
    ("float16", torch.float16), ("float32", torch.float32),
])
def test_kt_cache_dtypes_accepted(dtype, torch_dtype):
    assert RocketKVConfig(kt_cache_dtype=dtype).kt_torch_dtype == torch_dtype


@pytest.mark.parametrize("backend", ["cuda", "Torch", "", "pytorch"])
def test_unknown_backend(backend):
    message = _raises(["backend", repr(backend)], backend=backend)
    for allowed in ("auto", "torch", "triton"):
        assert allowed in message


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", [4.0, "4", True, None])
def test_non_integer_values(field, value):
    _raises([field, "integer", repr(value)], **{field: value})


def test_numpy_integers_are_taken_as_python_ints():
    """A budget computed with numpy (``np.int64``) is an integer: taken as one, stored as a Python int (YAML / JSON
    serialize it); numpy's bool is still no count."""
    import numpy as np

    config = RocketKVConfig(prompt_budget=np.int64(512), topk=np.int32(16), prefill_batch_size=np.int64(2))
    assert (config.prompt_budget, config.topk, config.prefill_batch_size) == (512, 16, 2)
    assert all(type(v) is int for v in (config.prompt_budget, config.topk, config.prefill_batch_size))
    assert type(config.replace(page_size=np.int64(8)).page_size) is int
    assert RocketKVConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="RocketKVConfig.prompt_budget must be an integer"):
        RocketKVConfig(prompt_budget=np.bool_(True))


def test_replace_validates():
    config = RocketKVConfig(prompt_budget=64, window_size=8)
    assert config.replace(topk=3).topk == 3
    with pytest.raises(ValueError, match="page_size"):
        config.replace(page_size=5)


def test_triton_backend_needs_cuda_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton"):
        get_ops("triton", torch.device("cpu"))
    assert get_ops("torch", torch.device("cpu")).name == "torch"
    assert get_ops("auto", torch.device("cpu")).name == "torch"


# ---------------------------------------------------------------------------------------------------------- YAML

TRT_YAML = """\
sparse_attention_config:
  algorithm: rocket
  window_size: 16
  kernel_size: 31
  prompt_budget: 1024
  topk: 32
  topr: 96
  page_size: 8
  kt_cache_dtype: bfloat16
"""


def test_yaml_in_tensorrt_llm_shape():
    config = RocketKVConfig.from_yaml(TRT_YAML)
    assert config == RocketKVConfig(
        window_size=16, kernel_size=31, prompt_budget=1024, topk=32, topr=96, page_size=8, kt_cache_dtype="bfloat16"
    )


def test_yaml_round_trip_text_and_file(tmp_path):
    config = RocketKVConfig(
        window_size=8, kernel_size=7, prompt_budget=100, topk=5, topr=12, page_size=2,
        kt_cache_dtype="float32", backend="torch", capacity_headroom=17,
    )
    text = config.to_yaml()
    data = yaml.safe_load(text)
    assert list(data) == ["sparse_attention_config"]
    section = data["sparse_attention_config"]
    assert section["algorithm"] == "rocket"
    assert section["prompt_budget"] == 100 and section["page_size"] == 2 and section["kt_cache_dtype"] == "float32"
    assert RocketKVConfig.from_yaml(text) == config

    path = tmp_path / "rocket.yaml"
    config.to_yaml(path)
    assert RocketKVConfig.from_yaml(path) == config
    assert RocketKVConfig.from_yaml(str(path)) == config


def test_from_dict_flat_and_sectioned():
    flat = {"prompt_budget": 64, "window_size": 8, "topk": 4}
    assert RocketKVConfig.from_dict(flat) == RocketKVConfig(prompt_budget=64, window_size=8, topk=4)
    assert RocketKVConfig.from_dict({"sparse_attention_config": flat}) == RocketKVConfig.from_dict(flat)
    assert RocketKVConfig.from_dict(RocketKVConfig(topk=7).to_dict()) == RocketKVConfig(topk=7)


def test_yaml_unknown_key_named():
    text = TRT_YAML + "  use_interleave: true\n"
    with pytest.raises(ValueError) as info:
        RocketKVConfig.from_yaml(text)
    assert "use_interleave" in str(info.value)
    assert "prompt_budget" in str(info.value)  # lists what is allowed


def test_unknown_top_level_key_named():
    with pytest.raises(ValueError, match="kv_cache_config"):
        RocketKVConfig.from_dict({"sparse_attention_config": {"algorithm": "rocket"}, "kv_cache_config": {}})


@pytest.mark.parametrize("algorithm", ["quest", "Rocket", "dsa"])
def test_wrong_algorithm_named(algorithm):
    text = TRT_YAML.replace("algorithm: rocket", f"algorithm: {algorithm}")
    with pytest.raises(ValueError) as info:
        RocketKVConfig.from_yaml(text)
    message = str(info.value)
    assert "algorithm" in message and algorithm in message and "'rocket'" in message


def test_yaml_invalid_value_names_field():
    with pytest.raises(ValueError, match=re.escape("page_size")):
        RocketKVConfig.from_yaml(TRT_YAML.replace("page_size: 8", "page_size: 6"))
    with pytest.raises(ValueError, match="topk"):
        RocketKVConfig.from_yaml(TRT_YAML.replace("topk: 32", "topk: 3.5"))


def test_yaml_malformed_and_wrong_types():
    with pytest.raises(ValueError):
        RocketKVConfig.from_yaml("sparse_attention_config: [1, 2")
    with pytest.raises(ValueError, match="mapping"):
        RocketKVConfig.from_yaml("sparse_attention_config: 3\n")
    with pytest.raises(ValueError, match="mapping"):
        RocketKVConfig.from_dict(["prompt_budget", 3])


def test_missing_yaml_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        RocketKVConfig.from_yaml(str(tmp_path / "absent.yaml"))


def test_config_is_immutable_and_replace_validates():
    import dataclasses

    config = RocketKVConfig(prompt_budget=512)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.prompt_budget = 16
    changed = config.replace(prompt_budget=1024)
    assert changed.prompt_budget == 1024 and config.prompt_budget == 512
    with pytest.raises(ValueError, match="prompt_budget"):
        config.replace(prompt_budget=4)  # below window_size
    assert hash(config) == hash(RocketKVConfig(prompt_budget=512))  # usable as a dict key (compiled-step caches)


def test_unknown_key_suggests_the_close_field():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['prompt_budgte'\].*did you mean 'prompt_budget'\?"):
        RocketKVConfig.from_dict({"prompt_budgte": 256})
    with pytest.raises(ValueError) as info:
        RocketKVConfig.from_dict({"zzz": 1})
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("value", ["quest", "", None, 1])
def test_stage2_score_must_be_a_known_rule(value):
    with pytest.raises(ValueError, match=r"RocketKVConfig.stage2_score must be one of \['group_sign', 'head_bound'\]"):
        RocketKVConfig(stage2_score=value)


def test_stage2_score_head_bound_is_a_flag_of_the_ops():
    assert RocketKVConfig().stage2_score == "group_sign" and not RocketKVConfig().stage2_per_head_bound
    assert RocketKVConfig(stage2_score="head_bound").stage2_per_head_bound


def test_every_field_has_a_row_in_the_reference_with_its_default_and_choices():
    """docs/configuration.md is the field reference (the class docstring points there): every field has a row whose
    default is the field's default and whose allowed values name every choice the validation accepts."""
    from pathlib import Path

    from hf_rocketkv import config as config_module

    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", line)
        if match:
            rows.setdefault(match.group(1), (match.group(2).strip().strip("`"), match.group(3)))
    for name, default in RocketKVConfig.field_defaults().items():
        assert name in rows, f"docs/configuration.md has no row for {name}"
        assert rows[name][0] == str(default), (name, rows[name][0], default)
    choices = {"backend": config_module.BACKENDS, "decode_guard_checks": config_module.DECODE_GUARD_CHECKS,
               "decode_runner": config_module.DECODE_RUNNERS, "kt_cache_dtype": tuple(config_module.KT_CACHE_DTYPES),
               "stage1": config_module.STAGE1_POLICY_NAMES, "stage2": config_module.STAGE2_NAMES,
               "stage2_score": config_module.STAGE2_SCORES, "multi_turn": config_module.MULTI_TURN_MODES}
    for name, allowed in choices.items():
        missing = [value for value in allowed if f"`{value}`" not in rows[name][1]]
        assert not missing, f"docs/configuration.md: {name}'s allowed values lack {missing}"


@pytest.mark.slow  # fresh interpreters: ~30 s on the 2-core machine
def test_the_config_and_the_policies_load_in_either_order_in_a_fresh_process():
    """policies/ imports the names config.py owns: each loads first without the other failing, even when the
    package's __init__ (which imports everything in its own order) is bypassed, as tests/memory does."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for first, second in (("config", "policies"), ("policies", "config"), ("policies.stage2", "config")):
        script = (
            "import sys, types\n"
            f"sys.path.insert(0, {str(root)!r})\n"
            "stub = types.ModuleType('hf_rocketkv')\n"
            f"stub.__path__ = [{str(root / 'hf_rocketkv')!r}]\n"
            "sys.modules['hf_rocketkv'] = stub\n"
            f"import hf_rocketkv.{first}, hf_rocketkv.{second}\n"
            "from hf_rocketkv.config import RocketKVConfig\n"
            "from hf_rocketkv.policies import STAGE1_POLICY_NAMES, get_stage1_policy\n"
            "assert RocketKVConfig(stage1='h2o', stage2_sink_tokens=4).stage2_forced_pages == (1, 1)\n"
            "assert get_stage1_policy(STAGE1_POLICY_NAMES[0]).name == 'snapkv'\n"
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (first, done.stderr[-2000:])
