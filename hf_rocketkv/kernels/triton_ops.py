"""TRITON_OPS: the Triton twins of every RocketKV op, with exactly the reference signatures and semantics.

Each kernel file holds its kernels and a plain launcher with the reference's signature; this module registers every
launcher as a ``torch.library.triton_op`` (``torch.ops.hf_rocketkv.<name>``; the launchers call their kernels
through ``wrap_triton``), so torch.compile traces straight into the Triton kernels without graph breaks and CUDA
graphs can capture them. The decode ops (append_token, update_kt, page_scores, select_pages, top_pages,
sparse_decode_attention) derive their launch shapes from tensor shapes only and never sync with the host. Registration happens here, not at
``import hf_rocketkv``, because ``triton_op`` imports torch._inductor (seconds) and only the Triton backend needs it.

    op                       file                        kernels per call
    window_scores            window_scores.py            2 (+ a tiny PyTorch log-sum-exp combine)    prefill
    build_kt                 kt_build.py                 1                                           prefill
    update_kt                kt_update.py                1 (in place: mutates kt)                    decode
    page_scores              page_scores.py              1 (fused) or 2 (split over pages)           decode
    select_pages             select_pages.py             1 (<= SELECT_CHUNK pages) + merge levels    decode
    top_pages                select_pages.py             2 (logits, select) + merge levels           decode
    sparse_decode_attention  sparse_decode_attention.py  1 (one split) or 2 (split + reduce)         decode
    append_token             append_token.py             1 (in place: K, V, positions, KT, lengths)  decode
    paged_append_token       append_token.py             1 (the same kernel, through a block table;   decode
                                                         advance_seen: the count in the same launch)
    paged_append_kv          append_token.py             1 (K/V, positions, lengths; no KT)           decode
    paged_page_scores        page_scores.py              as page_scores, KT read through the table    decode
    paged_top_pages          select_pages.py             as top_pages, KT read through the table;     decode
                                                         eager with counters: one merge level in the chunk launch
    paged_sparse_decode_attention  sparse_decode_attention.py  as sparse_decode_attention; eager with      decode
                                                         counters: the splits combined in their own launch (1)
    paged_fused_decode       fused_decode.py             1 (one program per row and KV head) or 3 (logits, select-and-attend, combine)  decode
    paged_compact_row        compact.py                  1 (in place: a row's pages, KT, positions)   prefill
    ring_decode_attention    ring_attention.py           1 (one split) or 2 (split + reduce)         decode
    ring_append              ring_append.py              1 (in place: one token per row into the ring; decode
                                                         advance_seen: the count in the same launch; kept_keys /
                                                         kept_values: the overwritten slots too)

``paged_compact_row`` is not registered: stage 1 runs eagerly at the end of a prefill, never inside a compiled or
graphed step, so it only ever needs its plain launcher.

fp8 pages (float8_e4m3fn K/V with float32 ``k_scale`` / ``v_scale`` [N] or [N, Hkv], trailing keyword arguments of
paged_append_token, paged_append_kv, paged_sparse_decode_attention and paged_compact_row; the schemas read
``Tensor? k_scale=None, Tensor? v_scale=None``, except the appends', which mutate them and take them without a
default: see ``_paged_append_token_op``): paged_sparse_decode_attention reads and
dequantizes them in its kernel; the append kernel applies the fp8 append rule in place (``append_token.
fp8_append_torch`` is its reference, bit for bit); paged_compact_row stages the row's pages in float32 through its
kernel, then quantizes them with PyTorch.

Eager calls skip the custom-op machinery: each RocketOps entry calls the plain launcher directly (exactly what the
registered op's own eager implementation runs, minus the dispatcher, autograd and dynamo-disable wrappers, which
cost tens of microseconds per call) and hands over to the registered op whenever torch.compile is tracing.

CPU: the kernels run under Triton's interpreter when TRITON_INTERPRET=1 is set BEFORE triton is first imported
(tests/conftest.py does this on machines without CUDA).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch.library import triton_op

try:  # what triton_op's own eager implementation uses to launch kernels directly instead of through the HOP
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - a torch without it: eager calls go through the registered op
    set_wrap_triton_enabled = None

from .ops import RocketOps
from .append_token import append_token_triton, paged_append_kv_triton, paged_append_token_triton
from .compact import paged_compact_row_triton
from .fused_decode import paged_fused_decode_triton
from .kt_build import build_kt_triton
from .kt_update import update_kt_triton
from .page_scores import page_scores_triton, paged_page_scores_triton
from .ring_append import ring_append_triton
from .ring_attention import ring_decode_attention_triton
from .select_pages import paged_top_pages_triton, select_pages_triton, top_pages_triton
from .sparse_decode_attention import paged_sparse_decode_attention_triton, sparse_decode_attention_triton
from .window_scores import window_scores_triton

window_scores = triton_op("hf_rocketkv::window_scores", mutates_args={})(window_scores_triton)
build_kt = triton_op("hf_rocketkv::build_kt", mutates_args={})(build_kt_triton)
update_kt = triton_op("hf_rocketkv::update_kt", mutates_args={"kt"})(update_kt_triton)
page_scores = triton_op("hf_rocketkv::page_scores", mutates_args={})(page_scores_triton)
select_pages = triton_op("hf_rocketkv::select_pages", mutates_args={})(select_pages_triton)
sparse_decode_attention = triton_op("hf_rocketkv::sparse_decode_attention", mutates_args={})(
    sparse_decode_attention_triton
)
append_token = triton_op(
    "hf_rocketkv::append_token", mutates_args={"keys", "values", "positions", "kt", "lengths"}
)(append_token_triton)
top_pages = triton_op("hf_rocketkv::top_pages", mutates_args={})(top_pages_triton)


# The appends' registered schemas take k_scale / v_scale WITHOUT a default (``Tensor(a!)? k_scale``; pass None for
# float pages): torch 2.11's ADInplaceOrView kernel of a mutating custom op indexes the mutated arguments in the
# dispatcher's argument tuple, from which trailing arguments equal to their defaults are dropped, so a defaulted
# mutated argument left at None raised IndexError in eager calls (torch 2.13 fills the defaults in first).
def _paged_append_token_op(
    k_pages: torch.Tensor, v_pages: torch.Tensor, kt_pages: torch.Tensor, table: torch.Tensor,
    positions: torch.Tensor, lengths: torch.Tensor, seen: torch.Tensor, key_new: torch.Tensor,
    value_new: torch.Tensor, kt_page_size: int, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    advance_seen: bool = False,
) -> None:
    paged_append_token_triton(k_pages, v_pages, kt_pages, table, positions, lengths, seen, key_new, value_new,
                              kt_page_size, k_scale, v_scale, advance_seen)


def _paged_append_kv_op(
    k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
    lengths: torch.Tensor, seen: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> None:
    paged_append_kv_triton(k_pages, v_pages, table, positions, lengths, seen, key_new, value_new, k_scale, v_scale)


def _ring_append_op(
    keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
    rows: torch.Tensor | None, advance_seen: bool, kept_keys: torch.Tensor | None, kept_values: torch.Tensor | None,
) -> None:
    ring_append_triton(keys, values, seen, key_new, value_new, rows, advance_seen, kept_keys, kept_values)


paged_append_token = triton_op(
    "hf_rocketkv::paged_append_token",
    mutates_args={"k_pages", "v_pages", "kt_pages", "positions", "lengths", "seen", "k_scale", "v_scale"},
)(_paged_append_token_op)
paged_append_kv = triton_op(
    "hf_rocketkv::paged_append_kv", mutates_args={"k_pages", "v_pages", "positions", "lengths", "k_scale", "v_scale"}
)(_paged_append_kv_op)


# The selection's and the attention's registered ops are the launchers without their arrival counters
# (kernels/arrivals.py): what torch.compile traces runs the two-launch form (a merge launch, a reduce launch), so the
# schemas declare nothing mutated, as before the counters. Eager calls (and the CUDA graphs captured from them) pass
# the counters to the launchers (``_eager_or_op``'s ``eager_only``).
def _paged_top_pages_op(
    q: torch.Tensor, kt_pages: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, kt_page_size: int,
    topr: int, topk: int, sink_pages: int = 0, recent_pages: int = 1, per_head_bound: bool = False,
    softcap: float | None = None, scaling: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return paged_top_pages_triton(q, kt_pages, table, lengths, kt_page_size, topr, topk, sink_pages, recent_pages,
                                  per_head_bound, softcap, scaling)


def _paged_sparse_decode_attention_op(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor, page_idx: torch.Tensor,
    page_valid: torch.Tensor, lengths: torch.Tensor, kt_page_size: int, scaling: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_sparse_decode_attention_triton(q, k_pages, v_pages, table, page_idx, page_valid, lengths,
                                                kt_page_size, scaling, k_scale, v_scale, softcap, sinks)


paged_page_scores = triton_op("hf_rocketkv::paged_page_scores", mutates_args={})(paged_page_scores_triton)
paged_top_pages = triton_op("hf_rocketkv::paged_top_pages", mutates_args={})(_paged_top_pages_op)
paged_sparse_decode_attention = triton_op("hf_rocketkv::paged_sparse_decode_attention", mutates_args={})(
    _paged_sparse_decode_attention_op
)

paged_fused_decode = triton_op("hf_rocketkv::paged_fused_decode", mutates_args={})(paged_fused_decode_triton)
ring_decode_attention = triton_op("hf_rocketkv::ring_decode_attention", mutates_args={})(
    ring_decode_attention_triton
)
ring_append = triton_op(  # kept_keys / kept_values mutated: no defaults in the schema (see the appends' above)
    "hf_rocketkv::ring_append", mutates_args={"keys", "values", "seen", "kept_keys", "kept_values"}
)(_ring_append_op)


def _defaulted(launcher: Callable) -> tuple[tuple[int, str, object], ...]:
    """(index, name, default) of the launcher's parameters that have a default."""
    params = inspect.signature(launcher).parameters.values()
    return tuple((i, p.name, p.default) for i, p in enumerate(params) if p.default is not inspect.Parameter.empty)


def _eager_or_op(launcher: Callable, op, eager_only: tuple[str, ...] = ()) -> Callable:
    """``op`` (the triton_op) under torch.compile, the launcher itself in eager mode. Arguments the caller leaves at
    the launcher's defaults are passed to the op explicitly (the appends' schemas have no defaults for the scales).
    ``eager_only``: keyword arguments of the launcher that the op does not take (dropped under torch.compile)."""
    defaulted = tuple(entry for entry in _defaulted(launcher) if entry[1] not in eager_only)

    def registered(*args, **kwargs):
        kwargs = {name: value for name, value in kwargs.items() if name not in eager_only}
        missing = {name: default for i, name, default in defaulted if i >= len(args) and name not in kwargs}
        return op(*args, **kwargs, **missing)

    if set_wrap_triton_enabled is None:
        return registered

    @functools.wraps(launcher)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return registered(*args, **kwargs)
        with set_wrap_triton_enabled(False):
            return launcher(*args, **kwargs)

    call.op = op
    return call


TRITON_OPS = RocketOps(
    name="triton",
    window_scores=_eager_or_op(window_scores_triton, window_scores),
    build_kt=_eager_or_op(build_kt_triton, build_kt),
    update_kt=_eager_or_op(update_kt_triton, update_kt),
    page_scores=_eager_or_op(page_scores_triton, page_scores),
    select_pages=_eager_or_op(select_pages_triton, select_pages),
    sparse_decode_attention=_eager_or_op(sparse_decode_attention_triton, sparse_decode_attention),
    append_token=_eager_or_op(append_token_triton, append_token),
    top_pages=_eager_or_op(top_pages_triton, top_pages),
    paged_append_token=_eager_or_op(paged_append_token_triton, paged_append_token),
    paged_append_kv=_eager_or_op(paged_append_kv_triton, paged_append_kv),
    paged_page_scores=_eager_or_op(paged_page_scores_triton, paged_page_scores),
    paged_top_pages=_eager_or_op(paged_top_pages_triton, paged_top_pages, eager_only=("counters",)),
    paged_sparse_decode_attention=_eager_or_op(paged_sparse_decode_attention_triton, paged_sparse_decode_attention,
                                               eager_only=("counters",)),
    paged_fused_decode=_eager_or_op(paged_fused_decode_triton, paged_fused_decode),
    paged_compact_row=paged_compact_row_triton,
    ring_decode_attention=_eager_or_op(ring_decode_attention_triton, ring_decode_attention),
    ring_append=_eager_or_op(ring_append_triton, ring_append),
)
