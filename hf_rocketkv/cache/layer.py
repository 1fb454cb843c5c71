"""RocketKVLayer: one decoder layer's KV store, in two states.

dense       from the first prompt token until stage 1 runs. Slot s holds column s of the input (left padding
            included), exactly like a DynamicLayer, so prefill attention (chunked or not) is plain causal
            attention with transformers' own mask.
compressed  after stage 1. Per row b and KV head h, slots [0, lengths[b]) hold the kept prompt tokens in
            ascending original position, then every generated token. Padding is never stored. Buffers have a
            fixed capacity (a multiple of page_size) with the KT page summaries beside them; decode writes one
            slot per row in place.

Tensors (B batch, Hkv KV heads, C capacity, P page_size, D head_dim):
    keys, values  [B, Hkv, C, D]     model dtype
    kt            [B, Hkv, C/P, 2, D] KT dtype (min, max of each page)
    positions     [B, Hkv, C]         int32 input column of each stored token (-1 = empty slot)
    lengths       [B]                 int64 tokens stored per row (every KV head holds the same count)

The layer knows nothing of transformers' attention registry; the attention function drives it. It finds the layer
through the key tensor ``update()`` returned (``layer_of``): the layer tags its key buffer with a weak reference to
itself, so each attention call reaches exactly the layer that stored its keys, with no process-global state (see
docs/seam.md).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..compat import CacheLayerMixin
from ..config import RocketKVConfig
from ..kernels.dispatch import RocketOps, get_ops
from ..policies import KeptSlots, Stage1Inputs, derive_budgets, get_stage1_policy


@dataclass
class GenerationHints:
    """What generate() tells the cache before prefill (set by hf_rocketkv's generate integration)."""

    max_length: int | None = None  # logical tokens the cache will have seen at most (prompt + new tokens)
    defer_compression: bool = False  # chunked prefill: run stage 1 at the first decode step, not after each chunk
    prefilling: bool = False  # generate()'s prefill is running (chunks must not be compiled: their shapes change)
    guards_checked: bool = False  # this generate() call's first compiled decode step has run with every guard
    # device types on which generate() may defer its stop check by a step (deferred_stop_check); CUDA only, as
    # the check needs device events (tests add "cpu" together with a CPU stand-in for torch.Event)
    deferred_stop_devices: tuple[str, ...] = ("cuda",)
    # a decode step is being captured or replayed as a CUDA graph (integration/decode_graphs.py): Python runs once at
    # capture and never at replay, so the step's runner does the host bookkeeping, not the traced code
    in_graph: bool = False
    # this request's captured decode step (integration/decode_graphs.py) and where graphs are used
    graphed_step: object = None
    graph_warmed_up: bool = False
    graph_devices: tuple[str, ...] = ("cuda",)
    graph_backend: object = None  # None: torch.cuda graphs (tests put a CPU stand-in here)

    def forget_graph(self) -> None:
        """Drop the captured decode step (its buffers change when a new turn is prefilled)."""
        self.graphed_step = None
        self.graph_warmed_up = False


INTERRUPTED_FORWARD = (
    "RocketKVCache: its layers have seen different numbers of tokens ({detail}): an earlier forward on this cache "
    "was interrupted (an exception), which leaves it inconsistent. Start again with a fresh RocketKVCache."
)

UNCONSUMED_KEYS = (
    "RocketKVCache: a layer stored keys that no 'rocketkv' attention call consumed. Either the model's attention is "
    "not 'rocketkv' (enable it with `hf_rocketkv.enable(model)` or `from_pretrained(..., attn_implementation="
    "'rocketkv')`), or an earlier forward on this cache was interrupted by an exception, which leaves it "
    "inconsistent: start again with a fresh RocketKVCache."
)

CROP_UNSUPPORTED = (
    "RocketKVCache cannot be cropped beyond its last decoded tokens: stage 1 evicts tokens for good, so "
    "assisted/speculative decoding (which rolls the cache back over verified candidates) is not supported. Use "
    "plain greedy, sampling or beam search."
)

PER_HEAD_COUNTS_UNSUPPORTED = (
    "gives each KV head its own number of kept tokens, but RocketKVLayer stores one length per row (lengths [B]) "
    "and the decode kernels read one length per row: per-KV-head lengths ([B, Hkv]) in the layer and the kernels "
    "are not implemented yet (padding short heads with attended slots would change the attention). The policy "
    "itself works on tensors: hf_rocketkv.policies.AdaKVPolicy().select(...). Use a uniform policy in the cache."
)


OWNER_ATTRIBUTE = "_hf_rocketkv_layer"  # on the key tensor update() returns: weakref.ref(its RocketKVLayer)


def layer_of(key: torch.Tensor) -> "RocketKVLayer | None":
    """The RocketKVLayer whose ``update()`` returned ``key``, or None (another cache, or no cache).

    A weak reference, so the layer and its buffers are freed as soon as the cache is (no reference cycle through
    the tensor). Traceable by torch.compile: reading it adds no graph break and a fresh cache per request adds no
    recompilation.
    """
    ref = getattr(key, OWNER_ATTRIBUTE, None)
    return ref() if ref is not None else None


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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_dim2(tensor: torch.Tensor, size: int, fill) -> torch.Tensor:
    """``tensor`` with dim 2 extended to ``size`` by ``fill`` (slots or KT pages that hold no token)."""
    missing = size - tensor.shape[2]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[2] = missing
    return torch.cat([tensor, tensor.new_full(shape, fill)], dim=2)


class RocketKVLayer(CacheLayerMixin):
    # Decode is static-shape (fixed capacity, state in tensors, no host sync), so generate() may compile it;
    # prefill and stage 1 always run eagerly (generate compiles decode steps only).
    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, config: RocketKVConfig, hints: GenerationHints):
        super().__init__()
        self.config = config
        self.hints = hints
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.kt: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.compressed = False
        self.seen: torch.Tensor | None = None  # 0-d int64 on the device: logical tokens seen (compile-safe)
        self.host_max_length = 0  # host mirror of lengths.max(), so decode never syncs with the GPU
        self.host_decoded = 0  # one-token decode steps appended since stage 1 last ran (what crop may remove)
        self.host_seen = 0  # host count of the tokens eager updates stored: tells an interrupted forward apart
        self.ops: RocketOps | None = None
        # set by update(), cleared by the attention function: still set at the next update means the attention that
        # should have consumed these keys never ran (not "rocketkv", or an interrupted forward)
        self.awaiting_attention = False
        # until stage 1 runs: the padding offset of each row, the latest window of queries and, per row, how many of
        # them are real tokens (a later turn's left padding sits inside its first forward)
        self.row_start: torch.Tensor | None = None
        self.pending_queries: torch.Tensor | None = None
        self.pending_valid: torch.Tensor | None = None  # [B] real queries in pending_queries (right-aligned)
        # a later turn's new tokens, stored by the attention function once it knows which are padding
        self.pending_keys: torch.Tensor | None = None
        self.pending_values: torch.Tensor | None = None
        # stage 1 is delegated to a policy (hf_rocketkv/policies); the layer stores its per-prefill state, if any
        self.policy = self._make_policy(None)  # rebuilt with the backend's window-scores twin once the device is known
        self.policy_state = None
        self.observed_columns = 0  # queries seen by observe_prefill since the dense store began

    # ------------------------------------------------------------------------------------------ lifecycle
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Sizes come from the first K/V seen, so tensor-parallel shards and device maps need nothing special."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.ops = get_ops(self.config.backend, self.device)
        self.policy = self._make_policy(self.ops.window_scores)
        self.keys = key_states.new_empty((key_states.shape[0], key_states.shape[1], 0, key_states.shape[3]))
        self.values = value_states.new_empty((value_states.shape[0], value_states.shape[1], 0, value_states.shape[3]))
        self.seen = torch.zeros((), dtype=torch.long, device=self.device)
        self.is_initialized = True

    def reset(self) -> None:
        self.__init__(self.config, self.hints)

    @property
    def batch_size(self) -> int:
        if not self.is_initialized:
            raise AttributeError("batch_size")  # Cache.batch_size skips layers without it
        return self.keys.shape[0]

    # ------------------------------------------------------------------------------------------ sizes
    def get_seq_length(self) -> int:
        """Logical tokens seen (positions of new tokens continue from here), not tokens stored.

        Under torch.compile this is the 0-d device counter itself (transformers only adds it to an arange), so a
        compiled forward without ``position_ids`` neither syncs with the host nor breaks the graph.
        """
        if not self.is_initialized:
            return 0
        if torch.compiler.is_compiling():
            return self.seen
        return int(self.seen)

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.compressed:
            # dense: the mask covers the stored columns plus the new ones, exactly like a DynamicLayer
            return (self.keys.shape[2] if self.is_initialized else 0) + query_length, 0
        if query_length == 1:
            # Decode: the attention function builds validity from `lengths` and ignores the mask, so its size only has
            # to stay constant (a growing mask would recompile a compiled decode step every step): one per capacity.
            return self.capacity + 1, 0
        # A later turn: the mask's last query_length columns say which new tokens are padding.
        return int(self.seen) + query_length, 0

    def kept_tokens(self) -> torch.Tensor:
        """Tokens physically stored, ``[B, Hkv]`` (padding excluded once compressed)."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        if not self.compressed:
            stored = self.keys.shape[2] - self.row_start if self.row_start is not None else self.keys.shape[2]
            stored = torch.as_tensor(stored, device=self.device).expand(self.keys.shape[0])
            return stored[:, None].expand(-1, self.keys.shape[1]).clone()
        return self.lengths[:, None].expand(-1, self.keys.shape[1]).clone()

    def memory_bytes(self) -> int:
        tensors = (self.keys, self.values, self.kt, self.positions, self.lengths, self.pending_queries, self.row_start)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2] if self.keys is not None else 0

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; returns the K/V a dense attention would use (the dense buffers while dense).

        The returned keys carry a weak reference to this layer (``layer_of``), which is how the ``rocketkv``
        attention function finds the layer of its own call. A later turn's tokens (several on a compressed layer)
        are only staged here: the attention function stores them once the mask has told it which are padding.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        query_length = key_states.shape[2]
        if self._host_bookkeeping():
            self.awaiting_attention = True  # cleared by the attention function; RocketKVCache.update checks it
            self.host_seen += query_length
        self.seen.add_(query_length)
        if not self.compressed:
            first = self.keys.shape[2] == 0
            self.keys = key_states if first else torch.cat([self.keys, key_states], dim=-2)
            self.values = value_states if first else torch.cat([self.values, value_states], dim=-2)
        elif query_length == 1:
            self._append_one(key_states, value_states)
        else:
            self.pending_keys, self.pending_values = key_states, value_states
        if not self.compressed:
            self._tag_keys()  # a new dense buffer every forward (eager: prefill never runs compiled)
        return self.keys, self.values

    def _tag_keys(self) -> None:
        """Let the attention function find this layer from the key buffer (``layer_of``). Called wherever the buffer
        is (re)allocated, always in eager code, so compiled decode steps find it tagged already."""
        if getattr(self.keys, OWNER_ATTRIBUTE, None) is None:
            setattr(self.keys, OWNER_ATTRIBUTE, weakref.ref(self))

    def attention_ran(self) -> None:
        """Called by the ``rocketkv`` attention function once it has found this layer."""
        self.awaiting_attention = False

    def _append_one(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Decode: write slot lengths[b] of every row in place and fold the key into its KT page.

        No host sync and no shape change, so a compiled decode step replays as one CUDA graph. Capacity comes from
        generate()'s max_length; in eager mode the store grows when a caller runs past it.
        """
        if self._host_bookkeeping():  # compiled/graphed steps: their runner counts on the host
            self._ensure_capacity(1)
            self.note_decode_step()
        self.ops.append_token(
            self.keys, self.values, self.positions, self.kt, self.lengths, self.seen,
            key_states[:, :, 0], value_states[:, :, 0], self.config.page_size,
        )

    def note_decode_step(self) -> None:
        self.host_max_length += 1
        self.host_decoded += 1

    def _host_bookkeeping(self) -> bool:
        """Whether this code runs eagerly, once per step (not traced by torch.compile, not a CUDA-graph step)."""
        return not (torch.compiler.is_compiling() or self.hints.in_graph)

    def store_new_tokens(self, valid: torch.Tensor | None) -> None:
        """Store the later turn's tokens staged by ``update``, skipping padding.

        ``valid`` bool ``[B, n]`` marks the real new tokens (None = all real). A batched later turn carries padding
        where rows added less text; row b takes its ``m_b`` real tokens, in order, at slots ``lengths[b] ..
        lengths[b] + m_b - 1``, so the store, the KT and stage 1 see exactly what a run of that row alone sees.
        """
        key_states, value_states = self.pending_keys, self.pending_values
        self.pending_keys = self.pending_values = None
        batch, _, n, _ = key_states.shape
        columns = [torch.arange(n, device=self.device)] * batch if valid is None else [
            row.nonzero()[:, 0] for row in valid
        ]
        # a sync, but this is a multi-token forward: the mirror may be stale after compiled decode steps driven
        # outside generate() (user-compiled loops), and a stale one would under-size the store
        lengths = self.lengths.tolist()
        counts = [len(c) for c in columns]
        self.host_max_length = max(lengths)
        self._ensure_capacity(max(counts))
        first_column = int(self.seen) - n
        for b, (length, taken) in enumerate(zip(lengths, columns)):
            m = len(taken)
            self.keys[b, :, length : length + m] = key_states[b, :, taken]
            self.values[b, :, length : length + m] = value_states[b, :, taken]
            self.positions[b, :, length : length + m] = (first_column + taken).to(torch.int32)
        self.lengths.add_(torch.tensor(counts, dtype=self.lengths.dtype, device=self.device))
        self.host_max_length = max(length + m for length, m in zip(lengths, counts))
        self.kt = self.ops.build_kt(self.keys, self.lengths, self.config.page_size, self.config.kt_torch_dtype)

    def _ensure_capacity(self, extra: int) -> None:
        """Grow the compressed store (eager mode) so that every row can take ``extra`` more tokens."""
        needed = self.host_max_length + extra
        if needed <= self.capacity:
            return
        new_capacity = _round_up(needed + self._headroom(), self.config.page_size)
        grow = new_capacity - self.capacity
        batch, heads, _, dim = self.keys.shape
        self.keys = torch.cat([self.keys, self.keys.new_zeros(batch, heads, grow, dim)], dim=2)
        self.values = torch.cat([self.values, self.values.new_zeros(batch, heads, grow, dim)], dim=2)
        self.positions = torch.cat([self.positions, self.positions.new_full((batch, heads, grow), -1)], dim=2)
        pages = grow // self.config.page_size
        self.kt = torch.cat([self.kt, self.kt.new_zeros(batch, heads, pages, 2, dim)], dim=2)
        self._mark_static()

    def _headroom(self) -> int:
        """Slots for tokens still to come: from generate()'s max_length when known, else the config's headroom."""
        seen = self.get_seq_length()
        if self.hints.max_length is not None and self.hints.max_length > seen:
            return self.hints.max_length - seen
        return self.config.capacity_headroom

    # ------------------------------------------------------------------------------------------ stage 1
    def observe_prefill(
        self,
        query_states: torch.Tensor,
        row_start: torch.Tensor | None,
        scaling: float,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Remember each row's last ``window_size`` real queries (stage 1's window) and its padding offset; feed the
        policy's accumulation hook.

        ``valid`` bool ``[B, n]`` marks the real tokens among this forward's queries (None = all): padding never
        enters the window, so a row's window is the one it would have alone. Chunks of a chunked prefill add to the
        window of the earlier ones. The padding offset comes from the latest chunk: its mask covers every column so
        far, while an earlier chunk may lie entirely inside a row's left padding (such a chunk's offset is its own
        length, which is still right for that chunk: every query and key in it is padding).
        """
        self._check_policy_supported()
        self.scaling = scaling
        window = self.config.window_size
        batch, n = query_states.shape[0], query_states.shape[2]
        if valid is not None and self.compressed and hasattr(self.policy, "accumulate"):
            raise NotImplementedError(
                f"stage-1 policy {self.policy.name!r} accumulates attention over every query, which is not implemented "
                f"for a batched later turn with padding between the turns: run those rows separately, or use a "
                f"window-based policy (snapkv, streaming, knorm, random)."
            )
        chunk_queries = query_states.detach()
        if valid is None:
            valid = torch.ones(batch, n, dtype=torch.bool, device=query_states.device)
        queries, count = last_real_queries(chunk_queries, valid, window)
        if self.pending_queries is not None:
            held = self.pending_queries.shape[2]
            held_valid = torch.arange(held, device=valid.device)[None, :] >= (held - self.pending_valid)[:, None]
            now_valid = torch.arange(queries.shape[2], device=valid.device)[None, :] >= (queries.shape[2] - count)[:, None]
            queries, count = last_real_queries(
                torch.cat([self.pending_queries, queries], dim=2), torch.cat([held_valid, now_valid], dim=1), window
            )
        self.pending_queries, self.pending_valid = queries, count
        if row_start is not None or self.row_start is None:
            self.row_start = row_start if row_start is not None else torch.zeros(batch, dtype=torch.long, device=self.device)
        self._accumulate(chunk_queries, scaling)

    def _accumulate(self, queries: torch.Tensor, scaling: float) -> None:
        """Policies that score with every prefill query (H2O) accumulate here, once per forward."""
        if not self.compressed:
            self.observed_columns += queries.shape[2]
        new_state = getattr(self.policy, "new_state", None)
        if new_state is None:
            return
        if self.policy_state is None:
            self.policy_state = new_state(self.keys.shape[0], self.keys.shape[1], self.device)
            if self.policy_state is None:
                return
        start, end = self._stage1_bounds()
        self.policy.accumulate(self.policy_state, queries, self.keys, start, end, scaling)

    def _stage1_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's valid slots ``[start, end)``: after the padding while dense, ``[0, lengths)`` once compressed."""
        if self.compressed:
            return torch.zeros_like(self.lengths), self.lengths
        return self.row_start, torch.full_like(self.row_start, self.keys.shape[2])

    def _check_policy_supported(self) -> None:
        """Refuse per-head budgets at the first prefill forward (not in ``update``: an error there would leave the
        attention hand-off pending)."""
        if getattr(self.policy, "per_head_budgets", False):
            raise NotImplementedError(f"RocketKVConfig.stage1={self.policy.name!r} {PER_HEAD_COUNTS_UNSUPPORTED}")

    def _make_policy(self, window_scores_fn):
        """The stage-1 policy of this layer's config. ``window_scores_fn`` is the backend's plain function (the Triton
        twin on CUDA), never a bound method of the layer: the policy must not point back at the layer, so a dropped
        cache frees its buffers at once instead of waiting for the garbage collector."""
        return get_stage1_policy(
            self.config.stage1,
            kernel_size=self.config.kernel_size,
            sink_tokens=self.config.sink_tokens,
            window_scores_fn=window_scores_fn,
        )

    def finish_prefill(self) -> None:
        """Run the stage 1 that chunked prefill deferred (no-op when already compressed or never prefilled)."""
        if not self.compressed and self.pending_queries is not None:
            self.compress()

    def compress(self) -> None:
        """Stage 1: keep each row's best ``prompt_budget`` tokens per KV head (chosen by the configured policy),
        release the rest, build the KT."""
        start, end = self._stage1_bounds()
        columns = self.positions if self.compressed else None
        if not self.compressed:
            self._check_accumulation_covers_prompt()
            if self.config.token_budget is not None:
                self._resolve_token_budget()
        inputs = Stage1Inputs(
            self.pending_queries,
            self.keys,
            start,
            end,
            budget=self.config.prompt_budget,
            scaling=self.scaling,
            window_len=self.pending_valid,
            state=self.policy_state,
        )
        kept = [self._same_count_per_head(row) for row in self.policy.select(inputs)]
        self._compact(kept, columns)
        self.pending_queries = self.pending_valid = None
        self.row_start = None
        self.policy_state = None  # a later turn accumulates afresh
        self.observed_columns = 0

    def _same_count_per_head(self, row: KeptSlots) -> torch.Tensor:
        """``[Hkv, n]`` slots of a uniform selection (this layer stores one length per row)."""
        if not row.uniform:
            raise NotImplementedError(f"stage-1 policy {self.policy.name!r} {PER_HEAD_COUNTS_UNSUPPORTED}")
        return row.slots

    def _check_accumulation_covers_prompt(self) -> None:
        """An accumulating policy (H2O) scores with every prompt query: refuse a store that was partly written
        without passing through the attention (e.g. a prefix stored with ``Cache.update``), instead of scoring
        with part of the prompt."""
        if self.policy_state is not None and self.observed_columns != self.keys.shape[2]:
            raise ValueError(
                f"stage-1 policy {self.policy.name!r} accumulates attention over every prompt query, but only "
                f"{self.observed_columns} of the {self.keys.shape[2]} stored columns passed through the rocketkv "
                f"attention (the rest were written to the cache directly). Prefill the whole prompt through the model."
            )

    def _resolve_token_budget(self) -> None:
        """token_budget mode: derive this request's prompt_budget, topk, page_size and topr, once, before its first
        stage 1 (later turns keep them: the KT pages are laid out with this page size).

        The prompt length is the dense store's width, i.e. the longest row of the padded batch: every layer and every
        row group of a row-group prefill sees the same width, so they all derive the same page size. prompt_budget
        is raised to window_size when the formula gives less (the observation window is always kept).
        """
        prompt_len = self.keys.shape[2]
        max_new = max(self.hints.max_length - prompt_len, 0) if self.hints.max_length is not None else 0
        derived = derive_budgets(prompt_len, max_new, self.config.token_budget, self.keys.shape[3])
        self.config = self.config.replace(
            prompt_budget=max(derived.prompt_budget, self.config.window_size),
            topk=derived.topk,
            page_size=derived.page_size,
            topr=derived.topr,
        )

    def _compact(self, kept: list[torch.Tensor], columns: torch.Tensor | None) -> None:
        """Gather the kept slots of every row into fresh buffers; the old ones are released."""
        batch, heads, _, dim = self.keys.shape
        counts = [k.shape[1] for k in kept]
        capacity = _round_up(max(max(counts), 1) + self._headroom(), self.config.page_size)
        keys = self.keys.new_zeros(batch, heads, capacity, dim)
        values = self.values.new_zeros(batch, heads, capacity, dim)
        positions = torch.full((batch, heads, capacity), -1, dtype=torch.int32, device=self.device)
        for b, slots in enumerate(kept):
            n = slots.shape[1]
            idx = slots[:, :, None].expand(heads, n, dim)
            keys[b, :, :n] = self.keys[b].gather(1, idx)
            values[b, :, :n] = self.values[b].gather(1, idx)
            positions[b, :, :n] = (columns[b].gather(1, slots) if columns is not None else slots).to(torch.int32)
        self.keys, self.values, self.positions = keys, values, positions
        self.lengths = torch.tensor(counts, dtype=torch.long, device=self.device)
        self.host_max_length = max(counts)
        self.host_decoded = 0
        self.kt = self.ops.build_kt(self.keys, self.lengths, self.config.page_size, self.config.kt_torch_dtype)
        self.compressed = True
        self._mark_static()

    @staticmethod
    def stack_rows(parts: list["RocketKVLayer"], new_layer) -> "RocketKVLayer":
        """One compressed layer holding the rows of ``parts`` in order (row-group prefill, then batched decode).

        ``new_layer()`` makes the empty layer to fill: the adopting cache's own layer factory, so the stacked layer
        keeps its kind (stage-1 policy) and shares that cache's hints. The parts saw the same input columns (one
        padded batch), so they share ``seen``; capacities may differ (rows shorter than the budget keep fewer
        tokens), so every part is padded with empty slots to the largest.
        """
        first = parts[0]
        if not all(part.compressed for part in parts):
            raise RuntimeError("RocketKVLayer.stack_rows needs compressed layers (stage 1 done on every row group)")
        capacity = max(part.capacity for part in parts)
        pages = capacity // first.config.page_size
        layer = new_layer()
        layer.config = first.config  # the parts' effective config (token_budget mode derives it per request)
        layer.dtype, layer.device, layer.ops, layer.scaling = first.dtype, first.device, first.ops, first.scaling
        layer.policy = first.policy
        layer.keys = torch.cat([_pad_dim2(part.keys, capacity, 0) for part in parts])
        layer.values = torch.cat([_pad_dim2(part.values, capacity, 0) for part in parts])
        layer.positions = torch.cat([_pad_dim2(part.positions, capacity, -1) for part in parts])
        layer.kt = torch.cat([_pad_dim2(part.kt, pages, 0) for part in parts])
        layer.lengths = torch.cat([part.lengths for part in parts])
        layer.seen = first.seen.clone()
        layer.host_seen = first.host_seen
        layer.host_max_length = max(part.host_max_length for part in parts)
        layer.compressed = layer.is_initialized = True
        layer._mark_static()
        return layer

    def _mark_static(self) -> None:
        """Fixed addresses for CUDA graphs: decode mutates these tensors in place and never reallocates them."""
        if torch.compiler.is_compiling():
            return
        self._tag_keys()
        for tensor in (self.keys, self.values, self.kt, self.positions, self.lengths, self.seen):
            torch._dynamo.mark_static_address(tensor)

    # ------------------------------------------------------------------------------------------ generate hooks
    def _index_batch(self, index: torch.Tensor, in_place: bool = False) -> None:
        for name in ("keys", "values", "kt", "positions", "lengths", "pending_queries", "pending_valid", "row_start"):
            tensor = getattr(self, name)
            if tensor is None:
                continue
            selected = tensor.index_select(0, index.to(tensor.device))
            if in_place and self.compressed:
                tensor.copy_(selected)  # beam search reorders every step: keep the buffers' addresses
            else:
                setattr(self, name, selected)
        self._tag_keys()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._index_batch(beam_idx, in_place=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_batch(torch.arange(self.keys.shape[0], device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._index_batch(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` decoded tokens, restoring the state before those decode steps.

        generate()'s deferred stop check (``deferred_stop_check``) runs one decode step past an EOS stop and undoes it
        with ``crop(-1)``; ``crop(0)`` is a no-op. Evicted prompt tokens cannot come back, so a positive value (the
        legacy absolute length), more tokens than were decoded since stage 1, or a dense layer raise.
        """
        if tokens_to_remove > 0:
            raise NotImplementedError(CROP_UNSUPPORTED)
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        count = -tokens_to_remove
        if not self.compressed or count > self.host_decoded:
            raise NotImplementedError(CROP_UNSUPPORTED)
        rows = torch.arange(self.keys.shape[0], device=self.device)
        for _ in range(count):
            self.lengths.sub_(1)
            slot = self.lengths
            self.keys[rows, :, slot] = 0
            self.values[rows, :, slot] = 0
            self.positions[rows, :, slot] = -1
        self.seen.sub_(count)
        self.host_seen -= count
        self.host_max_length -= count
        self.host_decoded -= count
        # a page's min/max cannot be un-folded: rebuild the summaries of what is left (in place: fixed addresses)
        self.kt.copy_(self.ops.build_kt(self.keys, self.lengths, self.config.page_size, self.config.kt_torch_dtype))

    def offload(self):
        raise NotImplementedError("RocketKVCache does not support offloading=True")

    prefetch = offload
