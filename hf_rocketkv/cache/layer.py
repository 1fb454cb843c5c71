"""RocketKVLayer: one decoder layer's KV store behind transformers' cache-layer contract, in two states.

dense       from the first prompt token until stage 1 runs. Slot s holds column s of the input (left padding
            included), exactly like a DynamicLayer, so prefill attention (chunked or not) is plain causal
            attention with transformers' own mask. Contiguous tensors (a prefix hit starts it from pool pages).
compressed  after stage 1. Per row b and KV head h, slots [0, lengths[b]) hold the kept prompt tokens in
            ascending original position, then every generated token. Padding is never stored. The slots live in
            pages (``PagedStore``: the pool's pages with ``pool=``, else a store of the layer's own) with the KT
            page summaries beside them; decode writes one slot per row in place through the block table.

Tensors (B batch, Hkv KV heads, C capacity, PP tokens per page, KP = config.page_size, D head_dim):
    store.k, store.v [N, Hkv, PP, D]      model dtype (private store: PP = KP, N = B * C / KP); an fp8 pool's
                                          pages are e4m3 with store.k_scale / v_scale [N] or [N, Hkv] (paged_store)
    store.kt         [N, Hkv, PP/KP, 2, D] KT dtype (min, max of each KT page)
    store.table      [B, C/PP] int32       row b's slot s is in page table[b, s // PP] at offset s % PP
    positions        [B, Hkv, C]           int32 input column of each stored token (-1 = empty slot)
    lengths          [B]                   int64 tokens stored per row (every KV head holds the same count), or
                     [B, Hkv]              per row and KV head when the policy gives heads their own budgets
                                           (``per_head_budgets``: AdaKV); a row's capacity then covers its
                                           longest head, shorter heads leave their slots past lengths[b, h] empty
``keys``, ``values`` and ``kt`` read as contiguous ``[B, Hkv, C, D]`` / ``[B, Hkv, C/KP, 2, D]`` copies (gathered
from the pages) for introspection and tests; the hot paths use the pages.

The layer keeps transformers' layer contract and the state above, set only by its own methods (``hold_view``,
``move_view``, ``forget_decoded``, ...); parts with state of their own are objects it holds (``dense``: the
``DenseStore``; ``prefix``: the ``PrefixHit``; ``stage1``; ``generated``: the ``GeneratedTokens``; ``history``), and
the jobs are modules of their own that compute and hand over (``stage1`` + ``compaction``, ``working_set``,
``decode_append``, ``stage2``, ``capacity``, ``row_index``, ``row_stacking``). The attention function finds the layer through the
key tensor ``update()`` returned (``seam.layer_of``; docs/seam.md).
"""

from __future__ import annotations

import torch

from transformers import CacheLayerMixin
from ..config import RocketKVConfig
from ..kernels.arrivals import ArrivalCounters
from ..kernels.dispatch import RocketOps, get_ops
from ..selection.logit_features import PLAIN, LogitFeatures
from ..selection.stage1_snapkv import scores_with
from ..selection.stage2_pages import per_head
from . import decode_append, row_index, row_stacking, stage2, working_set
from .consistency import INTERRUPTED_FORWARD, UNCONSUMED_KEYS
from .dense_store import DenseStore
from .generated_tokens import GeneratedTokens, decode_compression
from .hints import GenerationHints
from .history import History
from .op_graphs import OpGraph
from .prefix_hit import PrefixHit
from .paged_store import PagedStore
from .row_index import CROP_UNSUPPORTED
from .seam import layer_of, tag
from .stage1 import UNDECLARED_PER_HEAD_COUNTS, Stage1, last_real_queries, make_policy
from .working_set import PER_HEAD_LATER_TURN

__all__ = ["CROP_UNSUPPORTED", "INTERRUPTED_FORWARD", "PER_HEAD_LATER_TURN", "UNCONSUMED_KEYS",
           "UNDECLARED_PER_HEAD_COUNTS", "GenerationHints", "RocketKVLayer", "last_real_queries", "layer_of"]


class RocketKVLayer(CacheLayerMixin):
    # Decode is static-shape (fixed capacity, state in tensors, no host sync), so generate() may compile it;
    # prefill and stage 1 always run eagerly (generate compiles decode steps only).
    is_compileable = True
    is_sliding = False
    is_croppable = False
    # Layers whose eager decode steps may use CUDA graphs (BatchedDecodeLayer: no, its rows change between steps)
    EAGER_GRAPHS = True

    def __init__(self, config: RocketKVConfig, hints: GenerationHints, pages=None, layer_idx: int | None = None,
                 counters=None, counts_tokens: bool | None = None):
        """``pages``: where compressed pages come from (``cache/pool_pages.py``'s per-request object when the cache
        has a pool; None: the layer allocates its own). ``layer_idx``: this layer's index in the model (the pool
        keeps one set of page tensors per layer). ``counters``: the cache's ``RequestCounters``; ``counts_tokens``:
        whether this layer adds the tokens prefill computes to them (None: layer 0 does)."""
        self.dense = DenseStore()  # the dense store until stage 1, a later turn's working set (``dense_store.py``)
        super().__init__()
        self.config = config
        self.hints = hints
        self.pages = pages
        self.layer_idx = layer_idx
        self.counters = counters
        self.counts_tokens = layer_idx == 0 if counts_tokens is None else counts_tokens
        self.store: PagedStore | None = None  # the compressed view, in pages
        self.history: History | None = None  # multi_turn="keep_all": every token of the conversation (history.py)
        self.prefix = PrefixHit()  # a prefix hit: the columns the pool's pages provide, and their replay
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.arrivals = ArrivalCounters()  # stage 2's, one per row and KV head (kernels/arrivals.py)
        self.compressed = False
        self.seen: torch.Tensor | None = None  # 0-d int64 on the device: logical tokens seen (compile-safe)
        self.host_max_length = 0  # host mirror of lengths.max(), so decode never syncs with the GPU
        # rows of a pool-backed view may hold fewer pages than the widest: how many fewer decode steps the tightest
        # row can take than (capacity - host_max_length) says (0 for a private store, where every row is as wide)
        self.host_slack = 0
        self.host_decoded = 0  # one-token decode steps appended since stage 1 last ran (what crop may remove)
        self.host_seen = 0  # host count of the tokens eager updates stored: tells an interrupted forward apart
        self.ops: RocketOps | None = None
        self.scaling: float | None = None  # the attention's softmax scale, from the latest observe_prefill
        self.features: LogitFeatures = PLAIN  # soft-capping / sinks of the model's attention (``use_features``)
        # per-layer tensors update() returns once compressed: the attention function finds the layer through them
        # (the page tensors may be a pool's, shared by every cache); they hold no data
        self.key_handle = self.value_handle = None
        self.op_graphs = {"append": OpGraph(), "attention": OpGraph()}  # eager decode steps as CUDA graphs
        # set by update(), cleared by the attention function: still set at the next update means the attention that
        # should have consumed these keys never ran (not "rocketkv", or an interrupted forward)
        self.awaiting_attention = False
        # a later turn's new tokens, stored by the attention function once it knows which are padding
        self.pending_keys = self.pending_values = None
        self.policy = make_policy(config, None)  # the stage-1 policy; rebuilt with the backend's twin on a device
        self.stage1 = Stage1()
        self.generated = GeneratedTokens(decode_compression(config))  # decode-time compression (decode_budget)

    # ------------------------------------------------------------------------------------------ contiguous views
    @property
    def keys(self) -> torch.Tensor | None:
        """Dense store / working set; once compressed a contiguous copy ``[B, Hkv, C, D]`` gathered from the pages."""
        if self.compressed and self.dense.keys is None and self.store is not None:
            return self.store.gather()[0]
        return self.dense.keys

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self.dense.hold(tensor, self.dense.values)

    @property
    def values(self) -> torch.Tensor | None:
        if self.compressed and self.dense.values is None and self.store is not None:
            return self.store.gather()[1]
        return self.dense.values

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self.dense.hold(self.dense.keys, tensor)

    @property
    def kt(self) -> torch.Tensor | None:
        """KT summaries as ``[B, Hkv, C/KP, 2, D]`` (a copy; built over the working set during a later turn)."""
        if not self.compressed:
            return None
        if self.dense.keys is not None:
            return self.ops.build_kt(self.dense.keys, self.lengths, self.config.page_size, self.config.kt_torch_dtype)
        return self.store.gather_kt()

    @property
    def working(self) -> bool:
        """A later turn's contiguous working set is in use (between storing its tokens and stage 1)."""
        return self.compressed and self.dense.keys is not None

    @property
    def row_start(self) -> torch.Tensor | None:
        """``[B]`` int64 padding offset of each row until stage 1 runs (``Stage1.row_start``; read by pool_pages)."""
        return self.stage1.row_start

    # ------------------------------------------------------------------------------------------ lifecycle
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Sizes come from the first K/V seen, so tensor-parallel shards and device maps need nothing special."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_kv_heads, self.head_dim = key_states.shape[1], key_states.shape[3]
        self.ops = get_ops(self.config.backend, self.device)
        self.policy = make_policy(self.config, self.ops.window_scores)
        self.seen = torch.zeros((), dtype=torch.long, device=self.device)
        if self.pages is not None:
            self.pages.check_layer(self, key_states)
        if self.prefix.tokens:  # a prefix hit: its columns come from the pool's pages; replayed ones are not stored
            room = key_states.shape[2] - self.prefix.replayed_columns(key_states.shape[2])
            self.dense.start(key_states, value_states, self.pages.prefix_keys(self, key_states, room=room), room)
            self.seen.fill_(self.prefix.next_column)
        else:
            self.dense.start(key_states, value_states)
        self.is_initialized = True

    def use_request_config(self, config: RocketKVConfig) -> None:
        """Run with ``config`` from here on: the request's own budgets (token_budget mode, before stage 1)."""
        self.config = config

    def reset(self) -> None:
        self.__init__(self.config, self.hints, self.pages, self.layer_idx, self.counters, self.counts_tokens)

    def seed_prefix(self, tokens: int, start: int | None = None) -> None:
        """Before the first update: input columns ``[0, tokens)`` come from a prefix hit (``self.pages`` gathers
        them at the first update), so the logical length starts there and generate() prefills only the rest.
        ``start < tokens``: the forwards replay input columns ``[start, tokens)`` first (a model with sliding-window
        layers rebuilds their windows, ``PoolPages.setup_prefix``; ``prefix_hit.py``)."""
        if self.is_initialized:
            raise RuntimeError("RocketKVLayer.seed_prefix needs a layer that has stored nothing yet")
        self.host_seen = self.prefix.seed(tokens, start)

    @property
    def batch_size(self) -> int:
        if not self.is_initialized:
            raise AttributeError("batch_size")  # Cache.batch_size skips layers without it
        return self.lengths.shape[0] if self.compressed else self.dense.keys.shape[0]

    # ------------------------------------------------------------------------------------------ sizes
    def get_seq_length(self) -> int:
        """Logical tokens seen (positions of new tokens continue from here), not tokens stored.

        Under torch.compile and in a captured step (``hints.in_graph``) it is the 0-d device counter itself (Llama 4's
        NoPE layers add it to an arange in their forward): no host sync, and nothing frozen at capture.
        """
        if not self.is_initialized:
            return self.prefix.next_column
        if torch.compiler.is_compiling() or self.hints.in_graph:
            return self.seen
        return int(self.seen)

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.compressed:
            # dense: the mask covers the stored columns plus the new ones, exactly like a DynamicLayer (a replayed
            # prefix hit: the hit's columns, or the forward's last column when it reaches past them)
            stored = self.dense.keys.shape[2] if self.is_initialized else self.prefix.tokens
            if self.prefix.replay_pos is not None:
                return max(stored, self.prefix.replay_pos + query_length), 0
            return stored + query_length, 0
        if query_length == 1:
            # Decode: the attention function builds validity from `lengths` and ignores the mask, so its size only has
            # to stay constant (a growing mask would recompile a compiled decode step every step): one per capacity.
            return self.capacity + 1, 0
        # A later turn: the mask's last query_length columns say which new tokens are padding.
        return int(self.seen) + query_length, 0

    @property
    def per_head_lengths(self) -> bool:
        """The compressed view stores one length per row and KV head (``lengths`` ``[B, Hkv]``): the stage-1 policy
        gives heads their own budgets (AdaKV). Fixed by the config, so every request has the same layout."""
        return bool(getattr(self.policy, "per_head_budgets", False))

    def kept_tokens(self) -> torch.Tensor:
        """Tokens physically stored, ``[B, Hkv]`` (padding excluded once compressed)."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        if not self.compressed:
            width = self.dense.keys.shape[2]
            stored = width - self.row_start if self.row_start is not None else width
            stored = torch.as_tensor(stored, device=self.device).expand(self.dense.keys.shape[0])
            return stored[:, None].expand(-1, self.dense.keys.shape[1]).clone()
        return per_head(self.lengths, self.lengths.shape[0], self.num_kv_heads).clone()

    def memory_bytes(self) -> int:
        """Bytes this layer holds: its pages (a pool's: the pages its rows hold), positions, lengths, and the
        contiguous dense store / working set and pending queries when present."""
        tensors = (self.dense.keys, self.dense.values, self.positions, self.lengths, *self.stage1.tensors(),
                   *self.generated.tensors())
        held = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        held += self.store.nbytes() if self.store is not None else 0
        if self.history is not None:
            held += self.history.store.nbytes() + sum(
                t.numel() * t.element_size() for t in (self.history.positions, self.history.lengths))
        return held

    @property
    def capacity(self) -> int:
        """Slots per row: of the working set during a later turn, of the paged view once compressed, of the dense
        store before."""
        if self.dense.keys is not None:
            return self.dense.keys.shape[2]
        return self.store.capacity if self.store is not None else 0

    def decode_room(self) -> int:
        """Decode steps every row can still take without growing its store (host mirror, no sync)."""
        room = self.capacity - self.host_max_length - self.host_slack
        return room if self.history is None else min(room, self.history.room())

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens ``[B, Hkv, n, D]``; returns the K/V a dense attention would use while dense,
        per-layer handles once compressed, tagged for ``layer_of``. A later turn's tokens (several on a compressed
        layer) are only staged here: the attention function stores them once the mask says which are padding."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        query_length = key_states.shape[2]
        if query_length > 1 and self.compressed and self.history is None and self.per_head_lengths:
            # refused before any state changes, so the cache stays usable for decode steps
            raise NotImplementedError(PER_HEAD_LATER_TURN.format(name=self.policy.name))
        if self.host_bookkeeping():
            self.awaiting_attention = True  # cleared by the attention function; RocketKVCache.update checks it
            self.host_seen += query_length
        if query_length == 1 and self.compressed:  # a decode step: append_one counts ``seen`` with the token
            decode_append.append_one(self, key_states, value_states, graphed=self.eager_graphs())
            return self.key_handle, self.value_handle
        self.seen.add_(query_length)
        if not self.compressed:
            skip = self.prefix.consume(query_length)
            if skip:  # the replayed columns' K/V are the hit's (already in the store): only the rest is written
                key_states, value_states = key_states[:, :, skip:], value_states[:, :, skip:]
            self.dense.append(key_states, value_states, self.hints.prefill_columns)
            self.tag_keys()  # a new dense buffer or view every forward but a prefix hit's first
            return self.dense.keys, self.dense.values
        self.pending_keys, self.pending_values = key_states, value_states
        return self.key_handle, self.value_handle

    def tag_keys(self) -> None:
        """Let the attention function find this layer from the key tensor update() returns (``seam.layer_of``)."""
        tag(self.key_handle if self.compressed else self.dense.keys, self)

    def attention_ran(self) -> None:
        """Called by the ``rocketkv`` attention function once it has found this layer."""
        self.awaiting_attention = False

    def host_bookkeeping(self) -> bool:
        """Whether this code runs eagerly, once per step (not traced by torch.compile, not a CUDA-graph step)."""
        return not (torch.compiler.is_compiling() or self.hints.in_graph)

    def eager_graphs(self) -> bool:
        """Whether this eager decode step runs its RocketKV launches through this layer's OpGraphs: CUDA, the
        Triton ops, ``config.eager_layer_graphs``, no keep_all history or decode-time compression (their extra
        launches stay eager, so both stay on the plain path), and not under torch.compile, a whole-step graph or
        anyone else's capture."""
        return (self.EAGER_GRAPHS and self.config.eager_layer_graphs and self.ops.name == "triton"
                and self.history is None and self.generated.settings is None and self.store.k.is_cuda
                and not torch.compiler.is_compiling() and not self.hints.in_graph
                and not torch.cuda.is_current_stream_capturing())

    def note_decode_step(self, graphed: bool = False) -> None:
        """Host mirrors after one decode step stored its token (eager here; compiled / graphed runners call it with
        ``graphed``: their traced update() skipped the host count of its input too)."""
        if graphed:
            self.host_seen += 1
        self.host_max_length += 1
        self.host_decoded += 1
        self.generated.note_stored(1)
        if self.history is not None:
            self.history.note_stored(1)

    def forget_decoded(self, count: int) -> None:
        """Counters and host mirrors after ``crop`` removed the last ``count`` decoded tokens from the view (the
        history loses them too; decode-time compression's query buffer keeps their queries: only scoring sees it)."""
        self.seen.sub_(count)
        self.host_seen -= count
        self.host_max_length -= count
        self.host_decoded -= count
        self.generated.note_stored(-count)
        if self.history is not None:
            self.history.drop_last(count)

    def move_view(self, store: PagedStore, positions: torch.Tensor, slack: int) -> None:
        """The compressed rows now live in ``store`` (their tokens written there: a grown view), their positions
        ``[B, Hkv, store.capacity]``, with ``slack`` slots that no row can use."""
        self.store, self.positions, self.host_slack = store, positions, slack
        self.mark_static()

    def hold_view(self, store: PagedStore, positions: torch.Tensor, lengths: torch.Tensor, host_max_length: int,
                  host_slack: int, queries: torch.Tensor | None = None) -> None:
        """The layer's kept tokens now live in a fresh view (stage 1's compaction, row stacking): ``store`` with their
        ``positions`` ``[B, Hkv, store.capacity]`` and ``lengths`` ``[B]`` (``[B, Hkv]`` with per-head budgets), the
        longest row ``host_max_length``, ``host_slack`` slots no row can use. The dense store or working set is
        dropped, decode-time compression starts over (``queries``: see ``GeneratedTokens.start``), and the empty
        handles transformers holds (``[B, Hkv, 0, D]``) are made on the first view."""
        self.store, self.positions, self.lengths = store, positions, lengths
        self.dense.hold(None, None)
        self.host_max_length, self.host_slack, self.host_decoded = host_max_length, host_slack, 0
        self.generated.start(self, queries)
        if not self.compressed:
            self._make_handles(lengths.shape[0])
        self.compressed = True
        self.mark_static()

    def resize_view(self, store: PagedStore, positions: torch.Tensor, lengths: torch.Tensor) -> None:
        """A private view of another batch size, its rows' positions and lengths (rows picked by index; ``row_index``
        writes their tokens next)."""
        self.store, self.positions, self.lengths = store, positions, lengths
        self._make_handles(store.batch)
        self.arrivals = ArrivalCounters()  # counters for the new batch size come with its first decode step

    def _make_handles(self, batch: int) -> None:
        """The empty K/V ``[batch, Hkv, 0, D]`` a compressed layer returns to transformers (``mark_static`` tags it)."""
        self.key_handle = torch.empty((batch, self.num_kv_heads, 0, self.head_dim), dtype=self.dtype,
                                      device=self.device)
        self.value_handle = torch.empty_like(self.key_handle)

    def hold_history(self, history: History | None) -> None:
        """keep_all: the conversation's whole history (stage 1's prompt pages; stacked row groups' histories)."""
        self.history = history

    def mark_static(self) -> None:
        """Fixed addresses for CUDA graphs: decode mutates these tensors in place and never reallocates them."""
        if torch.compiler.is_compiling():
            return
        self.tag_keys()
        store, history = self.store, self.history
        tensors = [store.k, store.v, store.kt, store.k_scale, store.v_scale, store.table, self.positions, self.lengths,
                   self.seen, self.key_handle, self.value_handle, *self.generated.tensors()]
        if history is not None:
            tensors += [history.store.k, history.store.v, history.store.k_scale, history.store.v_scale,
                        history.store.table, history.positions, history.lengths]
        for tensor in tensors:
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)

    # ------------------------------------------------------------------------------------------ stage 1
    def observe_prefill(self, query_states: torch.Tensor, row_start: torch.Tensor | None, scaling: float,
                        valid: torch.Tensor | None = None, host_row_start: list[int] | None = None) -> None:
        """Remember each row's last ``window_size`` real queries ``[B, Hq, n, D]`` (``valid`` bool ``[B, n]``: the real
        ones, None = all) and its padding offset ``row_start`` ``[B]`` (``host_row_start``: the same as Python ints);
        feed the policy's accumulation hook (``Stage1.observe``)."""
        self.scaling = scaling
        self.stage1.observe(self, query_states, row_start, scaling, valid, host_row_start)

    def use_features(self, features: LogitFeatures) -> None:
        """The attention's logits are soft-capped and/or have sinks (``features``, seen at the first prefill): stage 1
        scores, stage 2 page scores and every exact attention of this layer use them. Stage 1's window scores with
        them are PyTorch ops (``scores_with``); stage 2 keeps the backend's ops, whose sparse-decode attention takes
        the cap and the sinks (``cache/stage2.stage2_attention``). Policies that score with their own
        logits are refused."""
        if features.plain or features.same_as(self.features):
            return
        refused = features_refusal(self.config, self.policy, features)
        if refused:
            raise NotImplementedError(refused)
        self.features = features
        self.policy = make_policy(self.config, scores_with(features))

    def finish_prefill(self) -> None:
        """Run the stage 1 that chunked prefill deferred (no-op when already compressed or never prefilled)."""
        if not self.compressed and self.stage1.pending_queries is not None:
            self.compress()

    def compress(self) -> None:
        """Stage 1: keep each row's best ``prompt_budget`` tokens per KV head in a fresh view, release the rest."""
        self.stage1.run(self)

    # ------------------------------------------------------------------------------------------ later turn
    def store_new_tokens(self, valid: torch.Tensor | None) -> None:
        """The later turn's tokens staged by ``update``, padding skipped (``valid`` bool ``[B, n]``), into the
        working set (``working_set.py``)."""
        working_set.store_new_tokens(self, valid)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The later turn's K/V ``[B, Hkv, n, D]`` that ``update`` staged, handed over once."""
        keys, values, self.pending_keys, self.pending_values = self.pending_keys, self.pending_values, None, None
        return keys, values

    def hold_working_set(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                         lengths: torch.Tensor, host_max_length: int) -> None:
        """A later turn's contiguous working set (``working_set.py``) until stage 1 compacts it: K/V ``[B, Hkv, W, D]``,
        input columns ``positions`` ``[B, Hkv, W]``, ``lengths`` ``[B]``, the longest ``host_max_length``."""
        self.dense.hold(keys, values)
        self.positions, self.lengths = positions, lengths
        self.host_max_length = host_max_length

    def attend_later_turn(self, query: torch.Tensor, scaling: float,
                          valid: torch.Tensor | None = None) -> torch.Tensor:
        """Exact attention of a later turn's queries ``[B, Hq, n, D]`` over the working set -> ``[B, n, Hq, D]``."""
        return working_set.attend_working_set(self, query, scaling, valid)

    # ------------------------------------------------------------------------------------------ decode
    def attend_decode(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Stage 2 of a decode step (``stage2.py``): ``query`` ``[B, Hq, 1, D]`` -> ``[B, 1, Hq, D]``."""
        return stage2.decode_attention(self, query, scaling)

    def record_decode_query(self, query: torch.Tensor) -> None:
        """Decode attention: push this step's query ``[B, Hq, 1, D]`` into decode-time compression's ring buffer."""
        self.generated.record(query)

    def maybe_compress_decode(self) -> bool:
        """Before a decode step stores its token (eager steps, and the compiled / graphed runners between steps):
        compress the generated tokens when due; whether it ran."""
        if not self.generated.due(self):
            return False
        self.compress_decode()
        return True

    def compress_decode(self) -> None:
        """Keep ``decode_budget`` generated tokens per row and KV head, in place (``GeneratedTokens.compress``)."""
        self.host_max_length -= self.generated.compress(self)
        self.host_decoded = 0  # crop cannot undo a compression

    # ------------------------------------------------------------------------------------------ rows
    def initialize_like(self, other: "RocketKVLayer") -> None:
        """Run with ``other``'s settings (a layer stacking the rows of row groups that saw the same input columns):
        its effective config (token_budget derives one per request), dtype, device, ops, scaling, head shapes,
        stage-1 policy and logit features, and its input count ``seen`` (copied)."""
        self.config, self.dtype, self.device, self.ops = other.config, other.dtype, other.device, other.ops
        self.scaling, self.num_kv_heads, self.head_dim = other.scaling, other.num_kv_heads, other.head_dim
        self.policy, self.features = other.policy, other.features
        self.seen, self.host_seen = other.seen.clone(), other.host_seen
        self.is_initialized = True

    @staticmethod
    def stack_rows(parts: list["RocketKVLayer"], new_layer) -> "RocketKVLayer":
        """One compressed layer holding the rows of ``parts`` in order; ``new_layer()`` makes the layer to fill."""
        return row_stacking.stack_rows(parts, new_layer)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            row_index.index_rows(self, beam_idx, in_place=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            row_index.index_rows(self, torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            row_index.index_rows(self, indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` decoded tokens (``crop(-1)``: the deferred stop check's extra step);
        anything else raises (``row_index.crop``)."""
        row_index.crop(self, tokens_to_remove)

    def offload(self):
        raise NotImplementedError("RocketKVCache does not support offloading=True")

    prefetch = offload


def features_refusal(config: RocketKVConfig, policy, features: LogitFeatures) -> str | None:
    """Why a layer whose logits have ``features`` cannot run with ``config`` (None: it can): the scorers that
    compute attention logits of their own (H2O's accumulation, decode-time compression) do not apply soft-capping
    or sinks, so they would rank tokens by other logits than the model attends with."""
    what = " and ".join(name for name, on in (("logit soft-capping", features.softcap is not None),
                                               ("attention sinks", features.sinks is not None)) if on)
    if hasattr(policy, "accumulate"):
        return (f"RocketKVConfig.stage1={policy.name!r} scores with attention logits of its own, without this model's "
                f"{what}. Use stage1='snapkv' (its window scores use the model's logits), 'streaming', 'knorm' "
                f"or 'random'.")
    if config.decode_budget is not None:
        return (f"RocketKVConfig.decode_budget (decode-time compression) scores generated tokens with logits of its "
                f"own, without this model's {what}. Leave decode_budget=None for this model.")
    return None
