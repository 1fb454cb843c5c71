"""SamplingParams: what one request asks of the decoder (length, randomness, when to stop).

Frozen and validated at construction: a bad value raises ``InvalidRequest`` (a ``ValueError``) naming the field, the
value and what is allowed, so the library and the HTTP server (400) report the same message.

Semantics follow the OpenAI API where it has the field:
    max_tokens      new tokens at most (>= 1)
    temperature     0 = greedy (argmax); otherwise logits are divided by it before sampling; [0, 2]
    top_p           nucleus: sample among the smallest set of tokens whose probability reaches top_p; (0, 1]
    top_k           sample among the k most likely tokens; 0 = no limit
    stop            strings that end the output; the text stops before the first one (not included)
    stop_token_ids  token ids that end the output (the model's EOS ids are added unless ignore_eos)
    seed            seeds this request's own torch.Generator: same seed, same tokens; None = nondeterministic
    ignore_eos      do not stop at the model's EOS ids (benchmarks want fixed output lengths)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import InvalidRequest

MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (see the module docstring). ``SamplingParams.greedy(n)`` for argmax."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # lists are accepted for convenience and stored as tuples (the object stays hashable and immutable)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kwargs: Any) -> "SamplingParams":
        """Argmax decoding (temperature 0)."""
        return cls(max_tokens=max_tokens, temperature=0.0, **kwargs)

    @property
    def is_greedy(self) -> bool:
        """Argmax: temperature 0 or top_k 1 (sampling then has a single candidate)."""
        return self.temperature == 0 or self.top_k == 1

    def replace(self, **changes: Any) -> "SamplingParams":
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ------------------------------------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``InvalidRequest`` naming the field, the value and what is allowed."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}", "temperature"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0: no limit), got {self.top_k!r}", "top_k")
        self._validate_stop()
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequest(
                f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}", "stop_token_ids"
            )
        if self.seed is not None and (not _is_int(self.seed) or not -MAX_SEED - 1 <= self.seed <= MAX_SEED):
            raise InvalidRequest(f"seed must be null or a 64-bit integer, got {self.seed!r}", "seed")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be true or false, got {self.ignore_eos!r}", "ignore_eos")

    def _validate_stop(self) -> None:
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequest(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", "stop")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop strings must not be empty", "stop")
