"""RocketKVCache: transformers ``Cache`` container of RocketKVLayer objects, created lazily per layer.

    cache = RocketKVCache(RocketKVConfig(prompt_budget=256, topk=16))
    model.generate(ids, cache=cache, max_new_tokens=64)
    cache.kept_tokens(0)      # LongTensor [batch, kv_heads] physically stored in layer 0
    cache.get_seq_length()    # logical tokens seen (prompt + fed-back generated tokens)
    cache.memory_bytes()      # K/V + KT + index tensors actually allocated
    cache.stats               # CacheStats(reused_tokens, computed_tokens, offloaded_bytes, onloaded_bytes, ...)

With ``pool=KVBlockPool(...)`` the layers' pages come from the pool (``pool_pages.py``): admission before prefill,
prefix reuse, keep_all history in pool pages; ``cache.close()`` (or reset, or garbage collection) gives them back.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable

import torch
from transformers import Cache

from ..config import RocketKVConfig
from ..memory import KVBlockPool, PrefixKeys
from ..memory.layer_kinds import chunked_layers, describe, sliding_windows
from .consistency import check_attention, check_batch, check_layers_consistent
from .dense_layer import DenseLayer
from .layer import GenerationHints, RocketKVLayer
from .layer_plan import check_layer_count, layer_config
from .pool_pages import PoolPages, release_rows_later
from .row_index import CROP_UNSUPPORTED
from .seam import copy_with_owners
from .sliding_layer import SlidingWindowLayer
from .stats import CacheStats, RequestCounters


class RocketKVCache(Cache):
    """KV cache that evicts after prefill (stage 1) and serves sparse page attention during decode (stage 2).

    Needs a model whose attention implementation is ``"rocketkv"`` (``hf_rocketkv.enable(model)`` or
    ``from_pretrained(..., attn_implementation="rocketkv")``). One cache serves one request: pass a fresh one to
    each ``generate`` call, or continue the same conversation with it.

    Args:
        config: the RocketKVConfig (``**overrides`` change fields of it).
        pool: a ``KVBlockPool`` to draw pages from (shared by every cache made with it); None: the layers allocate
            their own. Its ``kt_page_size`` and ``kt_dtype`` must equal ``config.page_size`` and
            ``config.kt_cache_dtype``, its ``dtype`` the model's.
        cache_salt: tenant key of the prefix index (a prefix is shared only between requests with the same salt);
            from the server's trusted side. Pool only.
        prefix_keys: other inputs that decide the prompt's K/V besides its ids (``PrefixKeys(adapter=...,
            multimodal=...)``), one for every row or a list with one per row; ``cache_salt`` overrides their salt.
        model_config: the model's transformers config, for models with sliding-window layers (Gemma 2 and 3, Cohere
            2, gpt-oss, Mistral with a window): its ``layer_types`` / ``sliding_window`` give each sliding layer a
            ``SlidingWindowLayer`` (``configure_layers``), and its layer count sizes ``budget_schedule``'s shares.
            generate() passes it itself; plain forwards on such a model (or with a schedule other than flat) need it.
            None: every layer is a RocketKV layer.

    ``config.dense_layers`` > 0 makes the first layers ``DenseLayer`` objects (every token kept and attended), and
    ``config.budget_schedule`` gives each RocketKV layer its share of prompt_budget and topk (``layer_plan.py``).
    """

    # Run at every construction. The integration installs its check of the private transformers symbols it relies on
    # here when hf_rocketkv registers (integration/registration.py), so a transformers whose private symbols changed
    # fails at the first RocketKV use, naming the version and the symbol; the cache itself uses no private name.
    compatibility_check: Callable[[], None] | None = None
    # Set there too: the name of the attention the module calling ``update`` will run when it is not 'rocketkv'
    # (None when it is, or when the caller is no transformers module), read at layer 0's eager update.
    other_attention: Callable[[], str | None] | None = None

    @classmethod
    def install_integration(cls, compatibility_check: Callable[[], None],
                            other_attention: Callable[[], str | None]) -> None:
        """The integration's two hooks above (``integration/registration.py``, once at ``import hf_rocketkv``)."""
        cls.compatibility_check = staticmethod(compatibility_check)
        cls.other_attention = staticmethod(other_attention)

    def __init__(self, config: RocketKVConfig | None = None, pool: KVBlockPool | None = None,
                 cache_salt: str | None = None, prefix_keys: PrefixKeys | list[PrefixKeys] | None = None,
                 model_config=None, **overrides):
        if RocketKVCache.compatibility_check is not None:
            RocketKVCache.compatibility_check()
        config = config if config is not None else RocketKVConfig()
        if not isinstance(config, RocketKVConfig):
            raise TypeError(f"RocketKVCache(config=...) takes a RocketKVConfig, got {type(config).__name__}")
        self.config = config.replace(**overrides) if overrides else config
        self.hints = GenerationHints()
        self.counters = RequestCounters()
        self.pool = pool
        self.pages: PoolPages | None = None
        if pool is not None:
            self.pages = PoolPages(pool, self.config, _prefix_keys(pool, self.config, cache_salt, prefix_keys),
                                   self.counters)
            # a cache dropped without close() queues its tables; the pool releases them at its next call
            self._finalizer = weakref.finalize(self, release_rows_later, pool, self.pages.rows,
                                               self.pages.reservations)
        elif cache_salt is not None or prefix_keys is not None:
            raise ValueError("RocketKVCache: cache_salt and prefix_keys key the pool's prefix index; pass pool= too")
        super().__init__(layer_class_to_replicate=functools.partial(
            RocketKVLayer, self.config, self.hints, self.pages, counters=self.counters))
        self.layer_windows: tuple[int | None, ...] | None = None  # per layer: its sliding window, None = RocketKV
        self.layer_chunked: tuple[bool, ...] | None = None  # per layer: its window is an attention chunk (Llama 4)
        self.num_layers: int | None = None  # the model's layer count, once a model config was given
        if model_config is not None:
            self.configure_layers(model_config)
        elif pool is not None and pool.has_sliding_layers:  # the pool was built for the model: it knows its layers
            self.layer_windows, self.num_layers = pool.layer_windows, len(pool.layer_windows)

    def configure_layers(self, model_config) -> "RocketKVCache":
        """Read which layers of the model slide from its config (``layer_types``, ``sliding_window``;
        ``memory/layer_kinds.py``): those get a ``SlidingWindowLayer`` (their last ``sliding_window`` tokens, dense,
        nothing scored), the full-attention layers RocketKV layers. Idempotent; generate() calls it. Raises
        ValueError for layer types RocketKV cannot serve, or layer kinds other than those the cache's pool was built
        for. Returns the cache."""
        windows = sliding_windows(model_config)
        chunked = chunked_layers(model_config)
        check_layer_count(self.config, len(windows))
        if windows == self.layer_windows and chunked == self.layer_chunked:
            return self
        if self.pool is not None and windows != self.pool.layer_windows:
            raise ValueError(HYBRID_POOL.format(layers=describe(windows), pool=describe(self.pool.layer_windows)))
        if any(layer.is_initialized for layer in self.layers):
            raise ValueError("RocketKVCache.configure_layers needs a cache that has stored nothing yet")
        self.layer_windows, self.layer_chunked = windows, chunked
        self.num_layers = len(windows)
        self.layers = []
        return self

    @property
    def has_sliding_layers(self) -> bool:
        """Whether the model's config gave some layers a sliding window (``configure_layers``)."""
        return self.layer_windows is not None and any(w is not None for w in self.layer_windows)

    @property
    def has_dense_layers(self) -> bool:
        """``config.dense_layers`` > 0: the first layers keep and attend every token (``DenseLayer``)."""
        return self.config.dense_layers > 0

    def empty_like(self) -> "RocketKVCache":
        """A new, empty cache of the same kind and configuration (the stage-1 policy included): row-group prefill
        builds one per group. It has no pool of its own: a pool-backed cache hands each group its rows
        (``share_rows``)."""
        part = type(self)(self.config)
        part.copy_layer_kinds(self)
        return part

    def copy_layer_kinds(self, other: RocketKVCache) -> None:
        self.layer_windows, self.num_layers, self.layer_chunked = other.layer_windows, other.num_layers, \
            other.layer_chunked

    def share_rows(self, part: "RocketKVCache", rows: slice) -> None:
        """Row-group prefill: ``part`` (an ``empty_like()`` cache) prefills ``rows`` of this cache's admitted batch
        in this cache's pool pages."""
        if self.pages is None:
            return
        part.use_pages(self.pool, self.pages.split(rows, part.counters))

    def use_pages(self, pool: KVBlockPool, pages: PoolPages) -> None:
        """This (empty) cache's rows live in ``pages`` of ``pool`` (a row group's part, ``share_rows``)."""
        self.pool, self.pages = pool, pages
        self.layer_class_to_replicate = functools.partial(RocketKVLayer, self.config, self.hints, pages,
                                                          counters=self.counters)

    def _new_layer(self, layer_idx: int) -> RocketKVLayer | SlidingWindowLayer:
        windows = self.layer_windows
        if windows is not None:
            if layer_idx >= len(windows):
                raise ValueError(f"RocketKVCache: the model config it was configured with has {len(windows)} layers, "
                                 f"the model updates layer {layer_idx}")
            if windows[layer_idx] is not None:
                chunked = bool(self.layer_chunked and self.layer_chunked[layer_idx])
                # pool-backed: its decode ring in the rows' slots of the pool's slab (``pages``)
                return SlidingWindowLayer(windows[layer_idx], self.hints, layer_idx, chunked=chunked,
                                          backend=self.config.backend, pages=self.pages,
                                          flash_window=self.config.flash_window_prefill)
        config = layer_config(self.config, layer_idx, self.num_layers)
        if config is None:
            return DenseLayer(self.hints, layer_idx)
        # the first full-attention layer counts the tokens prefill computes (layer 0 may slide)
        counting = layer_idx == (windows.index(None) if windows is not None else 0)
        if config is not self.config:  # its share of a budget schedule
            make = self.layer_class_to_replicate
            return make.func(config, *make.args[1:], layer_idx=layer_idx, counts_tokens=counting, **make.keywords)
        return self.layer_class_to_replicate(layer_idx=layer_idx, counts_tokens=counting)

    def _ensure_layers(self, count: int) -> None:
        """Create layers up to ``count`` (each knows its index: a pool keeps one set of page tensors per layer)."""
        while len(self.layers) < count:
            self.layers.append(self._new_layer(len(self.layers)))

    # ------------------------------------------------------------------------------------------ prefill
    @contextlib.contextmanager
    def prefill(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                max_new_tokens: int | None = None, max_length: int | None = None, reservation=None,
                row_groups: int | None = None, columns: int | None = None):
        """One prefill on this cache (a first turn or a later one), with what every caller needs around its
        forwards, in order::

            with cache.prefill(ids, mask, max_new_tokens=n) as start:     # ``start``: input columns a prefix hit
                model(input_ids=ids[:, start:], ..., past_key_values=cache)  # put in the cache already
            # here stage 1 has run on every layer (after a chunked prefill too)

        Args:
            input_ids, attention_mask: the whole input of the turn ``[B, T]`` (None: no pool admission, e.g. a
                forward of embeddings; a pool then admits at the first stage 1, without prefix lookup).
            max_new_tokens: tokens the request will still generate (sizes a pool admission; default: from
                ``max_length``, else ``config.capacity_headroom``).
            max_length: logical tokens the cache will have seen at most, prompt included (generate()'s capacity
                hint ``hints.max_length``; None keeps the current hint).
            reservation: pool pages set aside for this request earlier (a scheduler's ``pool.reserve``), given
                back under the pool's lock right before the admission takes its pages, so nobody else can take them
                in between.
            row_groups: rows per forward of a row-group prefill (generate() picks them: ``config.prefill_batch_size``,
                or from the free memory when it is None): reserve the batch's pages now, admit each group when it
                starts. None: one forward.
            columns: the prompt's width when ``input_ids`` is not given (a row group's cache, admitted by the whole
                batch's): a chunked prefill writes its chunks into one buffer of this width (``dense_store``).

        With a pool, every page the forwards need is taken on entry, or ``PoolExhaustedError`` is raised before
        anything is written. While the block runs the cache reports itself not compileable (prefill shapes change
        with every prompt and chunk). On a clean exit stage 1 runs where it was deferred (chunked prefill).
        """
        if max_length is not None:
            self.hints.plan(max_length=max_length)
        with self.hints.prefill(input_ids.shape[1] if input_ids is not None else columns):
            if input_ids is not None and input_ids.shape[1] > 0:
                self._begin_with(reservation, input_ids, attention_mask, max_new_tokens, row_groups)
            yield self.get_seq_length()
        self.finish_prefill()

    def _begin_with(self, reservation, input_ids, attention_mask, max_new_tokens, row_groups) -> None:
        """``begin_prefill``, first handing ``reservation``'s pages back to the pool under its lock."""
        if reservation is None or self.pool is None:
            self.begin_prefill(input_ids, attention_mask, max_new_tokens=max_new_tokens, row_groups=row_groups)
            return
        with self.pool.exclusive():  # the pages set aside go to this admission and nobody else's
            self.pool.unreserve(reservation)
            self.begin_prefill(input_ids, attention_mask, max_new_tokens=max_new_tokens, row_groups=row_groups)

    # ------------------------------------------------------------------------------------------ pool requests
    def begin_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      max_new_tokens: int | None = None, row_groups: int | None = None) -> None:
        """Before a prefill forward (generate() calls this): with a pool, take every page the forward needs, or raise
        ``PoolExhaustedError`` naming the pages needed and free before anything is written; the first turn looks its
        prompt up in the prefix index and seeds the layers with the hit; with ``row_groups`` it reserves the batch's
        pages and each group is admitted (and looks up its prefix, so later groups reuse earlier ones') when it
        starts (``share_rows``); ``row_groups`` is the rows per group. Without a pool: nothing."""
        if self.pages is None:
            return
        if max_new_tokens is None:  # generate()'s max_length counts the input's columns (padding included)
            max_length = self.hints.max_length
            max_new_tokens = (max(0, max_length - input_ids.shape[1]) if max_length is not None
                              else self.config.capacity_headroom)
        layer0 = next((layer for layer in self.layers if isinstance(layer, RocketKVLayer)), None)
        self.pages.begin(input_ids, attention_mask, max_new_tokens, layer0,
                         allow_prefix_lookup=self._prefix_lookup_allowed(),
                         rows_per_group=row_groups)
        if row_groups is None:
            self.setup_prefix()

    def setup_prefix(self) -> int:
        """Seed the layers with the admitted prefix hit (first turn); returns the first input column the forwards must
        compute: the hit's input columns, or on a model with sliding-window layers where the replay that rebuilds
        their windows starts (``PoolPages.setup_prefix``); 0: none."""
        if self.pages is None:
            return 0
        self._ensure_layers(self.pages.model_layers)
        return self.pages.setup_prefix(self.layers)

    def _prefix_lookup_allowed(self) -> bool:
        """Policies that score with every prompt query (H2O) need every prompt token computed: no prefix hits. A
        pool of a model whose layers all slide has no pages: no prefix hits either (a hybrid model's hits replay
        the sliding layers' windows, ``PoolPages.setup_prefix``)."""
        if self.pool is not None and self.pool.has_sliding_layers and not self.pool.hybrid.global_layers:
            return False
        return not hasattr(RocketKVLayer(self.config, self.hints).policy, "accumulate")

    @property
    def stats(self) -> CacheStats:
        """What this request reused and computed so far (``cache/stats.py``)."""
        counters = self.counters
        held = self.pages.held_pages() if self.pages is not None else 0
        slots = self.pages.held_slots() if self.pages is not None else 0
        return CacheStats(counters.reused_tokens, counters.computed_tokens, counters.offloaded_bytes,
                          counters.onloaded_bytes, held, slots)

    def close(self) -> None:
        """Give this request's pool pages back now (they are also given back when the cache is reset or garbage
        collected). The cache is empty afterwards. Without a pool: drops the layers' buffers."""
        if self.pages is not None:
            self.pages.release_all()
        self.layers = []

    def __enter__(self) -> "RocketKVCache":
        return self

    def __exit__(self, *exc_info) -> None:
        """``with RocketKVCache(cfg, pool=pool) as cache:`` closes the cache (its pool pages go back) on the way out."""
        self.close()

    def reset(self) -> None:
        """Empty the cache for a new request (its pool pages go back)."""
        if self.pages is not None:
            self.pages.release_all()
        super().reset()

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Store ``layer_idx``'s new keys and values (see ``RocketKVLayer.update``).

        Also checks, before anything is written, that the module storing the first layer's keys runs the
        ``rocketkv`` attention (``other_attention``: a RocketKVCache on an sdpa model refuses at once, one layer or
        many, instead of running dense attention over its keys), that earlier keys were consumed by a ``rocketkv``
        attention call (the previous layer's in this forward and this layer's own from the previous forward: a caller
        that is no transformers module, and a forward that an exception interrupted between a layer's update and its
        attention), and that the keys have the batch the layer holds (``check_batch``: a ValueError).
        """
        if not (torch.compiler.is_compiling() or self.hints.in_graph):
            if layer_idx == 0 and RocketKVCache.other_attention is not None:
                check_attention(RocketKVCache.other_attention())
            self._check_consistent(layer_idx, key_states.shape[2])
            check_batch(self.layers, layer_idx, key_states.shape[0])
            self._ensure_layers(layer_idx + 1)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_consistent(self, layer_idx: int, query_length: int) -> None:
        """Raise if an earlier forward left this cache half-updated, or its keys were never consumed
        (``check_layers_consistent``)."""
        check_layers_consistent(self.layers, layer_idx, query_length)

    def hand_over(self) -> list:
        """Give up this request's pool holdings (block tables, sliding-window slots) to a new owner that releases
        them: continuous batching moves a prefilled request into a decoding row this way
        (``BatchedDecodeCache.join``). The cache is empty afterwards (as after ``close``, but nothing goes back to
        the pool). Needs a pool-backed cache whose prefill and stage 1 are done."""
        if self.pages is None:
            raise ValueError("RocketKVCache.hand_over needs a pool-backed cache (RocketKVCache(cfg, pool=pool))")
        if not self.is_compressed or self.get_seq_length() == 0:
            raise ValueError("RocketKVCache.hand_over needs a compressed cache (prefill and stage 1 done)")
        held = self.pages.hand_over()
        self.layers = []
        return held

    def preload_prefix(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store the dense keys and values of a prompt prefix computed elsewhere, one ``(K, V)`` pair
        ``[B, Hkv, L, D]`` per layer, in layer order. The rest of the prompt then runs through the model with this
        cache, and stage 1 runs over the whole prompt at the end of that forward, exactly as after a one-shot
        prefill (the eval prefills a shared prefix once for several methods this way). Only on an empty cache."""
        if self.get_seq_length() != 0:
            raise ValueError("preload_prefix needs an empty RocketKVCache")
        for layer_idx, (keys, values) in enumerate(kv):
            self._ensure_layers(layer_idx + 1)
            super().update(keys, values, layer_idx)
            self.layers[layer_idx].attention_ran()  # stored on purpose: no attention call consumes these

    def seq_length_tensor(self, layer_idx: int = 0) -> torch.Tensor:
        """Logical tokens seen, as a 0-d int64 tensor on the cache's device (no host sync).

        For hand-written decode loops: ``position_ids = cache.seq_length_tensor() + torch.arange(n)`` instead of
        ``cache.get_seq_length()``, which returns a Python int and therefore waits for the GPU at every step.
        """
        if layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized:
            return torch.zeros((), dtype=torch.long)
        return self.layers[layer_idx].seen

    def get_query_offset(self, layer_idx: int = 0):
        """Logical position of the next query, for transformers' mask code (called before every forward).

        Compressed layers ignore that mask, so they answer with the device counter itself (as StaticLayer does):
        ``get_seq_length()`` would turn it into a Python int, a host sync at every decode step.
        """
        if layer_idx < len(self.layers) and self.layers[layer_idx].compressed:
            return self.layers[layer_idx].seen
        return super().get_query_offset(layer_idx)

    def finish_prefill(self) -> None:
        """Run stage 1 on every layer still holding a full prompt.

        Only needed after chunked prefill (``hints.defer_compression``): generate() calls it once the last chunk is
        in; call it yourself when you feed a prompt in chunks through plain forwards with deferred compression.
        """
        for layer in self.layers:
            layer.finish_prefill()

    def adopt_row_groups(self, parts: list["RocketKVCache"]) -> None:
        """Take over the compressed layers of caches that each prefilled some rows, in row order (row-group
        prefill, ``RocketKVConfig.prefill_batch_size``). This cache must be empty."""
        if any(layer.is_initialized for layer in self.layers):
            raise ValueError("adopt_row_groups needs an empty RocketKVCache")
        self.layers = [
            type(parts[0].layers[i]).stack_rows([part.layers[i] for part in parts],
                                                functools.partial(self._new_layer, i))
            for i in range(len(parts[0].layers))
        ]
        for part in parts:
            self.counters.add_tokens(part.counters)
        if self.pages is not None:
            self.pages.adopt_parts()

    # ------------------------------------------------------------------------------------------ introspection
    def kept_tokens(self, layer_idx: int) -> torch.LongTensor:
        """Tokens physically stored per row and KV head in ``layer_idx``: LongTensor ``[batch, kv_heads]``."""
        if layer_idx >= len(self.layers):
            raise IndexError(f"layer {layer_idx} has no state yet ({len(self.layers)} layers initialised)")
        return self.layers[layer_idx].kept_tokens()

    def memory_bytes(self) -> int:
        """Bytes of every tensor the cache holds: K/V, KT page summaries, positions and lengths."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """Input column of every stored token, ``[batch, kv_heads, capacity]`` int32, -1 for empty slots."""
        layer = self.layers[layer_idx]
        if layer.is_sliding or getattr(layer, "is_dense", False):
            what = "a dense layer (dense_layers): it keeps every column" if not layer.is_sliding else (
                "a sliding-window layer: it keeps its last columns")
            raise ValueError(f"layer {layer_idx} is {what}, nothing is selected")
        if not layer.compressed:
            raise ValueError(f"layer {layer_idx} is not compressed yet (stage 1 runs at the end of prefill)")
        return layer.positions

    @property
    def is_compileable(self) -> bool:
        """generate() compiles decode steps for compileable caches (on CUDA, or with compile_config's
        ``_compile_all_devices``). It asks once before prefill (for decode) and again inside a chunked prefill (for
        the chunks): the answer is False only while generate()'s prefill runs, so chunks run eagerly (their shapes
        change every chunk) and decode is compiled after a chunked prefill too. Sliding-window layers decode into a
        ring of fixed size (``SlidingWindowLayer``), so hybrid models answer the same (their decode steps are
        captured as CUDA graphs or compiled with torch.compile, ``decode_runner``). A cache with
        dense layers (``dense_layers``) answers False: their stores grow at every step, so decode runs eagerly."""
        return not self.hints.prefilling and not self.has_dense_layers

    @property
    def is_compressed(self) -> bool:
        """Stage 1 has run on every RocketKV layer (sliding-window layers have no stage 1: a cache whose layers all
        slide counts as compressed once it has stored its prompt)."""
        rocket = [layer for layer in self.layers if isinstance(layer, RocketKVLayer)]
        if not rocket:
            return any(layer.is_initialized for layer in self.layers)
        return all(layer.compressed for layer in rocket)

    def crop(self, tokens_to_remove: int) -> None:
        """Undo the last ``-tokens_to_remove`` decode steps (see ``RocketKVLayer.crop``); anything else raises."""
        if tokens_to_remove > 0:
            raise NotImplementedError(CROP_UNSUPPORTED)
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def __deepcopy__(self, memo: dict) -> "RocketKVCache":
        """A copy that continues on its own (transformers' prompt-reuse recipe: prefill once, copy per question); its
        captured steps are captured again. A pool-backed cache refuses: its pages are the pool's."""
        if self.pages is not None:
            raise TypeError(POOL_COPY)
        return copy_with_owners(self, memo)

    def __repr__(self) -> str:
        return f"RocketKVCache(layers={len(self.layers)}, seen={self.get_seq_length()}, config={self.config})"


POOL_COPY = (
    "copy.deepcopy(RocketKVCache(pool=...)): a pool-backed cache's pages belong to the KVBlockPool and cannot be "
    "copied; to reuse a prompt prefix across requests, let the pool's prefix index share it (docs/pool-cache.md), or "
    "copy a cache without pool="
)

HYBRID_POOL = (
    "RocketKVCache(pool=...): the model's layers ({layers}) are not those the KVBlockPool was built for ({pool}); "
    "build the pool from this model (KVBlockPool(model))"
)


def _prefix_keys(pool, config: RocketKVConfig, cache_salt, prefix_keys):
    """Check a pool for a cache and build its prefix keys (one PrefixKeys, or one per row)."""
    import dataclasses

    if not isinstance(pool, KVBlockPool):
        raise TypeError(f"RocketKVCache(pool=...) takes a hf_rocketkv.KVBlockPool, got {type(pool).__name__}")
    pool.check_config(config)
    if config.token_budget is not None:
        raise NotImplementedError(
            f"RocketKVConfig.token_budget={config.token_budget} derives prompt_budget and page_size per request at the "
            f"end of prefill, but a pool admits the request's pages before prefill and fixes the KT page size: set "
            f"prompt_budget / topk / page_size / topr instead (token_budget=None) when using pool="
        )
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"RocketKVCache.cache_salt must be a string or None, got {type(cache_salt).__name__}")

    def with_salt(keys):
        if keys is None:
            return PrefixKeys(cache_salt=cache_salt)
        if not isinstance(keys, PrefixKeys):
            raise ValueError(f"RocketKVCache.prefix_keys must be a PrefixKeys or a list of them, got {keys!r}")
        return dataclasses.replace(keys, cache_salt=cache_salt) if cache_salt is not None else keys

    if isinstance(prefix_keys, (list, tuple)):
        return [with_salt(keys) for keys in prefix_keys]
    return with_salt(prefix_keys)
