"""The YAML file the CLI reads: TensorRT-LLM's ``sparse_attention_config`` plus an optional ``eval`` section.

    sparse_attention_config:      # parsed by RocketKVConfig.from_dict (unknown keys raise there)
      algorithm: rocket
      prompt_budget: 256
      topk: 16
      page_size: 4
    eval:                         # hf_rocketkv's own, every key optional; command-line flags override them
      tasks: [passkey]
      methods: [full, rocketkv, stage1, stage2, streaming]
      lengths: [1024, 2048, 3072]
      depths: [0.1, 0.5, 0.9]
      samples: 1
      seed: 0

Every key is checked: a misspelt one raises ``ValueError`` naming it and listing the allowed ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config import YAML_SECTION, RocketKVConfig

EVAL_SECTION = "eval"
TOP_LEVEL_KEYS = (YAML_SECTION, EVAL_SECTION)

DEFAULT_METHODS = ("full", "rocketkv", "stage1", "stage2", "streaming", "stage1_read", "streaming_read")


@dataclass
class EvalSettings:
    """What ``hf-rocketkv eval`` runs. Lengths are prompt tokens (chat template and question included).

    tasks:              task specs: a registered name (``passkey``) or ``name:path`` for file loaders
                        (``longbench:data/qasper.jsonl``, ``ruler:data/niah_single_1.jsonl``)
    methods:            methods compared on the same samples (see hf_rocketkv.eval.methods)
    lengths, depths:    grid of the synthetic tasks (depth = relative position of the needle, 0 = start)
    samples:            samples per grid cell (per file for loaders: the first ``samples`` rows, 0 = all)
    seed:               every generated sample is a pure function of (seed, task, length, depth, index)
    max_new_tokens:     overrides each task's own answer length
    chat:               wrap prompts in the tokenizer's chat template (``add_generation_prompt=True``)
    fidelity_context:   context tokens of the fidelity task
    fidelity_positions: teacher-forced decode positions scored after that context
    sink_tokens:        tokens the streaming baseline always keeps at the start
    """

    tasks: list[str] = field(default_factory=lambda: ["passkey"])
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 3072])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    samples: int = 1
    seed: int = 0
    max_new_tokens: int | None = None
    chat: bool = True
    fidelity_context: int = 2048
    fidelity_positions: int = 256
    sink_tokens: int = 4

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, what: str) -> ValueError:
            return ValueError(f"eval.{name} must be {what}, got {getattr(self, name)!r}")

        for name in ("tasks", "methods"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])
            value = getattr(self, name)
            if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
                raise bad(name, "a non-empty list of names")
        if (
            not isinstance(self.lengths, list)
            or not self.lengths
            or not all(_is_int(v) and v > 0 for v in self.lengths)
        ):
            raise bad("lengths", "a non-empty list of positive integers (prompt tokens)")
        if (
            not isinstance(self.depths, list)
            or not self.depths
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0 for v in self.depths)
        ):
            raise bad("depths", "a non-empty list of numbers in [0, 1]")
        self.depths = [float(v) for v in self.depths]
        for name, low in (
            ("samples", 0),
            ("seed", 0),
            ("fidelity_context", 1),
            ("fidelity_positions", 1),
            ("sink_tokens", 0),
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise bad(name, f"an integer >= {low}")
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise bad("max_new_tokens", "a positive integer or null")
        if not isinstance(self.chat, bool):
            raise bad("chat", "true or false")

    def replace(self, **changes: Any) -> "EvalSettings":
        """A validated copy; ``None`` values are ignored (unset command-line flags)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "EvalSettings":
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"'{EVAL_SECTION}' must be a mapping, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in '{EVAL_SECTION}'; allowed: {known}")
        return cls(**data)


@dataclass
class RunConfig:
    """Everything one YAML file holds."""

    rocket: RocketKVConfig = field(default_factory=RocketKVConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)


def load_run_config(path: str | Path | None) -> RunConfig:
    """Parse a CLI YAML file (None = every default). Errors name the offending key and the file."""
    if path is None:
        return RunConfig()
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: invalid YAML{_yaml_error_summary(err)}") from err
    return run_config_from_dict(data or {}, source=str(path))


def _yaml_error_summary(err) -> str:
    """``" at line 2, column 1: expected ',' or ']'"``: PyYAML's multi-line message reduced to one line."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{where}: {problem}; check the indentation, colons and brackets there"


def run_config_from_dict(data: dict[str, Any], source: str = "config") -> RunConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the YAML document must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(f"{source}: unknown top-level key(s) {unknown}; allowed: {list(TOP_LEVEL_KEYS)}")
    try:
        rocket = (
            RocketKVConfig.from_dict({YAML_SECTION: data[YAML_SECTION]}) if YAML_SECTION in data else RocketKVConfig()
        )
        settings = EvalSettings.from_dict(data.get(EVAL_SECTION))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from err
    return RunConfig(rocket=rocket, eval=settings)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
