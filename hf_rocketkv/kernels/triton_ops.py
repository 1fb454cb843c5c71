"""TRITON_OPS: the Triton twins of every RocketKV op, with exactly the reference signatures and semantics.

Each kernel file holds its kernels and a plain launcher with the reference's signature; this module registers every
launcher as a ``torch.library.triton_op`` (``torch.ops.hf_rocketkv.<name>``; the launchers call their kernels
through ``wrap_triton``), so torch.compile traces straight into the Triton kernels without graph breaks and CUDA
graphs can capture them. The decode ops (update_kt, page_scores, select_pages, sparse_decode_attention) derive their
launch shapes from tensor shapes only and never sync with the host. Registration happens here, not at
``import hf_rocketkv``, because ``triton_op`` imports torch._inductor (seconds) and only the Triton backend needs it.

    op                       file                        kernels per call
    window_scores            window_scores.py            2 (+ a tiny PyTorch log-sum-exp combine)    prefill
    build_kt                 kt_build.py                 1                                           prefill
    update_kt                kt_update.py                1 (in place: mutates kt)                    decode
    page_scores              page_scores.py              1 (fused) or 2 (split over pages)           decode
    select_pages             select_pages.py             1                                           decode
    sparse_decode_attention  sparse_decode_attention.py  1 (one split) or 2 (split + reduce)         decode

CPU: the kernels run under Triton's interpreter when TRITON_INTERPRET=1 is set BEFORE triton is first imported
(tests/conftest.py does this on machines without CUDA).
"""

from __future__ import annotations

from torch.library import triton_op

from .dispatch import RocketOps
from .kt_build import build_kt_triton
from .kt_update import update_kt_triton
from .page_scores import page_scores_triton
from .select_pages import select_pages_triton
from .sparse_decode_attention import sparse_decode_attention_triton
from .window_scores import window_scores_triton

window_scores = triton_op("hf_rocketkv::window_scores", mutates_args={})(window_scores_triton)
build_kt = triton_op("hf_rocketkv::build_kt", mutates_args={})(build_kt_triton)
update_kt = triton_op("hf_rocketkv::update_kt", mutates_args={"kt"})(update_kt_triton)
page_scores = triton_op("hf_rocketkv::page_scores", mutates_args={})(page_scores_triton)
select_pages = triton_op("hf_rocketkv::select_pages", mutates_args={})(select_pages_triton)
sparse_decode_attention = triton_op("hf_rocketkv::sparse_decode_attention", mutates_args={})(
    sparse_decode_attention_triton
)

TRITON_OPS = RocketOps(
    name="triton",
    window_scores=window_scores,
    build_kt=build_kt,
    update_kt=update_kt,
    page_scores=page_scores,
    select_pages=select_pages,
    sparse_decode_attention=sparse_decode_attention,
)
