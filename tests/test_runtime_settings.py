"""RocketKVConfig's two kinds of fields: the algorithm (its own) and the runtime settings (``config.runtime``, a
``RuntimeSettings``), and the flat contract they keep: constructor and ``replace`` keywords, flat reads, ``to_dict``,
``from_dict``, YAML, equality, hashing, pickling.

The oracles are independent of the code: the field reference's tables (docs/configuration.md: the "Runtime settings"
table against every other field table), the runtime field names and the values below written out by hand, and
``OLD_YAML``, the text ``to_yaml()`` wrote for one config with every field set before the runtime fields had a class
of their own.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import pickle
import random
import re
from pathlib import Path

import pytest
import yaml

from hf_rocketkv import RocketKVConfig, RuntimeSettings

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
RUNTIME_SECTION = "## Runtime settings"
RUNTIME_NAMES = ("backend", "capacity_headroom", "prefill_batch_size", "decode_guard_checks", "decode_runner",
                 "deferred_stop_check", "eager_layer_graphs", "fused_rope", "fused_norm", "capacity_buckets",
                 "batch_buckets", "stage2_kernel", "fused_experts", "fused_mlp", "fused_qkv", "fused_residual",
                 "flash_window_prefill")

# RocketKVConfig(window_size=16, kernel_size=31, prompt_budget=1000, topk=40, topr=96, page_size=8,
# kt_cache_dtype="bfloat16", backend="torch", capacity_headroom=100, prefill_batch_size=2,
# decode_guard_checks="first_step", decode_runner="torch_compile", deferred_stop_check=False, eager_layer_graphs=False,
# fused_rope=False, fused_norm=False, capacity_buckets=(1024, 2048), batch_buckets=(1, 3), stage1="h2o",
# sink_tokens=2, token_budget=None, stage2="kt_pages", stage2_sink_tokens=8, stage2_recent_tokens=16,
# stage2_score="head_bound", stage2_kernel="split", dense_layers=1, budget_schedule="pyramid", multi_turn="evict",
# decode_budget=128, decode_interval=16, decode_window=8, decode_kernel_size=5).to_yaml(), one flat config class
OLD_YAML = """\
sparse_attention_config:
  algorithm: rocket
  window_size: 16
  kernel_size: 31
  prompt_budget: 1000
  topk: 40
  topr: 96
  page_size: 8
  kt_cache_dtype: bfloat16
  backend: torch
  capacity_headroom: 100
  prefill_batch_size: 2
  decode_guard_checks: first_step
  decode_runner: torch_compile
  deferred_stop_check: false
  eager_layer_graphs: false
  fused_rope: false
  fused_norm: false
  capacity_buckets:
  - 1024
  - 2048
  batch_buckets:
  - 1
  - 3
  stage1: h2o
  sink_tokens: 2
  token_budget: null
  stage2: kt_pages
  stage2_sink_tokens: 8
  stage2_recent_tokens: 16
  stage2_score: head_bound
  stage2_kernel: split
  dense_layers: 1
  budget_schedule: pyramid
  multi_turn: evict
  decode_budget: 128
  decode_interval: 16
  decode_window: 8
  decode_kernel_size: 5
"""
OLD_KEYS = [line.split(":")[0].strip() for line in OLD_YAML.splitlines()[2:] if not line.startswith("  -")]
# fields added after that YAML was written, and their defaults
ADDED_SINCE = {"fused_experts": True, "fused_mlp": True, "fused_qkv": True, "fused_residual": True,
               "flash_window_prefill": True}
KEYS = OLD_KEYS + list(ADDED_SINCE)  # every field, in to_dict()'s order

# values per field, valid alone (a combination may still be refused: the draw skips those)
VALUES = {
    "window_size": [1, 8, 32], "kernel_size": [1, 3, 63], "prompt_budget": [32, 64, 512, 2048],
    "topk": [16, 64, 128], "topr": [1, 64, 128], "page_size": [1, 2, 4, 8],
    "kt_cache_dtype": ["float8_e5m2", "bfloat16", "float16", "float32"],
    "stage1": ["snapkv", "streaming", "knorm", "h2o", "adakv", "random"], "sink_tokens": [0, 4],
    "token_budget": [None, None, 256], "stage2": ["kt_pages", "none"], "stage2_sink_tokens": [0, 4],
    "stage2_recent_tokens": [0, 8], "stage2_score": ["group_sign", "head_bound"], "dense_layers": [0, 1],
    "budget_schedule": ["flat", "pyramid"], "multi_turn": ["evict", "keep_all"], "decode_budget": [None, 64],
    "decode_interval": [1, 64], "decode_window": [1, 32], "decode_kernel_size": [1, 7],
    "backend": ["auto", "torch", "triton"], "capacity_headroom": [1, 256], "prefill_batch_size": [None, 2],
    "decode_guard_checks": ["first_step", "every_step"], "decode_runner": ["cuda_graphs", "torch_compile"],
    "deferred_stop_check": [True, False], "eager_layer_graphs": [True, False], "fused_rope": [True, False],
    "fused_norm": [True, False], "capacity_buckets": [None, (), (128, 4096), [64]],
    "batch_buckets": [None, (1, 2, 4), [8]], "stage2_kernel": ["auto", "fused", "split"],
    "fused_experts": [True, False], "fused_mlp": [True, False], "fused_qkv": [True, False],
    "fused_residual": [True, False],
    "flash_window_prefill": [True, False],
}


def _reference_tables() -> dict[str, list[str]]:
    """``{"runtime": [...], "algorithm": [...]}``: the field rows of docs/configuration.md, by the ``##`` section
    they stand in (the "Runtime settings" section's rows against every other's), one entry per row."""
    tables: dict[str, list[str]] = {"runtime": [], "algorithm": []}
    section = ""
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("## "):
            section = line
        elif match := re.match(r"\| `(\w+)` \| [^|]+ \| [^|]+ \|", line):
            tables["runtime" if section.startswith(RUNTIME_SECTION) else "algorithm"].append(match.group(1))
    return tables


def _draw(rng: random.Random) -> dict:
    """Keyword arguments of a valid config: a random subset of the fields, random values (retried until valid)."""
    while True:
        kwargs = {name: rng.choice(values) for name, values in VALUES.items() if rng.random() < 0.6}
        try:
            RocketKVConfig(**kwargs)
        except ValueError:
            continue
        return kwargs


def _split(kwargs: dict) -> tuple[dict, dict]:
    return ({k: v for k, v in kwargs.items() if k not in RUNTIME_NAMES},
            {k: v for k, v in kwargs.items() if k in RUNTIME_NAMES})


def _as_listed(value):
    return list(value) if isinstance(value, tuple) else value


# ------------------------------------------------------------------------------------------------ the two kinds
def test_the_two_kinds_partition_the_documented_fields():
    tables = _reference_tables()
    documented = tables["runtime"] + tables["algorithm"]
    assert len(documented) == len(set(documented)), f"a field has two rows: {sorted(documented)}"
    assert set(tables["runtime"]) == set(RUNTIME_NAMES)
    assert RocketKVConfig.RUNTIME_FIELDS == RUNTIME_NAMES
    assert set(RocketKVConfig.ALGORITHM_FIELDS) == set(tables["algorithm"])
    assert not set(RocketKVConfig.ALGORITHM_FIELDS) & set(RocketKVConfig.RUNTIME_FIELDS)
    assert set(RocketKVConfig.field_defaults()) == set(documented) == set(KEYS)
    # declaration order: the dataclasses' own
    assert RocketKVConfig.ALGORITHM_FIELDS == tuple(f.name for f in dataclasses.fields(RocketKVConfig)
                                                    if f.name != "runtime")
    assert RocketKVConfig.RUNTIME_FIELDS == tuple(f.name for f in dataclasses.fields(RuntimeSettings))


def test_field_defaults_are_the_flat_fields_of_a_default_config_in_yaml_order():
    defaults = RocketKVConfig.field_defaults()
    assert list(defaults) == KEYS
    assert defaults == RocketKVConfig().to_dict()
    assert RocketKVConfig(**defaults) == RocketKVConfig()
    assert defaults["backend"] == "auto" and defaults["capacity_headroom"] == 256 and defaults["topk"] == 64
    signature = inspect.signature(RocketKVConfig)
    assert list(signature.parameters) == [*KEYS, "runtime"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())


# ------------------------------------------------------------------------------------------------ random configs
@pytest.mark.parametrize("seed", range(4))
def test_random_configs_keep_the_flat_contract(seed):
    rng = random.Random(seed)
    for _ in range(50):
        kwargs = _draw(rng)
        config = RocketKVConfig(**kwargs)
        algorithm, runtime = _split(kwargs)
        # the same config through runtime=, and through runtime= with the flat runtime keywords beside it
        settings = RuntimeSettings(**runtime)
        assert config.runtime == settings
        assert RocketKVConfig(runtime=settings, **algorithm) == config
        assert RocketKVConfig(runtime=RuntimeSettings(), **kwargs) == config
        assert hash(RocketKVConfig(runtime=settings, **algorithm)) == hash(config)
        # flat reads: every field, the value given or its default
        expected = {**RocketKVConfig.field_defaults(), **kwargs}
        for name in KEYS:
            value = getattr(config, name)
            assert value == (tuple(expected[name]) if isinstance(expected[name], list) else expected[name]), name
            if name in RUNTIME_NAMES:
                assert value == getattr(config.runtime, name)
        # dict / JSON / YAML: the old keys in the old order, then those added since, bucket tuples as lists
        data = config.to_dict()
        assert list(data) == KEYS
        assert data == {name: _as_listed(expected[name]) for name in KEYS}
        assert config.algorithm_dict() == {k: v for k, v in data.items() if k not in RUNTIME_NAMES}
        assert RocketKVConfig.from_dict(data) == config
        assert RocketKVConfig.from_dict(json.loads(json.dumps(data))) == config
        text = config.to_yaml()
        assert yaml.safe_load(text) == {"sparse_attention_config": {"algorithm": "rocket", **data}}
        assert RocketKVConfig.from_yaml(text) == config
        # copies
        for clone in (pickle.loads(pickle.dumps(config)), copy.copy(config), copy.deepcopy(config)):
            assert clone == config and hash(clone) == hash(config) and clone.to_dict() == data


@pytest.mark.parametrize("seed", range(2))
def test_replace_routes_each_change_to_its_owner(seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        kwargs, changes = _draw(rng), _draw(rng)
        config = RocketKVConfig(**kwargs)
        try:
            expected = RocketKVConfig(**{**kwargs, **changes})
        except ValueError as err:
            with pytest.raises(ValueError, match=re.escape(str(err))):
                config.replace(**changes)
            continue
        changed = config.replace(**changes)
        assert changed == expected and dataclasses.replace(config, **changes) == expected
        assert config == RocketKVConfig(**kwargs)  # the original is untouched
        _, runtime_changes = _split(changes)
        if not runtime_changes:
            assert changed.runtime == config.runtime
        assert changed.runtime == config.runtime.replace(**runtime_changes)


def test_replace_of_both_kinds_and_of_runtime_itself():
    config = RocketKVConfig(prompt_budget=512, backend="triton", fused_norm=False)
    changed = config.replace(backend="torch", topk=8)
    assert (changed.backend, changed.topk, changed.prompt_budget, changed.fused_norm) == ("torch", 8, 512, False)
    assert changed.runtime == RuntimeSettings(backend="torch", fused_norm=False)
    swapped = config.replace(runtime=RuntimeSettings(decode_runner="torch_compile"))
    assert swapped.backend == "auto" and swapped.decode_runner == "torch_compile" and swapped.prompt_budget == 512
    assert config.replace(runtime=RuntimeSettings(), fused_rope=False).runtime == RuntimeSettings(fused_rope=False)


def test_flat_runtime_keywords_beside_runtime_override_its_fields():
    settings = RuntimeSettings(backend="torch", fused_norm=False, batch_buckets=(1, 2))
    config = RocketKVConfig(runtime=settings, fused_norm=True, topk=8)
    assert config.runtime == RuntimeSettings(backend="torch", fused_norm=True, batch_buckets=(1, 2))
    assert settings.fused_norm is False  # the settings given are not changed
    assert RocketKVConfig(runtime=settings, batch_buckets=[4, 8]).batch_buckets == (4, 8)


def test_derived_properties_read_both_kinds():
    config = RocketKVConfig(prompt_budget=100, capacity_headroom=28, decode_runner="torch_compile")
    assert config.effective_capacity_buckets == (128,)
    assert config.effective_batch_buckets == (1, 2, 4, 8, 16, 32, 64, 128)
    bounded = config.replace(decode_budget=32, decode_interval=8)
    assert bounded.effective_capacity_buckets == (140,) and bounded.decode_headroom(1000) == 40
    assert RocketKVConfig(stage2_sink_tokens=4, stage2_recent_tokens=8, page_size=4).stage2_forced_pages == (1, 3)


# ------------------------------------------------------------------------------------------------ YAML written before
def test_yaml_written_before_the_split_loads_and_is_written_back_unchanged():
    config = RocketKVConfig.from_yaml(OLD_YAML)
    assert config.runtime == RuntimeSettings(
        backend="torch", capacity_headroom=100, prefill_batch_size=2, decode_guard_checks="first_step",
        decode_runner="torch_compile", deferred_stop_check=False, eager_layer_graphs=False, fused_rope=False,
        fused_norm=False, capacity_buckets=(1024, 2048), batch_buckets=(1, 3), stage2_kernel="split")
    assert config.algorithm_dict() == {
        "window_size": 16, "kernel_size": 31, "prompt_budget": 1000, "topk": 40, "topr": 96, "page_size": 8,
        "kt_cache_dtype": "bfloat16", "stage1": "h2o", "sink_tokens": 2, "token_budget": None, "stage2": "kt_pages",
        "stage2_sink_tokens": 8, "stage2_recent_tokens": 16, "stage2_score": "head_bound", "dense_layers": 1,
        "budget_schedule": "pyramid", "multi_turn": "evict", "decode_budget": 128, "decode_interval": 16,
        "decode_window": 8, "decode_kernel_size": 5}
    added = "".join(f"  {name}: {str(value).lower()}\n" for name, value in ADDED_SINCE.items())  # at their defaults
    assert config.to_yaml() == OLD_YAML + added


def test_a_flat_mapping_with_runtime_keys_loads_and_typos_are_named():
    flat = {"topk": 8, "backend": "torch", "capacity_buckets": [64, 128], "stage2_kernel": "fused"}
    config = RocketKVConfig.from_dict(flat)
    assert config == RocketKVConfig(topk=8, backend="torch", capacity_buckets=(64, 128), stage2_kernel="fused")
    assert RocketKVConfig.from_dict({"sparse_attention_config": flat}) == config
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['backnd'\].*did you mean 'backend'\?"):
        RocketKVConfig.from_dict({"backnd": "torch"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['runtime'\]"):  # the mapping is flat
        RocketKVConfig.from_dict({"runtime": {"backend": "torch"}})


# ------------------------------------------------------------------------------------------------ immutability, errors
def test_every_write_raises_as_on_a_frozen_dataclass():
    config = RocketKVConfig()
    for name, value in (("topk", 8), ("backend", "torch"), ("fused_norm", False), ("runtime", RuntimeSettings())):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, name, value)
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(config, name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.runtime.backend = "torch"
    assert config == RocketKVConfig()


@pytest.mark.parametrize("name, value, fragment", [
    ("backend", "cuda", "RocketKVConfig.backend must be one of ['auto', 'torch', 'triton'], got 'cuda'"),
    ("capacity_headroom", 2.0, "RocketKVConfig.capacity_headroom must be an integer, got 2.0 (float)"),
    ("capacity_headroom", 0, "RocketKVConfig.capacity_headroom must be >= 1, got 0"),
    ("prefill_batch_size", 0, ("RocketKVConfig.prefill_batch_size must be None (the whole batch, in row groups when it would not fit in the free memory) or an integer >= 1, "
                               "got 0")),
    ("decode_guard_checks", "never", ("RocketKVConfig.decode_guard_checks must be one of "
                                      "['first_step', 'every_step'], got 'never'")),
    ("decode_runner", "eager", ("RocketKVConfig.decode_runner must be one of ['cuda_graphs', 'torch_compile'], "
                                "got 'eager'")),
    ("fused_rope", 1, "RocketKVConfig.fused_rope must be True or False, got 1"),
    ("capacity_buckets", (2, 1), ("RocketKVConfig.capacity_buckets must be None (the decode runner's default) or "
                                  "a strictly ascending tuple of integers >= 1, e.g. (2048, 4096) (() turns it off), "
                                  "got (2, 1)")),
    ("batch_buckets", 8, "RocketKVConfig.batch_buckets must be None"),
    ("stage2_kernel", "x", ("RocketKVConfig.stage2_kernel must be one of ['auto', 'fused', 'split'] (how the "
                            "Triton backend runs stage 2")),
])
def test_runtime_errors_name_the_config_field_wherever_they_are_raised(name, value, fragment):
    messages = []
    for build in (lambda: RuntimeSettings(**{name: value}), lambda: RocketKVConfig(**{name: value}),
                  lambda: RocketKVConfig().replace(**{name: value}), lambda: RuntimeSettings().replace(**{name: value}),
                  lambda: RocketKVConfig.from_dict({name: value})):
        with pytest.raises(ValueError) as info:
            build()
        messages.append(str(info.value))
    assert fragment in messages[0] and len(set(messages)) == 1, messages


def test_unknown_keywords_positional_arguments_and_a_wrong_runtime_are_refused():
    with pytest.raises(TypeError, match=r"RocketKVConfig.__init__\(\) got an unexpected keyword argument 'prompt'"):
        RocketKVConfig(prompt=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        RocketKVConfig().replace(bogus=1)
    with pytest.raises(TypeError):
        RocketKVConfig(32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'topk'"):
        RuntimeSettings(topk=8)
    with pytest.raises(ValueError, match="RocketKVConfig.runtime must be a RuntimeSettings, got dict"):
        RocketKVConfig(runtime={"backend": "torch"})


def test_algorithm_errors_are_unchanged_beside_runtime_settings():
    with pytest.raises(ValueError, match=r"RocketKVConfig.page_size must be a power of 2 \(1, 2, 4, 8, ...\), got 6"):
        RocketKVConfig(runtime=RuntimeSettings(backend="torch"), page_size=6)
    with pytest.raises(ValueError, match="the forced stage-2 pages must fit in topk=2"):
        RocketKVConfig(backend="torch", topk=2, stage2_sink_tokens=8)
