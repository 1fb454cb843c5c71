"""Causal attention of a dense (prefill) forward whose queries are the last of its keys, on CUDA in 16-bit.

Query j of ``Lq`` sees keys ``<= Lk - Lq + j`` of ``Lk``: a whole prompt (``Lq == Lk``), a chunk of a chunked
prefill or a prefix hit's new tokens (the keys before them come from the cache). Two backends:

* cuDNN's fused attention (about twice flash's speed on an H100: an 8k chunk after 8k keys in 2.5 ms per layer
  against 4.9), which takes no mask or an upper-left causal one: the queries attend to the ``P = Lk - Lq`` keys
  before them (no mask) and to their own ``Lq`` keys (causal, square) in two calls that return each row's
  log-sum-exp, merged by ``kernels/merge_attention`` (a whole prompt: one call). cuDNN builds an execution graph for
  every new shape it sees, ~70 ms each on an H100 (~140 ms for the two of a split), the first time in the process:
  one per prompt length would cost more than the kernel saves on a prompt of any length. So the queries (and their
  own keys) are padded with zeros to a multiple of ``CUDNN_QUERY_BUCKET`` (the padding sits after every real key:
  causal, no real query sees it; its rows are dropped), and the split runs only where ``P`` is a multiple of it too
  and the queries are at least ``MIN_SPLIT_QUERIES`` (a chunk of a chunked prefill at the default chunk sizes; a
  prefix hit's few new tokens stay on flash, which is as fast there): a bounded set of graphs per process. cuDNN
  keys a graph by its inputs' strides as well as their shapes, and a chunk's keys are views of a buffer as wide as
  its prompt, so every input is handed over in one layout, that of a fresh ``[B, L, H, D]`` tensor (``in_bucket``;
  the keys before a chunk copied, ~1% of the chunk's attention): the graphs depend on the bucket and ``P`` alone,
  not on the prompt's length. Head dims above ``CUDNN_MAX_HEAD_DIM`` (Gemma's 256) stay on flash too: measured and
  tested at 64 and 128 only.
* ``warm_cudnn_graphs`` builds the graphs of every shape a prompt of up to N tokens meets in chunks of C
  (``cudnn_shapes``) ahead of time, on the thread that will prefill: cuDNN's graph cache belongs to a thread.
* PyTorch's flash attention in its lower-right causal mode everywhere else (``flash_attention_runs``).

Shapes: query ``[B, Hq, Lq, D]``, key / value ``[B, Hkv, Lk, D]`` (grouped-query heads: query head h reads KV head
``h // (Hq / Hkv)``); returns ``[B, Lq, Hq, D]`` contiguous, what the attention module reshapes next.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from ..kernels.merge_attention import MERGE_DTYPES, merge_attention_triton
from ..selection.logit_features import with_sinks

CUDNN_QUERY_BUCKET = 512  # queries padded to a multiple of this for cuDNN (a bounded set of graphs per process)
MIN_SPLIT_QUERIES = 1024  # fewer queries after earlier keys (a prefix hit's new tokens): flash, already fast there
CUDNN_MAX_HEAD_DIM = 128  # the head dims measured and tested on an H100 (64, 128); wider heads (Gemma's 256): flash

# PyTorch's cuDNN attention op, which returns each row's log-sum-exp (F.scaled_dot_product_attention does not)
_CUDNN_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)


def causal_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scaling: float) -> torch.Tensor:
    """Lower-right causal attention (module docstring): cuDNN in bucketed shapes where it runs, else flash."""
    prefix = key.shape[2] - query.shape[2]
    if cudnn_runs(query, key, value, prefix):
        return cudnn_causal_attention(query, key, value, scaling, prefix)
    bias = causal_lower_right(query.shape[2], key.shape[2])
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def cudnn_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                           prefix: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The cuDNN path (``cudnn_runs`` must hold): queries and their own keys padded to the bucket, the keys before
    them attended without a mask, the two merged by log-sum-exp. With ``sinks`` (``[Hq]`` logits, gpt-oss' learned
    sinks) each row then keeps the share of its softmax that falls on real keys (``with_sinks``): the sink is one
    more key with a zero value, so the row is the attention over the keys merged with a zero partial whose
    log-sum-exp is the sink."""
    n = query.shape[2]
    padded = query_bucket(n)
    query, own_key, own_value = (in_bucket(t, padded) for t in (query, key[:, :, prefix:], value[:, :, prefix:]))
    merging = prefix > 0
    lse_needed = merging or sinks is not None
    own = _CUDNN_ATTENTION(query, own_key, own_value, None, lse_needed, 0.0, True, False, scale=scaling)
    out, lse = own[0][:, :, :n], (own[1][:, :, :n] if lse_needed else None)
    if merging:
        before = _CUDNN_ATTENTION(query, in_bucket(key[:, :, :prefix], prefix),
                                  in_bucket(value[:, :, :prefix], prefix), None, True, 0.0, False, False,
                                  scale=scaling)
        before_out, before_lse = before[0][:, :, :n], before[1][:, :, :n]
        out = merge_attention_triton(before_out, before_lse, out, lse)
        if sinks is None:
            return out
        return with_sinks(out, torch.logaddexp(before_lse.float(), lse.float()), sinks)
    out = out.transpose(1, 2)
    return out.contiguous() if sinks is None else with_sinks(out, lse, sinks)


def in_bucket(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` [B, H, L, D] (L <= ``length``) as cuDNN should read it: ``length`` rows, zeros after its own, in the
    layout of a fresh [B, length, H, D] tensor (the projections' layout). ``x`` itself when it is already that (a
    whole prompt of a bucket's length), else a copy: cuDNN would build another graph for other strides."""
    batch, heads, rows, dim = x.shape
    if rows == length and x.stride() == (length * heads * dim, dim, heads * dim, 1):
        return x
    out = (x.new_empty if rows == length else x.new_zeros)((batch, length, heads, dim)).transpose(1, 2)
    out[:, :, :rows] = x
    return out


def query_bucket(queries: int) -> int:
    """The query count cuDNN runs for ``queries`` queries: the next multiple of ``CUDNN_QUERY_BUCKET``."""
    return -(-queries // CUDNN_QUERY_BUCKET) * CUDNN_QUERY_BUCKET


def cudnn_takes_chunk(prefix: int, queries: int) -> bool:
    """Whether a chunk of ``queries`` queries after ``prefix`` earlier keys may run in cuDNN (the shape rule alone;
    ``cudnn_runs`` adds the device, dtype and head checks): a first chunk always, a later one after a multiple of
    the bucket with at least ``MIN_SPLIT_QUERIES`` queries."""
    return prefix == 0 or (prefix > 0 and prefix % CUDNN_QUERY_BUCKET == 0 and queries >= MIN_SPLIT_QUERIES)


def cudnn_shapes(chunk_tokens: int, prompt_tokens: int) -> list[tuple[int, int]]:
    """``(queries, keys before them)`` of every cuDNN graph that prompts of at most ``prompt_tokens`` tokens meet
    when prefilled in chunks of ``chunk_tokens``, queries in buckets: a whole prompt (or a first chunk) in every
    bucket up to the chunk, then a later chunk of at least ``MIN_SPLIT_QUERIES`` queries after each multiple of the
    chunk that is a multiple of the bucket (a split: two graphs)."""
    def buckets(low: int, high: int) -> range:
        return range(low, query_bucket(high) + 1, CUDNN_QUERY_BUCKET)

    shapes = [(b, 0) for b in buckets(CUDNN_QUERY_BUCKET, min(chunk_tokens, prompt_tokens))]
    for prefix in range(chunk_tokens, prompt_tokens, chunk_tokens):
        if cudnn_takes_chunk(prefix, prompt_tokens - prefix):
            shapes += [(b, prefix) for b in buckets(MIN_SPLIT_QUERIES, min(chunk_tokens, prompt_tokens - prefix))]
    return shapes


def cudnn_shapes_of_prompt(prompt_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``(queries, keys before them)`` of the cuDNN graphs that one prompt of ``prompt_tokens`` tokens meets when
    prefilled from its start in chunks of ``chunk_tokens`` (those of ``cudnn_shapes(chunk_tokens, prompt_tokens)``
    that this length reaches): its first chunk in its bucket, then each later chunk of at least
    ``MIN_SPLIT_QUERIES`` queries after a multiple of the bucket."""
    shapes = []
    for prefix in range(0, prompt_tokens, chunk_tokens):
        queries = min(chunk_tokens, prompt_tokens - prefix)
        if cudnn_takes_chunk(prefix, queries):
            shapes.append((query_bucket(queries), prefix))
    return shapes


def prefill_attention_kind(model) -> str | None:
    """How ``model``'s full-attention layers reach this module in a prefill: ``"plain"`` (neither soft-capped logits
    nor sinks), ``"sinks"`` (gpt-oss' learned sinks, no cap: ``cudnn_causal_attention`` with each row's log-sum-exp,
    integration/attention.py's ``dense_attention``), or None (Gemma 2's ``attn_logit_softcapping``: they take
    ``featured_attention`` instead)."""
    if getattr(model.config.get_text_config(), "attn_logit_softcapping", None) is not None:
        return None
    sinks = any(isinstance(getattr(module, "sinks", None), torch.Tensor) for module in model.modules())
    return "sinks" if sinks else "plain"


def warm_cudnn_graphs(shapes: list[tuple[int, int]], query_heads: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device, sinks: bool = False) -> int:
    """Run ``cudnn_causal_attention`` once on inputs of each ``(queries, keys before them)`` shape (batch 1, the
    engine's prefill), so that cuDNN builds their graphs now (~70 ms each on an H100) instead of at a request's
    prefill. On the thread that will prefill: cuDNN keeps a graph cache per thread. ``sinks``: as a model with sinks
    runs it (each row's log-sum-exp asked for: other graphs). Returns the shapes run: 0 where cuDNN does not (CPU,
    float32, a head dim above ``CUDNN_MAX_HEAD_DIM``)."""
    sink_logits = torch.zeros(query_heads, dtype=dtype, device=device) if sinks else None
    ran = 0
    for queries, prefix in shapes:
        # (values never read back: only the shapes and layouts matter to the graph)
        query = torch.empty((1, queries, query_heads, head_dim), dtype=dtype, device=device).transpose(1, 2)
        key = torch.empty((1, prefix + queries, kv_heads, head_dim), dtype=dtype, device=device).transpose(1, 2)
        if not cudnn_runs(query, key, key, prefix):
            continue
        cudnn_causal_attention(query, key, key, head_dim ** -0.5, prefix, sink_logits)
        ran += 1
    return ran


def cudnn_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int) -> bool:
    """Whether ``cudnn_causal_attention`` runs this call: CUDA, 16-bit, a head dim of at most ``CUDNN_MAX_HEAD_DIM``,
    no keys before the queries or a multiple of the bucket before at least ``MIN_SPLIT_QUERIES`` queries, and cuDNN
    taking both parts (grouped-query heads and the rest; checked by PyTorch itself, no sync)."""
    if (query.device.type != "cuda" or _CUDNN_ATTENTION is None or query.dtype not in MERGE_DTYPES
            or query.shape[-1] > CUDNN_MAX_HEAD_DIM or not cudnn_takes_chunk(prefix, query.shape[2])):
        return False
    gqa = query.shape[1] != key.shape[1]
    own = SDPAParams(query, key[:, :, prefix:], value[:, :, prefix:], None, 0.0, True, gqa)
    if not can_use_cudnn_attention(own):
        return False
    return prefix == 0 or can_use_cudnn_attention(
        SDPAParams(query, key[:, :, :prefix], value[:, :, :prefix], None, 0.0, False, gqa))


def flash_attention_runs(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether PyTorch's flash attention kernel takes these possibly grouped-query inputs (CUDA, half precision, a
    supported head dim; checked by PyTorch itself, no sync)."""
    if query.device.type != "cuda":
        return False
    # is_causal=False, as torch.nn.attention.bias asks before its lower-right flash call: the causal flag of the
    # check means upper-left, which flash refuses for Lq != Lk
    params = SDPAParams(query, key, key, None, 0.0, False, query.shape[1] != key.shape[1])
    return can_use_flash_attention(params)
