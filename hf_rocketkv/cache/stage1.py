"""Stage 1 of one layer: what it observes while the prompt is prefilled (the window of queries, padding offsets,
the policy's accumulation) and the run that picks the tokens each KV head keeps (``cache/compaction.py`` writes them).

State between prefill forwards (B batch, Hq query heads, D head_dim, w <= window_size):
    pending_queries  [B, Hq, w, D]  each row's last w real queries, right-aligned (post-RoPE)
    pending_valid    [B] int64      real queries in pending_queries per row (the rest are placeholders)
    row_start        [B] int64      padding offset of each row in the dense store (0 for a later turn)
    host_row_start, host_window_len  host mirrors of row_start and pending_valid when known without reading the
                     device (a prefill without padding, or padding read once per forward); None = unknown
    policy_state     the policy's accumulation (H2O), None for window-based policies
    observed_columns queries seen since the dense store began (an accumulating policy must have seen them all)
"""

from __future__ import annotations

import torch

from ..config import RocketKVConfig
from ..policies import KeptSlots, Stage1Inputs, derive_budgets, get_stage1_policy
from .compaction import compact, store_prompt
from .row_index import selected_rows

UNDECLARED_PER_HEAD_COUNTS = (
    "stage-1 policy {name!r} returned different kept counts for the KV heads of a row but does not declare "
    "`per_head_budgets = True`: the cache lays out per-KV-head lengths ([B, Hkv]) only for policies that declare it "
    "(it fixes the layout before any selection runs). Set the class attribute per_head_budgets = True."
)


def last_real_queries(queries: torch.Tensor, valid: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's last ``window`` real queries, right-aligned: ``([B, H, w, D], count [B])``, w = min(window, n).

    ``queries`` [B, H, n, D], ``valid`` bool [B, n]. Row b's real queries sit in the last ``count[b]`` entries in
    their original order; the entries before them are placeholders (``count`` tells stage 1 to ignore them).
    """
    n = queries.shape[2]
    w = min(window, n)
    order = torch.arange(n, device=valid.device)
    rank = torch.where(valid, order, torch.full_like(order, -1).expand_as(valid))  # padding ranks below every token
    index = rank.topk(w, dim=1).indices.flip(1)  # ascending: placeholders first, then the last real ones in order
    gathered = queries.gather(2, index[:, None, :, None].expand(-1, queries.shape[1], -1, queries.shape[3]))
    return gathered, valid.sum(dim=1).clamp(max=w)


def make_policy(config, window_scores_fn):
    """The stage-1 policy of ``config``. ``window_scores_fn`` is the backend's plain function (the Triton twin on
    CUDA), never a bound method of the layer: the policy must not point back at the layer, so a dropped cache frees
    its buffers at once instead of waiting for the garbage collector.

    Stage 2's sink pages are the first pages of the compacted store, so the policy keeps each row's first
    ``stage2_sink_tokens`` prompt tokens (``config.stage1_keep_first``); a later turn's stage 1 then keeps the store's
    first slots, which hold those same tokens."""
    return get_stage1_policy(
        config.stage1,
        kernel_size=config.kernel_size,
        sink_tokens=config.sink_tokens,
        window_scores_fn=window_scores_fn,
        keep_first=config.stage1_keep_first,
    )


class Stage1:
    """One layer's stage-1 state (module docstring) and its run. Methods take the layer they serve (this object
    holds no reference to it, so a dropped cache frees its buffers at once)."""

    ROW_TENSORS = ("pending_queries", "pending_valid", "row_start")

    def __init__(self) -> None:
        self.row_start: torch.Tensor | None = None
        self.pending_queries: torch.Tensor | None = None
        self.pending_valid: torch.Tensor | None = None
        self.host_row_start: list[int] | None = None
        self.host_window_len: list[int] | None = None
        self.policy_state = None
        self.observed_columns = 0

    # ------------------------------------------------------------------------------------------ observation
    def observe(self, layer, query_states: torch.Tensor, row_start: torch.Tensor | None, scaling: float,
                valid: torch.Tensor | None, host_row_start: list[int] | None) -> None:
        """``RocketKVLayer.observe_prefill``: keep each row's last ``window_size`` real queries of ``query_states``
        ``[B, Hq, n, D]`` and its padding offset; feed the policy's accumulation hook.

        ``valid`` bool ``[B, n]`` marks the real tokens among this forward's queries (None = all): padding never
        enters the window, so a row's window is the one it would have alone. Chunks of a chunked prefill add to the
        window of the earlier ones. The padding offset ``row_start`` ``[B]`` comes from the latest chunk: its mask
        covers every column so far, while an earlier chunk may lie entirely inside a row's left padding (such a
        chunk's offset is its own length, which is still right for that chunk: every query and key in it is
        padding). ``host_row_start``: ``row_start`` as Python ints when the caller has them (read once per forward),
        so that stage 1 needs no host sync in this layer.
        """
        window = layer.config.window_size
        batch, n = query_states.shape[0], query_states.shape[2]
        if valid is not None and layer.compressed and hasattr(layer.policy, "accumulate"):
            raise NotImplementedError(
                f"stage-1 policy {layer.policy.name!r} accumulates attention over every query, which is not "
                f"implemented for a batched later turn with padding between the turns: run those rows separately, or "
                f"use a window-based policy (snapkv, streaming, knorm, random)."
            )
        chunk_queries = query_states.detach()
        all_real = valid is None
        if layer.counters is not None and layer.counts_tokens:
            # prefill is eager: a sync is fine here (once per forward, and none without padding)
            layer.counters.computed(batch * n if all_real else int(valid.sum()))
        held_count = self.host_window_len if self.pending_queries is not None else [0] * batch
        if all_real:
            queries = chunk_queries[:, :, n - min(window, n):]  # every query is real: the last w, no ranking
            count = torch.full((batch,), queries.shape[2], dtype=torch.long, device=query_states.device)
        else:
            queries, count = last_real_queries(chunk_queries, valid, window)
        if self.pending_queries is not None and not (all_real and queries.shape[2] == window):
            # (a chunk of at least ``window`` real queries replaces the window outright: no merge, no launches)
            held = self.pending_queries.shape[2]
            device = query_states.device
            held_valid = torch.arange(held, device=device)[None, :] >= (held - self.pending_valid)[:, None]
            now_valid = torch.arange(queries.shape[2], device=device)[None, :] >= (queries.shape[2] - count)[:, None]
            queries, count = last_real_queries(
                torch.cat([self.pending_queries, queries], dim=2), torch.cat([held_valid, now_valid], dim=1), window
            )
        self.pending_queries, self.pending_valid = queries, count
        real_counts = [n] * batch if all_real else self._host_real_queries(layer, host_row_start, n)
        self.host_window_len = ([min(window, held + real) for held, real in zip(held_count, real_counts)]
                                if held_count is not None and real_counts is not None else None)
        if row_start is not None or self.row_start is None:
            self.row_start = (row_start if row_start is not None
                              else torch.zeros(batch, dtype=torch.long, device=layer.device))
            self.host_row_start = host_row_start if row_start is not None else [0] * batch
        self._accumulate(layer, chunk_queries, scaling)

    def _host_real_queries(self, layer, host_row_start: list[int] | None, n: int) -> list[int] | None:
        """Real (non-padding) queries per row among a first prefill's latest ``n``, from the host padding offsets:
        the queries are the dense store's last ``n`` columns, real from the row's offset on (None: unknown)."""
        if host_row_start is None or layer.compressed:
            return None
        first_query = layer.dense.keys.shape[2] - n
        return [n - min(n, max(0, start - first_query)) for start in host_row_start]

    def _accumulate(self, layer, queries: torch.Tensor, scaling: float) -> None:
        """Policies that score with every prefill query (H2O) accumulate here, once per forward."""
        if not layer.compressed:
            self.observed_columns += queries.shape[2]
        new_state = getattr(layer.policy, "new_state", None)
        if new_state is None:
            return
        if self.policy_state is None:
            self.policy_state = new_state(layer.dense.keys.shape[0], layer.dense.keys.shape[1], layer.device)
            if self.policy_state is None:
                return
        start, end = self.bounds(layer)
        layer.policy.accumulate(self.policy_state, queries, layer.dense.keys, start, end, scaling)

    def bounds(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's valid slots ``[start, end)``: after the padding while dense, ``[0, lengths)`` once compressed."""
        if layer.compressed:
            return torch.zeros_like(layer.lengths), layer.lengths
        return self.row_start, torch.full_like(self.row_start, layer.dense.keys.shape[2])

    # ------------------------------------------------------------------------------------------ the run
    def run(self, layer) -> None:
        """``RocketKVLayer.compress``: keep each row's best ``prompt_budget`` tokens per KV head (chosen by the
        layer's policy), write them into a fresh paged view with their KT, release the rest."""
        start, end = self.bounds(layer)
        columns = layer.positions if layer.compressed else None
        if not layer.compressed:
            self._check_accumulation_covers_prompt(layer)
            if layer.config.token_budget is not None:
                layer.use_request_config(token_budget_config(layer))
        inputs = Stage1Inputs(
            self.pending_queries,
            layer.dense.keys,
            start,
            end,
            budget=layer.config.prompt_budget,
            scaling=layer.scaling,
            window_len=self.pending_valid,
            state=self.policy_state,
            host_rows=self._host_stage1_rows(layer),
        )
        kept = self._checked_layout(layer, layer.policy.select(inputs))
        if not layer.compressed:
            store_prompt(layer, self.row_start, self.host_row_start)
        compact(layer, kept, columns, self.pending_queries)
        self.pending_queries = self.pending_valid = None
        self.row_start = None
        self.host_row_start = self.host_window_len = None
        self.policy_state = None  # a later turn accumulates afresh
        self.observed_columns = 0
        if layer.pages is not None:
            layer.pages.after_compaction(layer)

    def _host_stage1_rows(self, layer) -> tuple[tuple[int, int, int], ...] | None:
        """Stage 1's ``(start, end, w_b)`` per row from the host mirrors (a first prefill whose padding and window
        counts are known on the host); None when some are only on the device (the policy reads them back)."""
        if layer.compressed or self.host_row_start is None or self.host_window_len is None:
            return None
        end = layer.dense.keys.shape[2]
        return tuple((start, end, w) for start, w in zip(self.host_row_start, self.host_window_len))

    @staticmethod
    def _checked_layout(layer, kept: list[KeptSlots]) -> list[KeptSlots]:
        """The policy's selection, refused when a policy that does not declare ``per_head_budgets`` gave a row's
        heads different counts (the layout, one length per row, was fixed by that declaration)."""
        if not layer.per_head_lengths and not all(row.uniform for row in kept):
            raise ValueError(UNDECLARED_PER_HEAD_COUNTS.format(name=layer.policy.name))
        return kept

    def _check_accumulation_covers_prompt(self, layer) -> None:
        """An accumulating policy (H2O) scores with every prompt query: refuse a store that was partly written
        without passing through the attention (e.g. a prefix stored with ``Cache.update``), instead of scoring
        with part of the prompt."""
        if self.policy_state is not None and self.observed_columns != layer.dense.keys.shape[2]:
            raise ValueError(
                f"stage-1 policy {layer.policy.name!r} accumulates attention over every prompt query, but only "
                f"{self.observed_columns} of the {layer.dense.keys.shape[2]} stored columns passed through the rocketkv "
                f"attention (the rest were written to the cache directly). Prefill the whole prompt through the model."
            )

    # ------------------------------------------------------------------------------------------ rows, memory
    def select_rows(self, index: torch.Tensor, in_place: bool) -> None:
        """Rows ``index`` of the per-row state (beam reorder, batch select); the host mirrors become unknown."""
        self.host_row_start = self.host_window_len = None  # rows reordered: the host mirrors are stale
        tensors = selected_rows([getattr(self, name) for name in self.ROW_TENSORS], index, in_place)
        for name, tensor in zip(self.ROW_TENSORS, tensors):
            setattr(self, name, tensor)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The device tensors this state holds (``RocketKVLayer.memory_bytes``)."""
        return self.pending_queries, self.row_start


def token_budget_config(layer) -> RocketKVConfig:
    """token_budget mode: ``layer``'s config with its request's prompt_budget, topk, page_size and topr derived,
    once, before its first stage 1 (later turns keep them: the KT pages are laid out with this page size).

    The prompt length is the dense store's width, i.e. the longest row of the padded batch: every layer and every
    row group of a row-group prefill sees the same width, so they all derive the same page size. prompt_budget
    is raised to window_size when the formula gives less (the observation window is always kept).
    """
    prompt_len = layer.dense.keys.shape[2]
    hints, config = layer.hints, layer.config
    max_new = max(hints.max_length - prompt_len, 0) if hints.max_length is not None else 0
    derived = derive_budgets(prompt_len, max_new, config.token_budget, layer.dense.keys.shape[3])
    return config.replace(
        prompt_budget=max(derived.prompt_budget, config.window_size),
        topk=derived.topk,
        page_size=derived.page_size,
        topr=derived.topr,
    )
