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

The package's ground floor: it owns the names its fields accept and the page arithmetic it validates with, and
policies/ imports them from here (never the other way). Every field is described in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .policies.decode_compression import DecodeCompression

KT_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
BACKENDS = ("auto", "torch", "triton")
DECODE_GUARD_CHECKS = ("first_step", "every_step")
DECODE_RUNNERS = ("cuda_graphs", "torch_compile")
MULTI_TURN_MODES = ("evict", "keep_all")
# Bucket fields (tuples; a YAML/JSON list is turned into one): None picks the runner's default below.
BUCKET_FIELDS = ("capacity_buckets", "batch_buckets")
# decode_runner="torch_compile" with batch_buckets=None: the batch sizes serving engines capture CUDA graphs for
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# requests larger than the largest capacity bucket: slots per row are rounded up to the ladder 256, 384, 512, 768,
# 1024, 1536, ... (powers of two and 1.5x powers of two), so such a store is at most 1.5x what the request needs
CAPACITY_LADDER_START = 256
YAML_SECTION = "sparse_attention_config"
YAML_ALGORITHM = "rocket"
# stage1 by name (a policy object is accepted too); policies/registry.py builds the policy of each name
STAGE1_POLICY_NAMES = ("snapkv", "streaming", "knorm", "h2o", "adakv", "random")
# stage2: "kt_pages" (RocketKV's page top-k) or "none" (every kept token attended: stage 1 only)
STAGE2_NAMES = ("kt_pages", "none")
# how a query head scores a KT page: "group_sign" (RocketKV, TensorRT-LLM: the group-summed query's sign picks Kmax
# or Kmin per channel) or "head_bound" (each head by its own sign: Quest's bound of its largest logit on the page)
STAGE2_SCORES = ("group_sign", "head_bound")


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


@dataclass(frozen=True)
class RocketKVConfig:
    """RocketKV settings (TensorRT-LLM ``RocketSparseAttentionConfig`` fields and defaults, plus our own).

    Immutable (a frozen dataclass): a cache keeps the config it was given, so change one with
    ``config.replace(field=value)``, which validates the copy.

    Stage 1 (after prefill, permanent eviction, per layer and KV head):
        window_size:   the last ``window_size`` prompt queries score the prefix; the last ``window_size``
                       prompt tokens are always kept.
        kernel_size:   odd width of the max-pooling over the group-summed window scores (stride 1).
        prompt_budget: prompt tokens kept per KV head. Prompts of at most ``prompt_budget`` tokens are kept whole.

    Stage 2 (every decode step, per layer and KV head):
        topk:          KT pages attended per KV head (all pages when there are fewer). The page that holds the
                       newest token is always one of them.
        topr:          query channels used to score pages (top by |q| summed over the GQA group);
                       ``topr >= head_dim`` means all channels.
        page_size:     tokens per KT page (power of two).
        kt_cache_dtype: dtype of the per-page min/max key summaries ("float8_e5m2", "bfloat16", "float16",
                       "float32"). As in TensorRT-LLM, the query is cast to this dtype for scoring.

    hf_rocketkv's own:
        backend:       "auto" (Triton on CUDA, PyTorch elsewhere), "torch" (reference path, any device) or
                       "triton" (CUDA, or CPU under TRITON_INTERPRET=1).
        capacity_headroom: tokens preallocated per layer for decode beyond the kept prompt when generate() does
                       not say how many new tokens to expect; the store grows by this much whenever it fills up
                       (eager mode). Multiple of ``page_size`` after rounding up.
        prefill_batch_size: rows per prefill forward in generate() (None: the whole batch in one forward, as
                       transformers does). Each group of rows is prefilled and compressed by stage 1 before the
                       next one starts, so prefill activations and the full-prompt K/V scale with this, not with
                       the batch; the groups' compressed caches are then stacked for a batched decode.
        decode_guard_checks: "every_step" (torch.compile's default) or "first_step" (the guards run on the first
                       compiled decode step of each generate() call; later steps only tell apart compiled graphs,
                       saving ~0.5 ms of CPU per token on an 8B model). torch's stance switch is process-global, so
                       "first_step" serialises compiled RocketKV steps across threads and, while one runs, compiled
                       code of other threads skips its guards too: use it only where one generate() runs at a time.
        decode_runner: how generate() runs the decode steps it would compile (CUDA; or CPU with compile_config's
                       ``_compile_all_devices``): "cuda_graphs" captures each request's eager decode step as a CUDA
                       graph on its second step and replays it (no torch.compile: no cold-start compile, no
                       recompiles for new prompt lengths, batch sizes or max_new_tokens, no guards per step);
                       "torch_compile" is transformers' torch.compile of the whole forward.
        deferred_stop_check: on CUDA, let generate() read its "all sequences finished" flag one step late
                       (transformers' DeferredStopCheck, which it enables on MPS only), so the next decode step is
                       queued while the current one runs instead of the GPU idling during generate()'s host work.
                       Same tokens; one extra forward, undone, when generation stops on EOS.
        eager_layer_graphs: on CUDA, a decode step that runs eagerly (generate(disable_compile=True), a model
                       called directly; not the compiled or whole-step-graph runners) replays each layer's RocketKV
                       launches (the append; page scores, selection and sparse attention) as two small CUDA graphs
                       captured on the second step (``cache/op_graphs.py``): the same launches on the same buffers,
                       bit for bit, at a fraction of the host time. Not with multi_turn="keep_all" or decode_budget.
        fused_rope:    on CUDA, a bf16/fp16 decode step inside a RocketKV call applies the rotary embedding to the
                       new query and key in one launch instead of transformers' ten (``integration/rope.py``), bit
                       for bit the same values; prefill, fp32, torch.compile'd forwards and models whose
                       ``apply_rotary_pos_emb`` takes other parameters keep transformers' function.
        capacity_buckets: decode slots per row after stage 1 are rounded up to the smallest of these sizes that
                       holds the kept prompt + max_new_tokens (then to whole pages), so a compiled decode step sees
                       the same shapes for every prompt length and max_new_tokens within a bucket: one bucket
                       (e.g. ``(4096,)``) is one configured maximum, one graph. A request needing more than the
                       largest bucket gets the next size of the ladder 256, 384, 512, 768, 1024, ... (one more
                       graph). ``()``: exact sizes. None: the runner's default, exact for "cuda_graphs" (it captures
                       per request), ``(prompt_budget + capacity_headroom,)`` for "torch_compile". Memory: the padded
                       slots are allocated (K, V, KT, positions) by a store of its own; with a pool only the block
                       table widens (docs/configuration.md).
        batch_buckets: generate() pads a fresh request's batch with copies of its first row up to the smallest of
                       these sizes that holds it, and strips them from the output and the cache, so a compiled
                       decode step compiles once per bucket, not per batch size. Prefill runs the real rows only.
                       ``()``: no padding. None: the runner's default, none for "cuda_graphs" (no compile to save),
                       (1, 2, 4, 8, 16, 32, 64, 128) for "torch_compile". Larger batches run unpadded.

    Policies (docs/policies.md):
        stage1:        which prompt tokens stage 1 keeps: "snapkv" (RocketKV's, the default), "streaming" (sinks +
                       recent), "knorm" (low key norm), "h2o" (attention accumulated over every prompt query), "adakv"
                       (head-adaptive budgets: the same total per row, allotted across KV heads; not with a pool, and
                       a later turn needs multi_turn="keep_all"), "random", or a
                       policy object (``hf_rocketkv.policies``; Python only: YAML holds names).
        sink_tokens:   tokens at the start of each row that stage1="streaming" always keeps.
    Multi-turn (docs/memory.md):
        multi_turn:    "evict" (default): a later turn re-runs stage 1 over the tokens kept so far plus the new ones,
                       so what an earlier stage 1 evicted is gone for good. "keep_all" (RocketKV-MT): the cache also
                       keeps every token of the conversation (prompt, generated tokens, later turns) in pages (the
                       pool's with ``RocketKVCache(cfg, pool=pool)``), and each later turn re-runs stage 1 over all of
                       it with that turn's window, so a fact evicted for one question can come back for the next.

        token_budget:  the paper's single knob (arXiv 2502.14051 §3.6): K+V token pairs read per KV head per decode
                       step. When set, prompt_budget, topk, page_size and topr are derived per request from the
                       prompt length at the end of prefill (``policies.token_budget.derive_budgets``) and the values
                       given for them are ignored. None: use them as given.

    Stage-2 options (docs/policies.md, "Stage 2: sinks and a recent window"):
        stage2:        "kt_pages" (RocketKV's page top-k, the default) or "none" (attend every kept token: stage 1
                       only, no page selection).
        stage2_sink_tokens: the first s tokens are attended at every decode step: the first ceil(s / page_size)
                       pages of the compacted store are forced into the top-k (counted in it), and stage 1 keeps
                       the prompt's first s tokens so that those pages hold them. 0: none forced.
        stage2_recent_tokens: the newest r tokens are attended at every decode step: the newest 1 + ceil(r /
                       page_size) pages (the newest page always; 0 gives RocketKV's rule) are forced into the top-k.
                       Forced sink + recent pages must fit in ``topk`` (checked here; in token-budget mode, where
                       topk is derived per request, the recent pages are kept first and the sinks get what is left).
        stage2_score:  how a query head scores a page from its min/max keys: "group_sign" (RocketKV and
                       TensorRT-LLM, the default: the sign of the group-summed query picks Kmax or Kmin per channel
                       for every head of the group) or "head_bound" (each head by its own sign, Quest's upper
                       bound of the head's largest logit on the page; the same with one query head per KV head).

    Decode-time compression (docs/policies.md, "Decode-time compression"): bounds the generated tokens a layer stores,
    so a long answer does not grow the cache without bound.
        decode_budget: None (off, the default): every generated token is stored. An integer M: when M +
                       decode_interval generated tokens are stored, each layer re-scores its generated tokens with its
                       last decode_window decode queries and keeps M of them per KV head (the newest decode_window
                       plus the best-scoring others); prompt tokens kept by stage 1 are never touched. A layer's
                       store then holds at most prompt_budget + decode_budget + decode_interval tokens, whatever
                       max_new_tokens is. Works with both decode runners (the compaction runs between two
                       compiled / graphed steps, on the host side) and with a pool; not with multi_turn="keep_all".
        decode_interval: generated tokens added between two compressions (>= 1).
        decode_window: decode queries that score, and newest generated tokens always kept (1 .. decode_budget).
        decode_kernel_size: odd width of the max-pooling over the generated tokens' scores (1: none).
    """

    window_size: int = 32
    kernel_size: int = 63
    prompt_budget: int = 2048
    topk: int = 64
    topr: int = 128
    page_size: int = 4
    kt_cache_dtype: str = "float8_e5m2"
    backend: str = "auto"
    capacity_headroom: int = field(default=256)
    prefill_batch_size: int | None = None
    decode_guard_checks: str = "every_step"
    decode_runner: str = "cuda_graphs"
    deferred_stop_check: bool = True
    eager_layer_graphs: bool = True
    fused_rope: bool = True
    capacity_buckets: tuple[int, ...] | None = None  # validated in _validate_buckets
    batch_buckets: tuple[int, ...] | None = None
    # policies (validated in _validate_policy_fields)
    stage1: Any = "snapkv"  # a name from STAGE1_POLICY_NAMES or a policy object
    sink_tokens: int = 4
    token_budget: int | None = None
    # stage-2 options (validated in _validate_stage2_fields)
    stage2: str = "kt_pages"
    stage2_sink_tokens: int = 0
    stage2_recent_tokens: int = 0
    stage2_score: str = "group_sign"
    # multi-turn (validated in _validate_multi_turn)
    multi_turn: str = "evict"
    # decode-time compression (validated in _validate_decode_compression)
    decode_budget: int | None = None
    decode_interval: int = 64
    decode_window: int = 32
    decode_kernel_size: int = 7

    def __post_init__(self) -> None:
        for name in BUCKET_FIELDS:  # YAML and JSON (model.config.rocketkv) hold lists; the frozen config a tuple
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    # ------------------------------------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, the value and what is allowed."""
        for name in ("window_size", "kernel_size", "prompt_budget", "topk", "topr", "page_size", "capacity_headroom"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"RocketKVConfig.{name} must be an integer, got {value!r} ({type(value).__name__})")
        if self.window_size < 1:
            raise ValueError(f"RocketKVConfig.window_size must be >= 1, got {self.window_size}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(
                f"RocketKVConfig.kernel_size must be an odd integer >= 1 (max-pooling keeps the length), "
                f"got {self.kernel_size}"
            )
        if self.prompt_budget < self.window_size:
            raise ValueError(
                f"RocketKVConfig.prompt_budget must be >= window_size ({self.window_size}): the observation window "
                f"is always kept; got prompt_budget={self.prompt_budget}"
            )
        if self.topk < 1:
            raise ValueError(f"RocketKVConfig.topk (pages per KV head) must be >= 1, got {self.topk}")
        if self.topr < 1:
            raise ValueError(f"RocketKVConfig.topr (query channels) must be >= 1, got {self.topr}")
        if not _is_power_of_two(self.page_size):
            raise ValueError(f"RocketKVConfig.page_size must be a power of 2 (1, 2, 4, 8, ...), got {self.page_size}")
        if self.kt_cache_dtype not in KT_CACHE_DTYPES:
            raise ValueError(
                f"RocketKVConfig.kt_cache_dtype must be one of {sorted(KT_CACHE_DTYPES)}, got {self.kt_cache_dtype!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"RocketKVConfig.backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.capacity_headroom < 1:
            raise ValueError(f"RocketKVConfig.capacity_headroom must be >= 1, got {self.capacity_headroom}")
        if self.decode_guard_checks not in DECODE_GUARD_CHECKS:
            raise ValueError(
                f"RocketKVConfig.decode_guard_checks must be one of {list(DECODE_GUARD_CHECKS)}, "
                f"got {self.decode_guard_checks!r}"
            )
        if self.decode_runner not in DECODE_RUNNERS:
            raise ValueError(
                f"RocketKVConfig.decode_runner must be one of {list(DECODE_RUNNERS)}, got {self.decode_runner!r}"
            )
        for name in ("deferred_stop_check", "eager_layer_graphs", "fused_rope"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RocketKVConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.prefill_batch_size is not None and (not _is_int(self.prefill_batch_size) or self.prefill_batch_size < 1):
            raise ValueError(
                f"RocketKVConfig.prefill_batch_size must be None (whole batch) or an integer >= 1, "
                f"got {self.prefill_batch_size!r}"
            )
        self._validate_policy_fields()
        self._validate_stage2_fields()
        self._validate_multi_turn()
        self._validate_buckets()
        self._validate_decode_compression()

    def _validate_buckets(self) -> None:
        """capacity_buckets, batch_buckets: None, or a strictly ascending tuple of integers >= 1 (may be empty)."""
        for name in BUCKET_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            allowed = (
                f"None (the decode runner's default) or a strictly ascending tuple of integers >= 1, e.g. "
                f"{DEFAULT_BATCH_BUCKETS if name == 'batch_buckets' else (2048, 4096)} (() turns it off)"
            )
            if not isinstance(value, tuple) or not all(_is_int(v) for v in value):
                raise ValueError(f"RocketKVConfig.{name} must be {allowed}, got {value!r}")
            if any(v < 1 for v in value) or any(a >= b for a, b in zip(value, value[1:])):
                raise ValueError(f"RocketKVConfig.{name} must be {allowed}, got {value!r}")

    def _validate_multi_turn(self) -> None:
        """multi_turn (a block of its own: keep_all multi-turn)."""
        if self.multi_turn not in MULTI_TURN_MODES:
            raise ValueError(
                f"RocketKVConfig.multi_turn must be one of {list(MULTI_TURN_MODES)} (\"evict\": later turns re-run "
                f"stage 1 over the kept tokens; \"keep_all\": over the whole conversation), got {self.multi_turn!r}"
            )

    def _validate_decode_compression(self) -> None:
        """decode_budget, decode_interval, decode_window, decode_kernel_size (decode-time compression's block)."""
        for name in ("decode_budget", "decode_interval", "decode_window", "decode_kernel_size"):
            value = getattr(self, name)
            if name == "decode_budget" and value is None:
                continue
            if not _is_int(value) or value < 1:
                what = "None (off) or an integer >= 1" if name == "decode_budget" else "an integer >= 1"
                raise ValueError(f"RocketKVConfig.{name} must be {what}, got {value!r}")
        if self.decode_budget is None:
            return
        if self.decode_window > self.decode_budget:
            raise ValueError(
                f"RocketKVConfig.decode_window ({self.decode_window}) must be <= decode_budget ({self.decode_budget}): "
                f"the newest decode_window generated tokens are always kept"
            )
        if self.decode_kernel_size % 2 == 0:
            raise ValueError(
                f"RocketKVConfig.decode_kernel_size must be odd (same-length max-pooling), got {self.decode_kernel_size}"
            )
        if self.multi_turn == "keep_all":
            raise ValueError(
                f"RocketKVConfig.decode_budget={self.decode_budget} bounds the generated tokens a layer stores, but "
                f"multi_turn='keep_all' keeps every token of the conversation: the two do not combine. Use "
                f"multi_turn='evict' with decode_budget, or decode_budget=None with keep_all."
            )

    def _validate_policy_fields(self) -> None:
        """stage1, sink_tokens, token_budget (a block of its own: the policy framework's fields)."""
        if isinstance(self.stage1, str):
            if self.stage1 not in STAGE1_POLICY_NAMES:
                raise ValueError(
                    f"RocketKVConfig.stage1 must be one of {list(STAGE1_POLICY_NAMES)} or a policy object, "
                    f"got {self.stage1!r}"
                )
        elif not is_stage1_policy(self.stage1):
            raise ValueError(
                f"RocketKVConfig.stage1 must be one of {list(STAGE1_POLICY_NAMES)} or a policy object with a `name` "
                f"and a select(inputs) method (hf_rocketkv.policies), got {type(self.stage1).__name__}"
            )
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(f"RocketKVConfig.sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        if self.token_budget is not None and (not _is_int(self.token_budget) or self.token_budget < 2):
            raise ValueError(
                f"RocketKVConfig.token_budget must be None (budgets as given) or an integer >= 2 (K+V pairs read per "
                f"KV head per decode step, half for page scoring, half for exact attention), got {self.token_budget!r}"
            )

    def _validate_stage2_fields(self) -> None:
        """stage2, stage2_sink_tokens, stage2_recent_tokens (the stage-2 options' block)."""
        if self.stage2 not in STAGE2_NAMES:
            raise ValueError(f"RocketKVConfig.stage2 must be one of {list(STAGE2_NAMES)}, got {self.stage2!r}")
        if self.stage2_score not in STAGE2_SCORES:
            raise ValueError(
                f"RocketKVConfig.stage2_score must be one of {list(STAGE2_SCORES)}, got {self.stage2_score!r}"
            )
        for name in ("stage2_sink_tokens", "stage2_recent_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"RocketKVConfig.{name} must be an integer >= 0, got {value!r}")
        if self.stage2 != "kt_pages" or self.token_budget is not None:
            return  # no page selection, or topk and page_size are derived per request (then fit_forced_pages)
        sink, recent = forced_page_counts(self.stage2_sink_tokens, self.stage2_recent_tokens, self.page_size)
        if sink + recent > self.topk:
            raise ValueError(
                f"RocketKVConfig: the forced stage-2 pages must fit in topk={self.topk}: stage2_sink_tokens="
                f"{self.stage2_sink_tokens} -> {sink} page(s) + stage2_recent_tokens={self.stage2_recent_tokens} -> "
                f"{recent} page(s) (the newest page + ceil(r / page_size={self.page_size})) = {sink + recent}; lower "
                f"them or raise topk"
            )

    # ------------------------------------------------------------------------------------------------ derived
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

    @property
    def decode_compression(self) -> DecodeCompression | None:
        """The decode-time compression settings (``policies.decode_compression``), None when decode_budget is None."""
        if self.decode_budget is None:
            return None
        return DecodeCompression(self.decode_budget, self.decode_interval, self.decode_window, self.decode_kernel_size)

    def decode_headroom(self, new_tokens: int) -> int:
        """Slots to reserve beyond the kept prompt for ``new_tokens`` generated tokens: all of them, or at most
        ``decode_budget + decode_interval`` with decode-time compression (independent of max_new_tokens)."""
        compression = self.decode_compression
        return new_tokens if compression is None else min(new_tokens, compression.max_generated)

    @property
    def kt_torch_dtype(self) -> torch.dtype:
        return KT_CACHE_DTYPES[self.kt_cache_dtype]

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

    def bucket_capacity(self, needed: int, page_size: int) -> int:
        """Slots per row for a store that must hold ``needed``: the smallest capacity bucket >= needed; above the
        largest, the ladder 256, 384, 512, 768, 1024, ... (so even those requests share graphs); ``needed`` itself
        when bucketing is off. Then whole pages of ``page_size``. A compiled decode step sees the same shapes for
        every request of one bucket."""
        needed = max(needed, 1)
        buckets = self.effective_capacity_buckets
        bucket = needed
        if buckets:
            bucket = next((size for size in buckets if size >= needed), None) or _ladder_bucket(needed)
        return -(-bucket // page_size) * page_size

    def replace(self, **changes: Any) -> "RocketKVConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------------ dict / YAML
    def to_dict(self) -> dict[str, Any]:
        # not dataclasses.asdict: it would turn a policy object in `stage1` into a dict of its fields; bucket
        # tuples as lists, which YAML (safe_dump) and JSON (model.config.rocketkv) hold
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in BUCKET_FIELDS:
            if data[name] is not None:
                data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RocketKVConfig":
        """Build from a flat dict of fields, or from ``{"sparse_attention_config": {...}}``; unknown keys raise."""
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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in {YAML_SECTION}{_suggestions(unknown, known)}; "
                             f"allowed: {sorted(known)}")
        return cls(**data)

    def to_yaml_dict(self) -> dict[str, Any]:
        if not isinstance(self.stage1, str):
            raise ValueError(
                f"RocketKVConfig.stage1 is a policy object ({type(self.stage1).__name__}); YAML holds policy names "
                f"only, one of {list(STAGE1_POLICY_NAMES)}. Keep the object in Python, or use a name."
            )
        return {YAML_SECTION: {"algorithm": YAML_ALGORITHM, **self.to_dict()}}

    @classmethod
    def from_yaml(cls, path_or_text: str | Path) -> "RocketKVConfig":
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


def _ladder_bucket(needed: int) -> int:
    """The smallest of 256, 384, 512, 768, 1024, 1536, ... (2^k and 3 * 2^(k-1)) that is >= ``needed``."""
    size = CAPACITY_LADDER_START
    while size < needed:
        half_step = size * 3 // 2
        if half_step >= needed:
            return half_step
        size *= 2
    return size


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
