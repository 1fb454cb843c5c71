"""RocketKVConfig: every knob of the algorithm, validated, with TensorRT-LLM's names and defaults.

The YAML shape is the one TensorRT-LLM users already write for ``trtllm-serve``/``trtllm-bench``::

    sparse_attention_config:
      algorithm: rocket
      window_size: 32
      kernel_size: 63
      prompt_budget: 2048
      topk: 64
      topr: 128
      page_size: 4
      kt_cache_dtype: float8_e5m2
      # hf_rocketkv's own keys
      backend: auto

Two kinds of fields, read and written flat (``config.topk``, ``config.backend``, ``to_dict()``, YAML): the algorithm
(``ALGORITHM_FIELDS``: what is kept and read, TensorRT-LLM's keys plus ours; ``algorithm_dict()``) and the runtime
settings (``RUNTIME_FIELDS``: how this machine runs it), held as ``config.runtime``, a ``RuntimeSettings``
(runtime_settings.py, which owns their names and checks).

The package's ground floor (with runtime_settings.py, the only module it imports): it owns the names its fields
accept and the page arithmetic it validates with, and policies/ imports them from here (never the other way). Every
field is described in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

# the runtime names are re-exported: they were defined here, and code reads them from hf_rocketkv.config
from .runtime_settings import (
    BACKENDS,
    BUCKET_FIELDS,
    DECODE_GUARD_CHECKS,
    DECODE_RUNNERS,
    DEFAULT_BATCH_BUCKETS,
    STAGE2_KERNELS,
    RuntimeSettings,
    is_int,
)

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "BUCKET_FIELDS", "BUDGET_SCHEDULES", "DECODE_GUARD_CHECKS", "DECODE_RUNNERS",
           "DEFAULT_BATCH_BUCKETS", "KT_CACHE_DTYPES", "MULTI_TURN_MODES", "STAGE1_POLICY_NAMES", "STAGE2_KERNELS",
           "STAGE2_NAMES", "STAGE2_SCORES", "YAML_ALGORITHM", "YAML_SECTION", "RocketKVConfig", "RuntimeSettings",
           "fit_forced_pages", "forced_page_counts", "is_stage1_policy"]

# The names the config's fields accept, and the arithmetic it validates with: policies/ imports them from here.
# stage1 by name (a policy object is accepted too); policies/registry.py builds the policy of each name
STAGE1_POLICY_NAMES = ("snapkv", "streaming", "knorm", "h2o", "adakv", "random")
# stage2: "kt_pages" (RocketKV's page top-k) or "none" (every kept token attended: stage 1 only)
STAGE2_NAMES = ("kt_pages", "none")
# how a query head scores a KT page: "group_sign" (RocketKV, TensorRT-LLM: the group-summed query's sign picks Kmax
# or Kmin per channel) or "head_bound" (each head by its own sign: Quest's bound of its largest logit on the page)
STAGE2_SCORES = ("group_sign", "head_bound")
# budget_schedule: how prompt_budget and topk are spread over the RocketKV layers (cache/layer_plan.py): "flat" (every
# layer the same) or "pyramid" (PyramidKV-style: linear from 1.5x at the first RocketKV layer to 0.5x at the last,
# the same total)
BUDGET_SCHEDULES = ("flat", "pyramid")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def is_stage1_policy(obj: object) -> bool:
    """An object (not a name) usable as a stage-1 policy: it has a ``name`` and a callable ``select``."""
    if isinstance(obj, str):
        return False
    return isinstance(getattr(obj, "name", None), str) and callable(getattr(obj, "select", None))


def forced_page_counts(sink_tokens: int, recent_tokens: int, page_size: int) -> tuple[int, int]:
    """``(sink_pages, recent_pages)`` for the token counts: ``(ceil(s / P), 1 + ceil(r / P))``; the recent count
    always includes the newest page (RocketKV's rule), so ``r = 0`` gives ``(.., 1)``."""
    return _ceil_div(sink_tokens, page_size), 1 + _ceil_div(recent_tokens, page_size)


def fit_forced_pages(sink_pages: int, recent_pages: int, topk: int) -> tuple[int, int]:
    """Forced counts trimmed to fit ``topk`` (token-budget mode derives ``topk`` per request, after validation):
    recent pages first (at least the newest page), then sinks with what is left."""
    recent = min(recent_pages, topk)
    return min(sink_pages, topk - recent), recent


# the KT cache's dtypes by name (torch's attribute names: ``getattr(torch, name)``, read when a cache is built, so
# that the config, and the command line that reads it, do not import torch)
KT_CACHE_DTYPES: tuple[str, ...] = ("float8_e5m2", "bfloat16", "float16", "float32")
MULTI_TURN_MODES = ("evict", "keep_all")
YAML_SECTION = "sparse_attention_config"
YAML_ALGORITHM = "rocket"
# every field, flat, in the order to_dict() and YAML files list them (the two kinds interleaved, as they were added)
_FLAT_FIELDS = (
    "window_size", "kernel_size", "prompt_budget", "topk", "topr", "page_size", "kt_cache_dtype", "backend",
    "capacity_headroom", "prefill_batch_size", "decode_guard_checks", "decode_runner", "deferred_stop_check",
    "eager_layer_graphs", "fused_rope", "fused_norm", "capacity_buckets", "batch_buckets", "stage1", "sink_tokens",
    "token_budget", "stage2", "stage2_sink_tokens", "stage2_recent_tokens", "stage2_score", "stage2_kernel",
    "dense_layers", "budget_schedule", "multi_turn", "decode_budget", "decode_interval", "decode_window",
    "decode_kernel_size", "fused_experts", "fused_mlp", "fused_qkv", "fused_residual",
    "flash_window_prefill",
)
_DEFAULT_RUNTIME = RuntimeSettings()


def _plain_int(value: Any) -> Any:
    """An integer of another type (``numpy.int64``) as a Python int; anything else as it is (a bool stays a bool, and
    is refused where a count is due; numpy's bool is no ``numbers.Integral``)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _flat_fields(cls: type) -> type:
    """Class decorator of RocketKVConfig: its field-name tuples, a read-only property per runtime field
    (``config.backend`` is ``config.runtime.backend``) and the flat constructor's signature (for help())."""
    cls.ALGORITHM_FIELDS = tuple(f.name for f in fields(cls) if f.name != "runtime")
    cls.RUNTIME_FIELDS = tuple(f.name for f in fields(RuntimeSettings))
    if sorted(_FLAT_FIELDS) != sorted(cls.ALGORITHM_FIELDS + cls.RUNTIME_FIELDS):
        raise TypeError("config.py: _FLAT_FIELDS must list every algorithm and runtime field once")
    for name in cls.RUNTIME_FIELDS:
        setattr(cls, name, _runtime_field(name))
    parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
                  for name, default in _defaults(cls).items()]
    parameters.append(inspect.Parameter("runtime", inspect.Parameter.KEYWORD_ONLY, default=None))
    cls.__signature__ = inspect.Signature(parameters)
    return cls


def _runtime_field(name: str) -> property:
    """``config.<name>`` reads ``config.runtime.<name>`` (a plain function: torch.compile traces it, as it reads the
    config inside a compiled decode step; an operator.attrgetter it cannot)."""

    def read(self: RocketKVConfig) -> Any:
        return getattr(self.runtime, name)

    return property(read, doc=f"``runtime.{name}``: a runtime setting (RuntimeSettings), read flat.")


def _defaults(cls: type) -> dict[str, Any]:
    """Every flat field's default, in to_dict()'s order."""
    defaults = {f.name: f.default for klass in (cls, RuntimeSettings) for f in fields(klass) if f.name != "runtime"}
    return {name: defaults[name] for name in _FLAT_FIELDS}


@_flat_fields
@dataclass(frozen=True, init=False)
class RocketKVConfig:
    """RocketKV settings: TensorRT-LLM's ``RocketSparseAttentionConfig`` fields and defaults, plus our own.

    Immutable (a frozen dataclass): a cache keeps the config it was given, so change one with
    ``config.replace(field=value)``, which validates the copy. docs/configuration.md describes every field: what it
    does, its default and the values allowed; an invalid value raises ``ValueError`` naming the field, the value and
    what is allowed.

    The algorithm's fields (``ALGORITHM_FIELDS``) are this class's own; the runtime settings (``RUNTIME_FIELDS``)
    live in ``runtime``, a ``RuntimeSettings``, and read flat: ``config.backend``. The constructor and ``replace``
    take both kinds as flat keywords (``RocketKVConfig(prompt_budget=512, backend="torch")``), and
    ``runtime=RuntimeSettings(...)`` too (flat runtime keywords beside it change its fields).
    """

    ALGORITHM_FIELDS: ClassVar[tuple[str, ...]]  # set by _flat_fields, in declaration order
    RUNTIME_FIELDS: ClassVar[tuple[str, ...]]  # RuntimeSettings' fields, in its declaration order

    window_size: int = 32
    kernel_size: int = 63
    prompt_budget: int = 2048
    topk: int = 64
    topr: int = 128
    page_size: int = 4
    kt_cache_dtype: str = "float8_e5m2"
    # policies (validated in _check_policy_fields)
    stage1: Any = "snapkv"  # a name from STAGE1_POLICY_NAMES or a policy object
    sink_tokens: int = 4
    token_budget: int | None = None
    # stage-2 options (validated in _check_stage2_fields)
    stage2: str = "kt_pages"
    stage2_sink_tokens: int = 0
    stage2_recent_tokens: int = 0
    stage2_score: str = "group_sign"
    # per-layer layout (validated in _check_layer_plan)
    dense_layers: int = 0
    budget_schedule: str = "flat"
    # multi-turn (validated in _check_multi_turn)
    multi_turn: str = "evict"
    # decode-time compression (validated in _check_decode_compression)
    decode_budget: int | None = None
    decode_interval: int = 64
    decode_window: int = 32
    decode_kernel_size: int = 7
    # how this machine runs it (validated when built: runtime_settings.py)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)

    def __init__(self, *, runtime: RuntimeSettings | None = None, **values: Any) -> None:
        unknown = [name for name in values if name not in _FLAT_FIELDS]
        if unknown:
            raise TypeError(f"RocketKVConfig.__init__() got an unexpected keyword argument {unknown[0]!r}")
        values = {name: _plain_int(value) for name, value in values.items()}
        if runtime is None:
            runtime = _DEFAULT_RUNTIME
        elif not isinstance(runtime, RuntimeSettings):
            raise ValueError(f"RocketKVConfig.runtime must be a RuntimeSettings, got {type(runtime).__name__}")
        changes = {name: values.pop(name) for name in self.RUNTIME_FIELDS if name in values}
        object.__setattr__(self, "runtime", runtime.replace(**changes) if changes else runtime)
        for f in fields(self):
            if f.name != "runtime":
                object.__setattr__(self, f.name, values.get(f.name, f.default))
        for check in _ALGORITHM_CHECKS:
            check(self)

    # ------------------------------------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, the value and what is allowed (the first failing check: the
        runtime settings', then the algorithm's in the order of _ALGORITHM_CHECKS)."""
        self.runtime.validate()
        for check in _ALGORITHM_CHECKS:
            check(self)

    @classmethod
    def field_defaults(cls) -> dict[str, Any]:
        """Every flat field's default (both kinds), in ``to_dict()``'s order."""
        return _defaults(cls)

    # ------------------------------------------------------------------------------------------------ derived
    # (properties that combine both kinds stay here: the runtime fields read flat)
    @property
    def stage2_forced_pages(self) -> tuple[int, int]:
        """``(sink_pages, recent_pages)`` stage 2 attends at every step besides the top-k by score (part of topk)."""
        sink, recent = forced_page_counts(self.stage2_sink_tokens, self.stage2_recent_tokens, self.page_size)
        return fit_forced_pages(sink, recent, self.topk)

    @property
    def stage2_per_head_bound(self) -> bool:
        """``stage2_score == "head_bound"``: the ops' ``per_head_bound`` flag."""
        return self.stage2_score == "head_bound"

    @property
    def per_head_budgets(self) -> bool:
        """Stage 1 gives each KV head its own number of kept tokens (``stage1="adakv"``, or a policy object that
        declares ``per_head_budgets = True``): the cache then stores one length per row and KV head."""
        if isinstance(self.stage1, str):
            return self.stage1 == "adakv"
        return bool(getattr(self.stage1, "per_head_budgets", False))

    @property
    def stage1_keep_first(self) -> int:
        """Prompt tokens at the start of each row that stage 1 always keeps (``Stage1Inputs.keep_first``): the
        stage-2 sinks, so that the sink pages hold them. 0 with stage2="none", which attends every kept token."""
        return self.stage2_sink_tokens if self.stage2 == "kt_pages" else 0

    def decode_headroom(self, new_tokens: int) -> int:
        """Slots to reserve beyond the kept prompt for ``new_tokens`` generated tokens: all of them, or at most
        ``decode_budget + decode_interval`` with decode-time compression (independent of max_new_tokens)."""
        if self.decode_budget is None:
            return new_tokens
        return min(new_tokens, self.decode_budget + self.decode_interval)

    @property
    def kt_torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.kt_cache_dtype)

    @property
    def effective_batch_buckets(self) -> tuple[int, ...]:
        """The batch sizes generate() pads to (``batch_buckets``, or the decode runner's default)."""
        if self.batch_buckets is not None:
            return self.batch_buckets
        return DEFAULT_BATCH_BUCKETS if self.decode_runner == "torch_compile" else ()

    @property
    def effective_capacity_buckets(self) -> tuple[int, ...]:
        """The decode capacities (slots per row) stores are rounded up to: ``capacity_buckets``, or the decode
        runner's default (one size under torch_compile, none otherwise). The default size is the decode-time
        compression bound, ``prompt_budget + decode_budget + decode_interval``, when ``decode_budget`` is set (every
        request then needs at most that), else ``prompt_budget + capacity_headroom``."""
        if self.capacity_buckets is not None:
            return self.capacity_buckets
        if self.decode_runner != "torch_compile":
            return ()
        if self.decode_budget is not None:
            return (self.prompt_budget + self.decode_budget + self.decode_interval,)
        return (self.prompt_budget + self.capacity_headroom,)

    def replace(self, **changes: Any) -> RocketKVConfig:
        """A validated copy with some fields changed, flat fields of either kind (each to its owner) or ``runtime``."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------------ dict / YAML
    def to_dict(self) -> dict[str, Any]:
        """Every field of both kinds, flat, in the order YAML files list them (model.config.rocketkv, JSON)."""
        # not dataclasses.asdict: it would turn a policy object in `stage1` into a dict of its fields; bucket
        # tuples as lists, which YAML (safe_dump) and JSON (model.config.rocketkv) hold
        data = {name: getattr(self, name) for name in _FLAT_FIELDS}
        for name in BUCKET_FIELDS:
            if data[name] is not None:
                data[name] = list(data[name])
        return data

    def algorithm_dict(self) -> dict[str, Any]:
        """The algorithm's fields only (``ALGORITHM_FIELDS``): what is kept and read, TensorRT-LLM's keys plus ours."""
        return {name: getattr(self, name) for name in self.ALGORITHM_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RocketKVConfig:
        """Build from a flat dict of fields (both kinds), or from ``{"sparse_attention_config": {...}}``; unknown
        keys raise."""
        if not isinstance(data, dict):
            raise ValueError(f"RocketKV config must be a mapping, got {type(data).__name__}")
        if YAML_SECTION in data:
            extra = sorted(set(data) - {YAML_SECTION})
            if extra:
                raise ValueError(f"unknown top-level key(s) {extra} beside '{YAML_SECTION}'")
            data = data[YAML_SECTION]
            if not isinstance(data, dict):
                raise ValueError(f"'{YAML_SECTION}' must be a mapping, got {type(data).__name__}")
        data = dict(data)
        algorithm = data.pop("algorithm", YAML_ALGORITHM)
        if algorithm != YAML_ALGORITHM:
            raise ValueError(f"{YAML_SECTION}.algorithm must be '{YAML_ALGORITHM}', got {algorithm!r}")
        known = set(_FLAT_FIELDS)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in {YAML_SECTION}{_suggestions(unknown, known)}; "
                             f"allowed: {sorted(known)}")
        return cls(**data)

    def to_yaml_dict(self) -> dict[str, Any]:
        if not isinstance(self.stage1, str):
            raise ValueError(f"RocketKVConfig.stage1 is a policy object ({type(self.stage1).__name__}); YAML holds "
                             f"policy names only, one of {list(STAGE1_POLICY_NAMES)}. Keep the object in Python, or "
                             f"use a name.")
        return {YAML_SECTION: {"algorithm": YAML_ALGORITHM, **self.to_dict()}}

    @classmethod
    def from_yaml(cls, path_or_text: str | Path) -> RocketKVConfig:
        """Read a YAML file (or YAML text) in TensorRT-LLM's ``sparse_attention_config`` shape."""
        import yaml

        text = Path(path_or_text).read_text() if _looks_like_path(path_or_text) else str(path_or_text)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"invalid YAML in RocketKV config: {err}") from err
        return cls.from_dict(data or {})

    def to_yaml(self, path: str | Path | None = None) -> str:
        import yaml

        text = yaml.safe_dump(self.to_yaml_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


def _suggestions(unknown: list[str], known: set[str]) -> str:
    """`` (did you mean 'prompt_budget'?)`` for keys that look like a typo of a known one."""
    import difflib

    close = [match[0] for key in unknown if (match := difflib.get_close_matches(key, known, n=1))]
    return f" (did you mean {', '.join(repr(k) for k in close)}?)" if close else ""


def _looks_like_path(value: str | Path) -> bool:
    """A Path, or a one-line string naming an existing file or ending in .yaml/.yml (then a missing file raises)."""
    if isinstance(value, Path):
        return True
    if "\n" in value:
        return False
    return Path(value).is_file() or Path(value).suffix in {".yaml", ".yml"}


def _check_budgets(config: RocketKVConfig) -> None:
    """Stage 1's and stage 2's budgets and kt_cache_dtype."""
    for name in ("window_size", "kernel_size", "prompt_budget", "topk", "topr", "page_size"):
        value = getattr(config, name)
        if not is_int(value):
            raise ValueError(f"RocketKVConfig.{name} must be an integer, got {value!r} ({type(value).__name__})")
    if config.window_size < 1:
        raise ValueError(f"RocketKVConfig.window_size must be >= 1, got {config.window_size}")
    if config.kernel_size < 1 or config.kernel_size % 2 == 0:
        raise ValueError(f"RocketKVConfig.kernel_size must be an odd integer >= 1 (max-pooling keeps the length), "
                         f"got {config.kernel_size}")
    if config.prompt_budget < config.window_size:
        raise ValueError(f"RocketKVConfig.prompt_budget must be >= window_size ({config.window_size}): the observation "
                         f"window is always kept; got prompt_budget={config.prompt_budget}")
    if config.topk < 1:
        raise ValueError(f"RocketKVConfig.topk (pages per KV head) must be >= 1, got {config.topk}")
    if config.topr < 1:
        raise ValueError(f"RocketKVConfig.topr (query channels) must be >= 1, got {config.topr}")
    if not _is_power_of_two(config.page_size):
        raise ValueError(f"RocketKVConfig.page_size must be a power of 2 (1, 2, 4, 8, ...), got {config.page_size}")
    if config.kt_cache_dtype not in KT_CACHE_DTYPES:
        raise ValueError(f"RocketKVConfig.kt_cache_dtype must be one of {sorted(KT_CACHE_DTYPES)}, "
                         f"got {config.kt_cache_dtype!r}")


def _check_policy_fields(config: RocketKVConfig) -> None:
    """stage1, sink_tokens, token_budget (a block of its own: the policy framework's fields)."""
    if isinstance(config.stage1, str):
        if config.stage1 not in STAGE1_POLICY_NAMES:
            raise ValueError(f"RocketKVConfig.stage1 must be one of {list(STAGE1_POLICY_NAMES)} or a policy object, "
                             f"got {config.stage1!r}")
    elif not is_stage1_policy(config.stage1):
        raise ValueError(f"RocketKVConfig.stage1 must be one of {list(STAGE1_POLICY_NAMES)} or a policy object with "
                         f"a `name` and a select(inputs) method (hf_rocketkv.policies), "
                         f"got {type(config.stage1).__name__}")
    if not is_int(config.sink_tokens) or config.sink_tokens < 0:
        raise ValueError(f"RocketKVConfig.sink_tokens must be an integer >= 0, got {config.sink_tokens!r}")
    if config.token_budget is not None and (not is_int(config.token_budget) or config.token_budget < 2):
        raise ValueError(f"RocketKVConfig.token_budget must be None (budgets as given) or an integer >= 2 (K+V pairs "
                         f"read per KV head per decode step, half for page scoring, half for exact attention), "
                         f"got {config.token_budget!r}")


def _check_stage2_fields(config: RocketKVConfig) -> None:
    """stage2, stage2_score, stage2_sink_tokens, stage2_recent_tokens (the stage-2 options' block; how the Triton
    backend runs it, stage2_kernel, is a runtime setting)."""
    if config.stage2 not in STAGE2_NAMES:
        raise ValueError(f"RocketKVConfig.stage2 must be one of {list(STAGE2_NAMES)}, got {config.stage2!r}")
    if config.stage2_score not in STAGE2_SCORES:
        raise ValueError(f"RocketKVConfig.stage2_score must be one of {list(STAGE2_SCORES)}, "
                         f"got {config.stage2_score!r}")
    for name in ("stage2_sink_tokens", "stage2_recent_tokens"):
        value = getattr(config, name)
        if not is_int(value) or value < 0:
            raise ValueError(f"RocketKVConfig.{name} must be an integer >= 0, got {value!r}")
    if config.stage2 != "kt_pages" or config.token_budget is not None:
        return  # no page selection, or topk and page_size are derived per request (then fit_forced_pages)
    sink, recent = forced_page_counts(config.stage2_sink_tokens, config.stage2_recent_tokens, config.page_size)
    if sink + recent > config.topk:
        raise ValueError(f"RocketKVConfig: the forced stage-2 pages must fit in topk={config.topk}: stage2_sink_tokens="
                         f"{config.stage2_sink_tokens} -> {sink} page(s) + stage2_recent_tokens="
                         f"{config.stage2_recent_tokens} -> {recent} page(s) (the newest page + ceil(r / page_size="
                         f"{config.page_size})) = {sink + recent}; lower them or raise topk")


def _check_layer_plan(config: RocketKVConfig) -> None:
    """dense_layers, budget_schedule (the per-layer layout's block; the layer count is checked against the model's
    when the cache learns it, cache/layer_plan.py)."""
    if not is_int(config.dense_layers) or config.dense_layers < 0:
        raise ValueError(f"RocketKVConfig.dense_layers must be an integer >= 0 (the first N layers keep and attend "
                         f"every token), got {config.dense_layers!r}")
    if config.budget_schedule not in BUDGET_SCHEDULES:
        raise ValueError(f"RocketKVConfig.budget_schedule must be one of {list(BUDGET_SCHEDULES)}, "
                         f"got {config.budget_schedule!r}")
    if config.budget_schedule != "flat" and config.token_budget is not None:
        raise ValueError(f"RocketKVConfig.budget_schedule={config.budget_schedule!r} spreads prompt_budget and topk over "
                         f"the layers, but token_budget={config.token_budget} derives them per request: use one of "
                         f"the two (budget_schedule='flat' with token_budget)")


def _check_multi_turn(config: RocketKVConfig) -> None:
    """multi_turn (a block of its own: keep_all multi-turn)."""
    if config.multi_turn not in MULTI_TURN_MODES:
        raise ValueError(f"RocketKVConfig.multi_turn must be one of {list(MULTI_TURN_MODES)} (\"evict\": later turns "
                         f"re-run stage 1 over the kept tokens; \"keep_all\": over the whole conversation), "
                         f"got {config.multi_turn!r}")


def _check_decode_compression(config: RocketKVConfig) -> None:
    """decode_budget, decode_interval, decode_window, decode_kernel_size (decode-time compression's block)."""
    for name in ("decode_budget", "decode_interval", "decode_window", "decode_kernel_size"):
        value = getattr(config, name)
        if name == "decode_budget" and value is None:
            continue
        if not is_int(value) or value < 1:
            what = "None (off) or an integer >= 1" if name == "decode_budget" else "an integer >= 1"
            raise ValueError(f"RocketKVConfig.{name} must be {what}, got {value!r}")
    if config.decode_budget is None:
        return
    if config.decode_window > config.decode_budget:
        raise ValueError(f"RocketKVConfig.decode_window ({config.decode_window}) must be <= decode_budget "
                         f"({config.decode_budget}): the newest decode_window generated tokens are always kept")
    if config.decode_kernel_size % 2 == 0:
        raise ValueError(f"RocketKVConfig.decode_kernel_size must be odd (same-length max-pooling), "
                         f"got {config.decode_kernel_size}")
    if config.multi_turn == "keep_all":
        raise ValueError(
            f"RocketKVConfig.decode_budget={config.decode_budget} bounds the generated tokens a layer stores, but "
            f"multi_turn='keep_all' keeps every token of the conversation: the two do not combine. Use "
            f"multi_turn='evict' with decode_budget, or decode_budget=None with keep_all.")


# the algorithm's checks, in order (the runtime settings' run when they are built: runtime_settings.py); a check that
# mixes both kinds goes last, reading the runtime fields flat
_ALGORITHM_CHECKS = (_check_budgets, _check_policy_fields, _check_stage2_fields, _check_multi_turn,
                     _check_decode_compression, _check_layer_plan)
