"""Decode-time compression (seed 002's periodic compression): bound the generated tokens a layer stores.

Stage 1 bounds the prompt; without this a long answer still grows the cache by one token per step. Every
``interval`` generated tokens beyond ``budget``, each layer re-scores its GENERATED tokens and keeps ``budget`` of
them per KV head: the newest ``window`` (whose queries did the scoring) plus the best-scoring others. Prompt tokens
are never re-scored: stage 1 already chose them, and stage 2's sink pages are the first pages of the store.

Scoring (SnapKV's rule, applied to the generated region): the queries of the last ``window`` decode steps (post-RoPE,
held by the layer in a ring buffer) attend every stored token with an fp32 softmax (causal inside the window: query
i is the token in slot ``L - window + i``); the probabilities are summed over the window and the G query heads of
each KV head, max-pooled with ``kernel_size`` over the row's selectable generated slots ``[g0, L - window)`` (no
pooling across its edges), and the top ``budget - window`` of them are kept with the window.

Shapes (B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, C slot capacity, D head_dim, w window, M budget):
    queries:    [B, Hq, w, D]  the last w decode queries, oldest first
    keys:       [B, Hkv, C, D] the layer's store (kept prompt, then generated tokens)
    lengths:    [B] or [B, Hkv] tokens stored per row (L), or per row and KV head (AdaKV's per-head budgets)
    gen_start:  like lengths   first generated slot (g0: the prompt tokens kept by stage 1)
    -> slots:   [B, Hkv, M]    the generated slots to keep, ascending; the layer moves them to g0 .. g0 + M - 1
    -> lengths: like lengths   g0 + M where compressed, L where at most M tokens were generated
Every KV head of a row stores one token per decode step, so the generated count ``L - g0`` is the same for every
head even when the prompt counts differ; a [B] length is the same as its [B, Hkv] expansion.

Every shape is fixed by (B, C, M, w): no host sync and no data-dependent shape, so the selection and the move can be
compiled or captured once. What is eager is the decision WHEN to run (a host counter, ``DecodeCompression.due``);
docs/policies.md ("Decode-time compression") says where the cache layer calls what.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..selection.stage2_pages import per_head


@dataclass(frozen=True)
class DecodeCompression:
    """Settings of decode-time compression, validated.

    budget:      generated tokens kept per KV head after a compression (M)
    interval:    compress when ``budget + interval`` generated tokens are stored (so at most that many ever are:
                 the layer's decode capacity is fixed at prompt kept + budget + interval)
    window:      decode queries that score, and newest generated tokens always kept (<= budget)
    kernel_size: odd width of the max-pooling over the generated slots' scores (1: none)
    """

    budget: int
    interval: int = 64
    window: int = 32
    kernel_size: int = 7

    def __post_init__(self) -> None:
        for name, low in (("budget", 1), ("interval", 1), ("window", 1), ("kernel_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"DecodeCompression.{name} must be an integer >= {low}, got {value!r}")
        if self.window > self.budget:
            raise ValueError(
                f"DecodeCompression.window ({self.window}) must be <= budget ({self.budget}): the newest window "
                f"tokens are always kept"
            )
        if self.kernel_size % 2 == 0:
            raise ValueError(f"DecodeCompression.kernel_size must be odd (same-length pooling), got {self.kernel_size}")

    @property
    def max_generated(self) -> int:
        """Generated tokens a layer stores at most: the decode capacity to reserve beyond the kept prompt."""
        return self.budget + self.interval

    def due(self, generated: int) -> bool:
        """Host-side: compress now, with ``generated`` tokens stored since stage 1 (the same in every row)."""
        return generated >= self.max_generated

    def select(self, queries, keys, lengths, gen_start, scaling: float):
        """``decode_keep_slots`` with these settings."""
        return decode_keep_slots(queries, keys, lengths, gen_start, self.budget, scaling, self.kernel_size)


def decode_scores(queries: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor, scaling: float) -> torch.Tensor:
    """fp32 ``[B, Hkv, C]``: attention of the w window queries over every stored slot, summed over the window and
    the query group. Query i sits at slot ``lengths - w + i`` and sees slots ``<= lengths - w + i``."""
    batch, num_q_heads, w, dim = queries.shape
    num_kv_heads, capacity = keys.shape[1], keys.shape[2]
    q = queries.float().reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, w, dim)
    logits = torch.einsum("bhgwd,bhcd->bhgwc", q, keys.float()) * scaling
    slot = torch.arange(capacity, device=keys.device)
    stored = per_head(lengths, batch, num_kv_heads)  # [B, Hkv]
    own = stored[..., None] - w + torch.arange(w, device=keys.device)  # [B, Hkv, w] slot of each query
    visible = slot <= own[..., None]  # [B, Hkv, w, C] (own < lengths, so also inside the store)
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))


def decode_keep_slots(
    queries: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    gen_start: torch.Tensor,
    budget: int,
    scaling: float,
    kernel_size: int = 7,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated slots each KV head keeps (shapes in the module docstring).

    A row with more than ``budget`` generated tokens keeps its newest ``w`` and the ``budget - w`` best pooled scores
    among ``[g0, L - w)``; a row with at most ``budget`` keeps all of them (its slots are ``g0 + arange(budget)``,
    clamped to the capacity; those past ``L`` are never read since its length stays L).
    """
    batch, num_kv_heads, capacity, _ = keys.shape
    w = queries.shape[2]
    device = keys.device
    slot = torch.arange(capacity, device=device)
    stored, first = per_head(lengths, batch, num_kv_heads), per_head(gen_start, batch, num_kv_heads, "gen_start")
    selectable = (slot >= first[..., None]) & (slot < (stored - w)[..., None])  # [B, Hkv, C]
    scores = decode_scores(queries, keys, lengths, scaling)
    scores = scores.masked_fill(~selectable, float("-inf"))
    if kernel_size > 1:  # -inf outside the selectable slots: pooling never carries a score across their edges
        pooled = F.max_pool1d(scores.reshape(batch * num_kv_heads, 1, capacity), kernel_size, 1, kernel_size // 2)
        scores = pooled.reshape(batch, num_kv_heads, capacity).masked_fill(~selectable, float("-inf"))
    # a stable sort, not topk: max-pooling makes ties, and topk breaks them differently for other capacities (so a
    # capacity bucket would change the kept tokens); the stable order keeps the lowest slot of a tie
    chosen = (scores.sort(dim=-1, descending=True, stable=True).indices[..., : budget - w] if budget > w
              else slot.new_empty(batch, num_kv_heads, 0))
    window = (stored - w)[..., None] + torch.arange(w, device=device)  # [B, Hkv, w]
    compressed = torch.cat([chosen, window], dim=-1).sort(dim=-1).values
    over = (lengths - gen_start) > budget  # [B] or [B, Hkv]
    over_h = per_head(over, batch, num_kv_heads, "over")
    unchanged = (first[..., None] + torch.arange(budget, device=device)).clamp(max=capacity - 1)  # [B, Hkv, M]
    slots = torch.where(over_h[..., None], compressed, unchanged)
    return slots, torch.where(over, gen_start + budget, lengths)


def move_kept(store: torch.Tensor, slots: torch.Tensor, gen_start: torch.Tensor) -> None:
    """In place: ``store[b, h, g0 + j] = store[b, h, slots[b, h, j]]`` for j < M (K, V ``[B, Hkv, C, D]`` or
    positions ``[B, Hkv, C]``). Slots are ascending and >= their destination, and the gather is read before the
    write, so the move is safe in place. Fixed shapes (compile-friendly)."""
    budget = slots.shape[2]
    extra = store.shape[3:]
    first = per_head(gen_start, slots.shape[0], slots.shape[1], "gen_start")  # [B, Hkv]
    dest = first[..., None] + torch.arange(budget, device=store.device)  # [B, Hkv, M]
    dest = dest.clamp(max=store.shape[2] - 1)
    index = slots.reshape(*slots.shape, *([1] * len(extra))).expand(*slots.shape, *extra)
    moved = store.gather(2, index)
    store.scatter_(2, dest.reshape(*dest.shape, *([1] * len(extra))).expand(*dest.shape, *extra), moved)
