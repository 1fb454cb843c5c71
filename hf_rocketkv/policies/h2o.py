"""H2O-style heavy hitters: attention accumulated over EVERY prompt query, not just the observation window.

Score of slot j for KV head h: the sum, over all prompt queries i that see j (causal, padding excluded) and over the
G query heads of h, of the fp32 softmax probability ``softmax_i(q_i . k / sqrt(D))[j]``. No pooling (H2O keeps
individual heavy-hitter tokens); the observation window is kept as for every policy.

The scores need every prompt query, which exists only during prefill, so the policy keeps a running sum in a state
object: the cache layer calls ``new_state`` once, ``accumulate`` once per prefill forward (chunk) with that chunk's
queries and every key stored so far, and hands the state back for ``select``. Chunked accumulation equals one-shot
accumulation. Queries are processed in blocks of ``block_size``, so the extra memory is O(block_size x N): a few fp32
``[B, Hq, block_size, N]`` buffers (logits, mask, probabilities) and an fp32 copy of the keys; compute is
O(B Hq L N D) over a prompt of L queries, about the cost of a second prefill attention.

After a later turn the state covers that turn's queries only (the layer starts a fresh state for each stage 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import KeptSlots, Stage1Inputs, select_by_scores


@dataclass
class H2OState:
    """Running column sums of one layer.

    scores:       fp32 ``[B, Hkv, N]`` accumulated attention of every query seen so far (grows with N)
    queries_seen: queries accumulated (per row, padding included)
    """

    scores: torch.Tensor
    queries_seen: int = 0

    def add(self, attention: torch.Tensor, queries: int) -> None:
        """Add one forward's accumulated attention ``[B, Hkv, N]`` of ``queries`` queries; the sums widen to ``N``
        slots first (zeros for the new ones)."""
        grow = attention.shape[2] - self.scores.shape[2]
        if grow:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(*self.scores.shape[:2], grow)], dim=2)
        self.scores += attention
        self.queries_seen += queries


def accumulated_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    scaling: float,
    block_size: int,
) -> torch.Tensor:
    """Attention of ``n`` queries over the keys, summed over the queries and the GQA group: fp32 ``[B, Hkv, N]``.

    queries [B, Hq, n, D] sit in slots ``end[b] - n .. end[b] - 1``; keys [B, Hkv, N, D]. Query i sees the valid keys
    ``start[b] <= j <= its slot``; a query inside the left padding (slot < start[b]) contributes nothing.
    """
    batch, num_q_heads, n, head_dim = queries.shape
    num_kv_heads, num_slots = keys.shape[1], keys.shape[2]
    group = num_q_heads // num_kv_heads
    keys32 = keys.float()
    slot = torch.arange(num_slots, device=keys.device)
    out = torch.zeros(batch, num_kv_heads, num_slots, dtype=torch.float32, device=keys.device)
    for first in range(0, n, block_size):
        block = min(block_size, n - first)
        q = queries[:, :, first : first + block].reshape(batch, num_kv_heads, group, block, head_dim).float()
        logits = torch.einsum("bhgqd,bhnd->bhgqn", q, keys32) * scaling
        query_slot = end[:, None] - n + first + torch.arange(block, device=keys.device)[None, :]  # [B, block]
        visible = (slot[None, None, :] <= query_slot[:, :, None]) & (slot[None, None, :] >= start[:, None, None])
        logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
        # a padding query sees no valid key: its softmax row is NaN, zeroed here
        out += torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))
    return out


@dataclass(frozen=True)
class H2OPolicy:
    """Keep the slots with the largest attention accumulated over all prompt queries (H2O-style).

    Parameters
    ----------
    block_size : int
        Queries per block in ``accumulate`` (memory: a few fp32 ``[B, Hq, block_size, N]`` buffers).
    """

    block_size: int = 128
    name: ClassVar[str] = "h2o"

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"H2OPolicy.block_size must be an integer >= 1, got {self.block_size!r}")

    def new_state(self, batch: int, num_kv_heads: int, device: torch.device) -> H2OState:
        return H2OState(torch.zeros(batch, num_kv_heads, 0, dtype=torch.float32, device=device))

    def accumulate(
        self,
        state: H2OState,
        queries: torch.Tensor,
        keys: torch.Tensor,
        start: torch.Tensor,
        end: torch.Tensor,
        scaling: float,
    ) -> None:
        """Add the attention of one prefill forward's queries ``[B, Hq, n, D]`` (in slots ``end - n .. end - 1``)
        over the keys stored so far ``[B, Hkv, N, D]``."""
        num_slots = keys.shape[2]
        if state.scores.shape[2] > num_slots:
            raise ValueError(
                f"H2OPolicy.accumulate: the state already covers {state.scores.shape[2]} slots but keys has only "
                f"{num_slots}; the store must only grow between calls"
            )
        state.add(accumulated_attention(queries, keys, start, end, scaling, self.block_size), queries.shape[2])

    def score(self, inputs: Stage1Inputs) -> torch.Tensor:
        """The accumulated column sums, fp32 ``[B, Hkv, N]``."""
        state = inputs.state
        if not isinstance(state, H2OState):
            raise ValueError(
                "H2OPolicy needs its accumulation state in Stage1Inputs.state (new_state(), then accumulate() once per "
                f"prefill chunk), got {type(state).__name__}"
            )
        if state.scores.shape[:3] != inputs.keys.shape[:3]:
            raise ValueError(
                f"H2OPolicy: the accumulated scores cover {tuple(state.scores.shape)} (B, Hkv, N) but keys is "
                f"{tuple(inputs.keys.shape[:3])}; accumulate() must see the same store that select() scores"
            )
        return state.scores

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        return select_by_scores(inputs, self.score, "H2OPolicy.score")
