"""A fuzz of the Python API's configuration surface (hypothesis): ``RocketKVConfig`` fields and ``generate()``
arguments, valid and invalid, alone and combined, on tiny random models (CPU, float32, the PyTorch reference
backend).

Every outcome is one of:

- a clear error: ``ValueError``, ``TypeError`` or ``NotImplementedError`` whose message names a field or argument
  the example set (checked against the names drawn, not against the code's own list);
- transformers' own outcome for the same ``generate()`` arguments: the reference (the same weights on transformers'
  attention with its own ``DynamicCache``) raising the same exception type (transformers validates those arguments
  before any cache is involved);
- tokens equal to an independent path's:
    * nothing evicted (every prompt within every layer's budget, every page attended, no decode-time compression):
      the reference's tokens, the same batch and arguments (sampling with the same seed);
    * otherwise, greedy or beam search: each row alone, unpadded, in one prefill forward, on a fresh cache of the
      same config (a padded batch, a chunked prefill and row groups must not change a row's tokens);
    * sampling with eviction: only shapes and the vocabulary are checked (a batch draws its random numbers jointly).

Never another exception type, never a silent difference. The examples are derandomized (the same ones every run,
so CI cannot flake on a new one); ``FUZZ_EXAMPLES`` bounds the default run (< 60 s on the 2-core machine), and the
``slow`` variant draws many more: new ones on every run outside CI, a fixed set where ``CI`` is set.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from hf_rocketkv import RocketKVCache, RocketKVConfig
from tests.support.hybrid_models import make_hybrid_models
from tests.support.tiny_models import PAD, VOCAB, left_pad, make_models, random_ids

CLEAR_ERRORS = (ValueError, TypeError, NotImplementedError)
DEFAULTS = RocketKVConfig.field_defaults()  # every flat field, algorithm and runtime

# ------------------------------------------------------------------------------------------------ config values
# per field: ordinary values, edges and wrong types (none of them from the validation code)
FIELD_VALUES = {
    "window_size": [1, 4, 8, 32, 0, -1, 2.5, "8", True, None],
    "kernel_size": [1, 3, 5, 7, 63, 0, 2, 4, -1, 1.0],
    "prompt_budget": [1, 8, 16, 24, 64, 512, 2048, 0, -5, 10.0, None],
    "topk": [1, 2, 3, 4, 64, 4096, 0, -1, "4"],
    "topr": [1, 8, 16, 128, 0, -2, 17],
    "page_size": [1, 2, 4, 8, 3, 0, 16, -4],
    "kt_cache_dtype": ["float8_e5m2", "bfloat16", "float16", "float32", "int8", "fp8", None],
    "backend": ["auto", "torch", "triton", "cuda", ""],
    "capacity_headroom": [0, 1, 256, -1, 2.0],
    "prefill_batch_size": [None, 1, 2, 0, -1, 1.5],
    "decode_guard_checks": ["first_step", "every_step", "never"],
    "decode_runner": ["cuda_graphs", "torch_compile", "eager"],
    "deferred_stop_check": [True, False, 1, "yes", None],
    "eager_layer_graphs": [True, False, 0],
    "fused_rope": [True, False, "no"],
    "fused_norm": [True, False, 1],
    "fused_experts": [True, False, 0],
    "fused_mlp": [True, False, 0],
    "fused_qkv": [True, False, 0],
    "fused_residual": [True, False, 0],
    "flash_window_prefill": [True, False, 0],
    "capacity_buckets": [None, (), (64,), [128, 256], (256, 128), (0,), (1.5,), 64],
    "batch_buckets": [None, (1, 2, 4), (), (3,), (0,), (2, 1), [1, 8]],
    "stage1": ["snapkv", "streaming", "knorm", "h2o", "adakv", "random", "bogus", 3, None],
    "sink_tokens": [0, 4, -1, 1.5],
    "token_budget": [None, 16, 100, 1, 0, -1, 2.5],
    "stage2": ["kt_pages", "none", "dense"],
    "stage2_sink_tokens": [0, 4, 8, -1],
    "stage2_recent_tokens": [0, 8, 16, -1],
    "stage2_score": ["group_sign", "head_bound", "x"],
    "stage2_kernel": ["auto", "fused", "split", "x"],
    "dense_layers": [0, 1, 2, 3, -1],
    "budget_schedule": ["flat", "pyramid", "x"],
    "multi_turn": ["evict", "keep_all", "x"],
    "decode_budget": [None, 8, 16, 0, -1],
    "decode_interval": [1, 4, 64, 0],
    "decode_window": [1, 8, 32, 0],
    "decode_kernel_size": [1, 7, 2, 0],
}
assert set(FIELD_VALUES) == set(DEFAULTS), set(FIELD_VALUES) ^ set(DEFAULTS)  # a new field must be fuzzed too


def field_changes(values: dict) -> st.SearchStrategy[dict]:
    """Some fields of ``values`` (0 to 4 of them), each set to one of its values."""
    names = sorted(values)
    return st.lists(st.sampled_from(names), max_size=4, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({name: st.sampled_from(values[name]) for name in chosen}))


def named(message: str, names) -> bool:
    return any(name in message for name in names)


def changed(changes: dict) -> list[str]:
    """The fields given another value than their default (``1`` is not ``True``: types kept apart)."""
    return [name for name, value in changes.items()
            if not (type(value) is type(DEFAULTS[name]) and value == DEFAULTS[name])]


def check_config(changes: dict) -> RocketKVConfig | None:
    """The config, or None after checking its refusal is a clear error naming a field it was given."""
    try:
        config = RocketKVConfig(**changes)
    except CLEAR_ERRORS as err:
        assert named(str(err), changed(changes) or changes), f"{type(err).__name__} names none of {changes}: {err}"
        return None
    for name, value in changes.items():  # what was given is what is kept (lists as tuples)
        assert getattr(config, name) == (tuple(value) if isinstance(value, list) else value), name
    assert config.replace() == config
    if isinstance(config.stage1, str):
        assert RocketKVConfig.from_dict(config.to_dict()) == config
        assert RocketKVConfig.from_yaml(config.to_yaml()) == config
    return config


@settings(max_examples=800, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(field_changes(FIELD_VALUES))
def test_every_config_is_accepted_whole_or_refused_naming_a_field(changes):
    check_config(changes)


# ------------------------------------------------------------------------------------------------ generate()
# fields a CPU run on a tiny model can exercise (the decode runner, buckets and fused paths act on CUDA only), with
# values mostly valid for a 2-layer model of head_dim 16 (topr above 16 is refused at the first forward)
GENERATE_VALUES = {
    "prompt_budget": [8, 16, 24, 64, 512],
    "window_size": [1, 4, 8],
    "kernel_size": [1, 3, 5],
    "topk": [1, 2, 3, 8, 4096],
    "topr": [1, 8, 16, 32],
    "page_size": [1, 2, 4, 8],
    "kt_cache_dtype": ["float8_e5m2", "bfloat16", "float32"],
    "stage1": ["snapkv", "streaming", "knorm", "h2o", "adakv"],
    "sink_tokens": [0, 4],
    "stage2": ["kt_pages", "none"],
    "stage2_sink_tokens": [0, 4],
    "stage2_recent_tokens": [0, 8],
    "stage2_score": ["group_sign", "head_bound"],
    "dense_layers": [0, 1, 2],
    "budget_schedule": ["flat", "pyramid"],
    "multi_turn": ["evict", "keep_all"],
    "decode_budget": [None, 8],
    "decode_interval": [1, 4],
    "decode_window": [1, 4],
    "prefill_batch_size": [None, 1, 2],
    "capacity_headroom": [0, 1, 256],
}
# generate() arguments: (valid values, invalid ones); an invalid one is drawn about one time in six
# what the drawn fields change: a config that evicts prompts over 24 tokens and reads 3 pages of 4 per step
BASE = dict(prompt_budget=24, window_size=8, kernel_size=5, topk=3, topr=8, page_size=4)
ARGUMENTS = {
    "max_new_tokens": ([1, 2, 6], [0, -1, 1.5, "3"]),
    "prefill_chunk_size": ([None, 1, 4, 7], [0, -2, 2.5]),
    "num_beams": ([1, 2], [0]),
    "do_sample": ([False, True], []),
}


def argument(valid: list, invalid: list) -> st.SearchStrategy:
    return st.sampled_from(valid * (5 * max(1, len(invalid)) // len(valid) + 1) + invalid)


@pytest.fixture(scope="module")
def fuzz_models():
    """name -> (rocket, reference): a tiny Llama (full attention; reference on sdpa) and a tiny Gemma 3 (sliding
    and full layers, q/k norms; reference on eager)."""
    llama = make_models("llama")
    gemma3 = distinct_norm_weights(*make_hybrid_models("gemma3"))
    return {"llama": llama, "gemma3": gemma3}


def distinct_norm_weights(rocket, reference):
    """Every norm weight of both models drawn from N(0, 0.5). transformers initialises Gemma's ``(1 + weight)``
    norms to zero, so every key after the q/k norm would have the same length: ``stage1="knorm"`` would then rank
    tokens by rounding noise, and a chunked prefill (other shapes, other rounding) could keep other tokens."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if "norm" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    rocket.load_state_dict(reference.state_dict())
    return rocket, reference


def run(model, ids, mask, seed, cache=None, **arguments):
    kwargs = dict(attention_mask=mask, pad_token_id=PAD, eos_token_id=None, **arguments)
    if cache is not None:
        kwargs["past_key_values"] = cache
    torch.manual_seed(seed)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **kwargs)


def outcome(call):
    try:
        return call(), None
    except Exception as err:  # noqa: BLE001 - classified by the caller
        return None, err


def nothing_evicted(config: RocketKVConfig, lengths: list[int], width: int, new_tokens: int) -> bool:
    """Every row within every layer's budget, every page attended, no decode-time compression, budgets not derived:
    RocketKV must then equal dense attention. Pyramid shares go down to half the budget, rounded to whole tokens and
    pages (docs/configuration.md)."""
    share = 0.5 if config.budget_schedule == "pyramid" else 1.0  # a layer's share is rounded: down at worst
    return (config.token_budget is None and config.decode_budget is None
            and max(lengths) <= int(share * config.prompt_budget)
            and (config.stage2 == "none" or width + new_tokens <= int(share * config.topk) * config.page_size))


def check_generate(models, model_name, changes, lengths, arguments, seed):
    rocket, reference = models[model_name]
    changes = {**BASE, **changes, "backend": "torch"}
    config = check_config(changes)
    assume(config is not None)
    rows = [random_ids(1, n, seed=seed + n)[0] for n in lengths]
    ids, mask = left_pad(rows)
    arguments = {name: value for name, value in arguments.items() if value is not None}
    if arguments.get("do_sample"):
        arguments["num_beams"] = 1 if arguments.get("num_beams") == 2 else arguments.get("num_beams", 1)
    names = [*changed(changes), *arguments]
    where = f"{model_name}, config {changes}, rows {lengths}, {arguments}, seed {seed}"

    expected, refused = outcome(lambda: run(reference, ids, mask, seed, **arguments))
    got, error = outcome(lambda: run(rocket, ids, mask, seed, RocketKVCache(config), **arguments))
    if error is not None:
        if refused is not None and type(error) is type(refused):
            return "refused as transformers refuses"
        assert isinstance(error, CLEAR_ERRORS), f"{type(error).__name__}: {error} ({where})"
        assert named(str(error), names), f"{type(error).__name__} names none of {names}: {error} ({where})"
        return "clear error"
    assert refused is None, f"transformers refuses {arguments} ({refused!r}) but RocketKV ran ({where})"
    new_tokens = expected.shape[1] - ids.shape[1]
    assert got.shape == expected.shape and int(got.max()) < VOCAB
    if nothing_evicted(config, lengths, ids.shape[1], new_tokens):
        assert torch.equal(got, expected), f"nothing evicted, yet not transformers' tokens ({where})"
        return "transformers' tokens"
    if arguments.get("do_sample"):
        return "sampled with eviction"
    alone_arguments = {k: v for k, v in arguments.items() if k != "prefill_chunk_size"}
    beams = arguments.get("num_return_sequences", 1)
    for i, row in enumerate(rows):
        alone = run(rocket, row[None], torch.ones(1, len(row), dtype=torch.long), seed, RocketKVCache(config),
                    **alone_arguments)
        assert torch.equal(got[i * beams: (i + 1) * beams, ids.shape[1]:], alone[:, len(row):]), \
            f"row {i} differs from the row alone ({where})"
    return "each row alone"


generate_examples = dict(
    model_name=st.sampled_from(["llama", "gemma3"]),
    changes=field_changes(GENERATE_VALUES),
    lengths=st.lists(st.integers(3, 60), min_size=1, max_size=3),
    arguments=st.fixed_dictionaries({name: argument(*values) for name, values in ARGUMENTS.items()}),
    seed=st.integers(0, 1000),
)
FUZZ_EXAMPLES = int(os.environ.get("HF_ROCKETKV_FUZZ_EXAMPLES", "60"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much])
@given(**generate_examples)
def test_generate_gives_a_clear_error_or_the_reference_tokens(fuzz_models, model_name, changes, lengths, arguments,
                                                              seed):
    event(check_generate(fuzz_models, model_name, changes, lengths, arguments, seed))


@pytest.mark.slow
@settings(max_examples=400, deadline=None, derandomize=bool(os.environ.get("CI")),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much])
@given(**generate_examples)
def test_generate_fuzz_many_examples(fuzz_models, model_name, changes, lengths, arguments, seed):
    event(check_generate(fuzz_models, model_name, changes, lengths, arguments, seed))
