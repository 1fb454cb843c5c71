"""The stage-1 policy interface: scores per KV head over the prompt -> kept slots.

A stage-1 policy decides, once per layer at the end of prefill (and again after each later turn), which stored tokens
every KV head keeps for good. Policies are pure objects over tensors: they know nothing of transformers or of the
cache classes. The cache layer owns storage and bookkeeping; it hands a policy a ``Stage1Inputs`` and gets back one
``KeptSlots`` per batch row.

Shapes (B batch, Hq query heads, Hkv KV heads, G = Hq // Hkv, N stored slots, D head_dim, w window queries):
    q_window:   [B, Hq, w, D]   post-RoPE queries of the last w tokens of the latest forward
    keys:       [B, Hkv, N, D]  post-RoPE keys in slot order
    start, end: [B]             row b's valid slots are [start[b], end[b]); left padding sits before start[b]
    window_len: [B] or None     real queries among the w: the last window_len[b] (the earlier ones are padding)
    keep_first: int             the first keep_first valid slots of every row are always kept (stage 2's sinks)

Window query i (0 <= i < w) is the token in slot ``end[b] - w + i``. A row's observation window is its last
``w_b = window_len[b]`` tokens (``w`` when window_len is None); it is always kept, so ``budget >= w``.

Two kinds of policies implement the interface:
- scorers (snapkv, knorm, h2o, streaming, random, ScorerPolicy): ``score(inputs) -> [B, Hkv, N]`` and
  ``select = select_by_scores(inputs, self.score)``: every KV head keeps its window plus its
  ``budget - w_b`` best-scoring prefix slots, so every head keeps the same count;
- allocators (adakv): wrap a scorer and give KV heads different counts (``per_head_budgets = True``).

A policy that needs state across prefill chunks (H2O's running column sums) has ``new_state(batch, num_kv_heads,
device)`` and ``accumulate(state, queries, keys, start, end, scaling)``; the cache layer creates the state, calls
``accumulate`` once per prefill forward, and hands the state back in ``Stage1Inputs.state``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Stage1Inputs:
    """What the cache layer hands a stage-1 policy for one layer (shapes in the module docstring).

    budget:  tokens each KV head keeps per row (rows with at most ``budget`` valid tokens are kept whole).
    scaling: softmax scale of the attention (``head_dim ** -0.5`` for most models).
    state:   the object the policy's ``new_state`` returned, after every ``accumulate`` (None for stateless ones).
    keep_first: a row over the budget always keeps its first ``min(keep_first, budget - w_b)`` valid slots
             (``start .. start + keep_first - 1``), counted in the budget. Stage 2's sink pages
             (``RocketKVConfig.stage2_sink_tokens``) are the first pages of the compacted store, so stage 1 must keep
             the prompt's first tokens for them to be the real sinks. 0: no forced slots (the policy's own choice).
    """

    q_window: torch.Tensor
    keys: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    budget: int
    scaling: float
    window_len: torch.Tensor | None = None
    state: Any = None
    keep_first: int = 0
    # ``(start, end, w_b)`` per row as Python ints when the caller knows them on the host (the cache layer does for
    # a prefill): policies then never read ``start`` / ``end`` / ``window_len`` back from the device (a sync per layer)
    host_rows: tuple[tuple[int, int, int], ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_inputs(self)

    @property
    def window(self) -> int:
        """w: window queries given (the most any row's observation window can be)."""
        return self.q_window.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    def rows(self) -> list[tuple[int, int, int]]:
        """``(start, end, w_b)`` of every row as Python ints."""
        return self._rows

    @functools.cached_property
    def _rows(self) -> list[tuple[int, int, int]]:
        if self.host_rows is not None:
            return [tuple(row) for row in self.host_rows]
        # read once (one host sync per tensor) however many times policies ask
        starts, ends = self.start.tolist(), self.end.tolist()
        windows = self.window_len.tolist() if self.window_len is not None else [self.window] * len(starts)
        return list(zip(starts, ends, windows))

    def forced_count(self, start: int, end: int, window: int) -> int:
        """Slots a row over the budget keeps at its start because of ``keep_first`` (at most its selectable
        ``budget - w_b``)."""
        return min(self.keep_first, self.budget - window, max(end - window - start, 0))

    def needs_selection(self) -> bool:
        """True when some row holds more than ``budget`` valid tokens (otherwise nothing is scored)."""
        return any(e - s > self.budget for s, e, _ in self.rows())


def _check_inputs(inputs: Stage1Inputs) -> None:
    """Raise ``ValueError`` naming the field, the value and what is allowed."""
    q, keys = inputs.q_window, inputs.keys
    if q.dim() != 4 or keys.dim() != 4:
        raise ValueError(
            f"Stage1Inputs: q_window must be [B, Hq, w, D] and keys [B, Hkv, N, D], got q_window "
            f"{tuple(q.shape)} and keys {tuple(keys.shape)}"
        )
    batch, num_q_heads, _, head_dim = q.shape
    if keys.shape[0] != batch or keys.shape[3] != head_dim:
        raise ValueError(
            f"Stage1Inputs: keys {tuple(keys.shape)} must share batch and head_dim with q_window {tuple(q.shape)}"
        )
    if num_q_heads % keys.shape[1] != 0:
        raise ValueError(
            f"Stage1Inputs: query heads ({num_q_heads}) must be a multiple of KV heads ({keys.shape[1]})"
        )
    if inputs.host_rows is not None and len(inputs.host_rows) != batch:
        raise ValueError(f"Stage1Inputs.host_rows must have one (start, end, w_b) per row ({batch}), got "
                         f"{len(inputs.host_rows)}")
    for name in ("start", "end") + (("window_len",) if inputs.window_len is not None else ()):
        value = getattr(inputs, name)
        if value.shape != (batch,):
            raise ValueError(f"Stage1Inputs.{name} must have shape [B] = ({batch},), got {tuple(value.shape)}")
    if not isinstance(inputs.budget, int) or isinstance(inputs.budget, bool) or inputs.budget < max(1, q.shape[2]):
        raise ValueError(
            f"Stage1Inputs.budget must be an integer >= max(1, window queries w={q.shape[2]}) (the observation "
            f"window is always kept), got {inputs.budget!r}"
        )
    for b, (s, e, _) in enumerate(inputs.rows()):
        if not 0 <= s <= e <= keys.shape[2]:
            raise ValueError(
                f"Stage1Inputs: row {b} has start={s}, end={e}; need 0 <= start <= end <= N={keys.shape[2]}"
            )
    if not isinstance(inputs.keep_first, int) or isinstance(inputs.keep_first, bool) or inputs.keep_first < 0:
        raise ValueError(f"Stage1Inputs.keep_first must be an integer >= 0, got {inputs.keep_first!r}")
    if inputs.window_len is not None:
        bad = [(b, n) for b, (_, _, n) in enumerate(inputs.rows()) if not 0 <= n <= q.shape[2]]
        if bad:
            raise ValueError(f"Stage1Inputs.window_len must lie in [0, w={q.shape[2]}], got (row, value) {bad}")


@dataclass(frozen=True)
class KeptSlots:
    """Stage-1 result for one batch row.

    slots:  LongTensor ``[Hkv, n_max]``: head h's kept slots in ascending order in ``slots[h, :counts[h]]``,
            then -1 (only when heads keep different counts).
    counts: LongTensor ``[Hkv]``: slots kept per KV head.
    """

    slots: torch.Tensor
    counts: torch.Tensor
    # True when known on the host that every head keeps ``slots.shape[1]`` (``same_for_every_head``); None: read
    # ``counts`` back from the device to tell
    known_uniform: bool | None = field(default=None, repr=False, compare=False)

    @classmethod
    def same_for_every_head(cls, slots: torch.Tensor) -> "KeptSlots":
        """From ``[Hkv, n]`` ascending slots (every head keeps n)."""
        counts = torch.full((slots.shape[0],), slots.shape[1], dtype=torch.long, device=slots.device)
        return cls(slots, counts, known_uniform=True)

    @property
    def uniform(self) -> bool:
        """Every KV head keeps the same count (what the cache layer can store today)."""
        if self.known_uniform is not None:
            return self.known_uniform
        return bool((self.counts == self.slots.shape[1]).all())


@runtime_checkable
class Stage1Policy(Protocol):
    """Anything with a ``name`` and ``select(inputs) -> list[KeptSlots]`` (one per batch row) is a stage-1 policy.

    Optional members the cache layer looks for:
        per_head_budgets: bool     True when heads may keep different counts (AdaKV)
        new_state(batch, num_kv_heads, device) -> state | None
        accumulate(state, queries, keys, start, end, scaling) -> None, once per prefill forward
    """

    name: str

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]: ...


ScoreFn = Callable[[Stage1Inputs], torch.Tensor]


def whole_row(start: int, end: int, num_kv_heads: int, device: torch.device) -> KeptSlots:
    """Every valid slot of a row that fits the budget, for every KV head."""
    return KeptSlots.same_for_every_head(torch.arange(start, end, device=device).expand(num_kv_heads, end - start))


def checked_scores(scores: torch.Tensor, inputs: Stage1Inputs, who: str) -> torch.Tensor:
    """``scores`` if it is a floating ``[B, Hkv, N]`` tensor, else a ValueError naming ``who`` produced it."""
    expected = (inputs.keys.shape[0], inputs.keys.shape[1], inputs.keys.shape[2])
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected or not scores.is_floating_point():
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"{who} must return floating scores of shape [B, Hkv, N] = {expected}, got {got}")
    return scores


def top_prefix_slots(prefix_scores: torch.Tensor, count: int, offset: int) -> torch.Tensor:
    """The ``count`` best slots of every head, ascending: ``[Hkv, count]`` from ``[Hkv, n_prefix]`` scores of slots
    ``offset, offset + 1, ...``."""
    chosen = prefix_scores.contiguous().topk(count, dim=-1).indices
    return chosen.sort(dim=-1).values + offset


def select_by_scores(inputs: Stage1Inputs, score_fn: ScoreFn, who: str = "score") -> list[KeptSlots]:
    """Uniform selection: every KV head keeps its observation window, the row's first ``f`` slots
    (``f = inputs.forced_count(...)``, from ``keep_first``) and its ``budget - w_b - f`` best other prefix slots.

    ``score_fn(inputs) -> [B, Hkv, N]`` (higher = keep) runs only when some row exceeds the budget; only the scores
    of each row's selectable prefix slots ``[start + f, end - w_b)`` are read.
    """
    rows = inputs.rows()
    heads, device, budget = inputs.num_kv_heads, inputs.keys.device, inputs.budget
    scores = checked_scores(score_fn(inputs), inputs, who) if inputs.needs_selection() else None
    kept = []
    for b, (s, e, w) in enumerate(rows):
        if e - s <= budget:
            kept.append(whole_row(s, e, heads, device))
            continue
        forced = inputs.forced_count(s, e, w)
        first = torch.arange(s, s + forced, device=device).expand(heads, forced)
        chosen = top_prefix_slots(scores[b, :, s + forced : e - w], budget - w - forced, s + forced)
        window = torch.arange(e - w, e, device=device).expand(heads, w)
        kept.append(KeptSlots.same_for_every_head(torch.cat([first, chosen, window], dim=-1)))
    return kept
