"""The fused stage-2 decode op (kernels/fused_decode.py) against its twin (paged_top_pages +
paged_sparse_decode_attention in PyTorch), against float64 attention over the twin's selected tokens, and against
full float64 attention when topk covers every page.

Stores are random pools read through random block tables (rows own different page counts, pages no row owns hold
large garbage), with ragged and per-head lengths and partial last pages. Interpreted on CPU, compiled on a GPU.
"""

import pytest
import torch

from hf_rocketkv.kernels.fused_decode import (
    FUSED_MAX_PAGES,
    fused_decode_launch,
    fused_decode_supported,
    paged_fused_decode_torch,
)
from hf_rocketkv.kernels.paged import paged_top_pages_torch
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import (
    DEVICE,
    OUT_ATOL,
    gen,
    ops,
    page_table,
    query_without_channel_ties,
    randn,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def _case(g, batch, kv_heads, group, head_dim, page_tokens, kt_page, dtype, kt_dtype, topr, per_head=False,
          fp8=None):
    """A pool, a table, lengths and a query; K/V in ``dtype`` (or float8_e4m3fn with scales of granularity
    ``fp8``: "page" or "head"), the KT built over each row's tokens (what compaction and appends leave)."""
    pages_per_row = [int(x) for x in torch.randint(1, 5, (batch,), generator=g)]
    num_pool = sum(pages_per_row) + 3
    table = page_table(pages_per_row, num_pool, g)
    capacity = table.shape[1] * page_tokens
    lengths = torch.tensor([int(torch.randint(0, n * page_tokens + 1, (1,), generator=g)) for n in pages_per_row],
                           device=DEVICE)
    lengths[0] = pages_per_row[0] * page_tokens - 1  # a partial last page (or a full one when KP = 1)
    if per_head:
        cut = torch.randint(0, 3, (batch, kv_heads), generator=g).to(DEVICE)
        lengths = (lengths[:, None] - cut).clamp(min=0)
    k_pages = randn((num_pool, kv_heads, page_tokens, head_dim), torch.float32, g, scale=50.0)
    v_pages = randn((num_pool, kv_heads, page_tokens, head_dim), torch.float32, g, scale=50.0)
    keys = randn((batch, kv_heads, capacity, head_dim), torch.float32, g, scale=2.0)
    values = randn((batch, kv_heads, capacity, head_dim), torch.float32, g)
    filled = torch.arange(capacity, device=DEVICE) < ref.per_head(lengths, batch, kv_heads)[..., None]
    keys = torch.where(filled[..., None], keys, 0.0)
    for b, n in enumerate(pages_per_row):  # the rows' pages: their tokens, page by page
        for j in range(n):
            p = int(table[b, j])
            k_pages[p] = keys[b, :, j * page_tokens:(j + 1) * page_tokens]
            v_pages[p] = values[b, :, j * page_tokens:(j + 1) * page_tokens]
    kt = ref.build_kt(keys.to(dtype) if fp8 is None else keys, lengths, kt_page, kt_dtype)
    kt_pages = randn((num_pool, kv_heads, page_tokens // kt_page, 2, head_dim), torch.float32, g, 50.0).to(kt_dtype)
    per_pool = page_tokens // kt_page
    for b, n in enumerate(pages_per_row):
        for j in range(n):
            kt_pages[int(table[b, j])] = kt[b, :, j * per_pool:(j + 1) * per_pool]
    scales = (None, None)
    if fp8 is not None:
        shape = (num_pool,) if fp8 == "page" else (num_pool, kv_heads)
        scales = tuple((torch.rand(shape, generator=g) * 0.05 + 0.01).to(DEVICE) for _ in range(2))
        view = (-1, 1, 1, 1) if fp8 == "page" else (num_pool, kv_heads, 1, 1)
        k_pages = (k_pages / scales[0].view(view)).clamp(-448, 448).to(torch.float8_e4m3fn)
        v_pages = (v_pages / scales[1].view(view)).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        k_pages, v_pages = k_pages.to(dtype), v_pages.to(dtype)
    q = query_without_channel_ties((batch, kv_heads, group, head_dim), dtype, kt_dtype, topr, g).to(DEVICE)
    return q, kt_pages, k_pages, v_pages, table, lengths, scales


def _token(pages, scale, table, b, h, slot, page_tokens):
    p = int(table[b, slot // page_tokens])
    x = pages[p, h, slot % page_tokens].double().cpu()
    if scale is not None:
        x = x * float(scale[p] if scale.dim() == 1 else scale[p, h])
    return x


def _oracle(q, k_pages, v_pages, table, lengths, scales, slots_of, scaling):
    """Float64 softmax attention of each (row, KV head) over ``slots_of(b, h)``, tokens read through the table."""
    batch, kv_heads, group, head_dim = q.shape
    page_tokens = k_pages.shape[2]
    out = torch.zeros(batch, kv_heads, group, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            slots = slots_of(b, h)
            if not slots:
                continue
            k = torch.stack([_token(k_pages, scales[0], table, b, h, s, page_tokens) for s in slots])
            v = torch.stack([_token(v_pages, scales[1], table, b, h, s, page_tokens) for s in slots])
            out[b, h] = torch.softmax(q[b, h].double().cpu() @ k.T * scaling, dim=-1) @ v
    return out


def _selected(page_idx, page_valid, lengths, kt_page):
    lengths = ref.per_head(lengths, *page_idx.shape[:2])

    def slots_of(b, h):
        pages = sorted(int(p) for p, ok in zip(page_idx[b, h].tolist(), page_valid[b, h].tolist()) if ok)
        return [p * kt_page + t for p in pages for t in range(kt_page) if p * kt_page + t < int(lengths[b, h])]
    return slots_of


def _pages_list(page_idx, page_valid, kb):
    """The twin's selected pages in use, ascending, padded with -1 to ``kb`` (the launcher's return_pages form)."""
    rows = []
    width = page_idx.shape[-1]
    for idx, ok in zip(page_idx.reshape(-1, width).tolist(), page_valid.reshape(-1, width).tolist()):
        chosen = sorted(p for p, v in zip(idx, ok) if v)
        rows.append(chosen + [-1] * (kb - len(chosen)))
    return torch.tensor(rows, dtype=torch.int32).view(*page_idx.shape[:2], kb)


# (batch, Hkv, G, D, PP, KP, topr, topk, sink, recent, q/KV dtype, KT dtype, per-head lengths, head_bound, splits)
CASES = [
    (1, 2, 4, 64, 16, 4, 16, 3, 0, 1, torch.float32, torch.float32, False, False, None),
    (3, 1, 1, 64, 8, 2, 64, 4, 1, 1, torch.float32, torch.bfloat16, True, False, 2),
    (2, 2, 8, 128, 8, 4, 32, 2, 0, 2, torch.bfloat16, torch.float8_e5m2, False, False, 1),
    (5, 1, 4, 64, 16, 4, 64, 5, 1, 2, torch.bfloat16, torch.bfloat16, True, True, None),
    (4, 2, 4, 128, 4, 1, 128, 6, 2, 1, torch.float32, torch.float32, False, True, 3),
    (2, 3, 1, 64, 16, 8, 64, 1, 0, 1, torch.bfloat16, torch.float8_e5m2, True, False, None),
]


@pytest.mark.parametrize("one_launch", [None, False], ids=["default", "separate-scoring"])
@pytest.mark.parametrize("batch,kv_heads,group,head_dim,page_tokens,kt_page,topr,topk,sink,recent,dtype,kt_dtype,"
                         "per_head,head_bound,splits", CASES)
def test_fused_decode_equals_twin_and_float64_attention(batch, kv_heads, group, head_dim, page_tokens, kt_page, topr,
                                                        topk, sink, recent, dtype, kt_dtype, per_head, head_bound,
                                                        splits, one_launch):
    """``one_launch=None``: with one split (cases with splits 1, or a batch that fills the interpreter's 4 "SMs")
    the scoring pass runs inside the select-and-attend kernel; False: always its own launch."""
    g = gen("fused", batch, kv_heads, group, head_dim, page_tokens, kt_page, topk, dtype, kt_dtype, per_head)
    q, kt_pages, k_pages, v_pages, table, lengths, _ = _case(g, batch, kv_heads, group, head_dim, page_tokens,
                                                             kt_page, dtype, kt_dtype, topr, per_head)
    scaling = head_dim**-0.5
    args = (q, kt_pages, k_pages, v_pages, table, lengths, kt_page, topr, topk, scaling, sink, recent, head_bound)
    got, pages = fused_decode_launch(*args, num_splits=splits, one_launch=one_launch, return_pages=True)
    twin = paged_fused_decode_torch(*args)
    page_idx, page_valid = paged_top_pages_torch(q, kt_pages, table, lengths, kt_page, topr, topk, sink, recent,
                                                 head_bound)
    assert torch.equal(pages.cpu(), _pages_list(page_idx, page_valid, pages.shape[-1]))
    oracle = _oracle(q, k_pages, v_pages, table, lengths, (None, None), _selected(page_idx, page_valid, lengths,
                                                                                   kt_page), scaling)
    tol = OUT_ATOL[dtype]
    torch.testing.assert_close(twin.double().cpu(), oracle, atol=tol, rtol=0)
    torch.testing.assert_close(got.double().cpu(), oracle, atol=tol, rtol=0)
    op = ops().paged_fused_decode(*args)  # the bundle's entry (the default split count)
    torch.testing.assert_close(op.double().cpu(), oracle, atol=tol, rtol=0)


@pytest.mark.parametrize("group,head_dim,dtype,splits", [(1, 64, torch.float32, None), (4, 128, torch.bfloat16, 3),
                                                         (8, 64, torch.float32, 1)])
def test_fused_decode_with_every_page_is_full_attention(group, head_dim, dtype, splits):
    g = gen("fused-full", group, head_dim, dtype)
    q, kt_pages, k_pages, v_pages, table, lengths, _ = _case(g, 3, 2, group, head_dim, 8, 4, dtype, torch.bfloat16,
                                                             head_dim, per_head=True)
    topk = table.shape[1] * 2  # every KT page of the widest row
    scaling = head_dim**-0.5
    got = fused_decode_launch(q, kt_pages, k_pages, v_pages, table, lengths, 4, head_dim, topk, scaling,
                              num_splits=splits)
    per_head = ref.per_head(lengths, 3, 2)
    oracle = _oracle(q, k_pages, v_pages, table, lengths, (None, None),
                     lambda b, h: list(range(int(per_head[b, h]))), scaling)
    torch.testing.assert_close(got.double().cpu(), oracle, atol=OUT_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("granularity,dtype", [("page", torch.float32), ("head", torch.bfloat16)])
def test_fused_decode_reads_fp8_pages_with_their_scales(granularity, dtype):
    g = gen("fused-fp8", granularity, dtype)
    q, kt_pages, k_pages, v_pages, table, lengths, scales = _case(g, 3, 2, 4, 64, 8, 4, dtype, torch.float32, 16,
                                                                  per_head=granularity == "head", fp8=granularity)
    scaling = 0.125
    args = (q, kt_pages, k_pages, v_pages, table, lengths, 4, 16, 3, scaling, 0, 1, False, *scales)
    got = fused_decode_launch(*args, num_splits=2)
    page_idx, page_valid = paged_top_pages_torch(q, kt_pages, table, lengths, 4, 16, 3)
    oracle = _oracle(q, k_pages, v_pages, table, lengths, scales, _selected(page_idx, page_valid, lengths, 4), scaling)
    tol = OUT_ATOL[dtype]
    torch.testing.assert_close(paged_fused_decode_torch(*args).double().cpu(), oracle, atol=tol, rtol=0)
    torch.testing.assert_close(got.double().cpu(), oracle, atol=tol, rtol=0)


def test_ties_go_to_the_lower_page_id_as_in_the_selection_rule():
    """Equal KT pages score equally: the selection keeps the lowest page ids among them (the forced newest page
    aside), exactly as ``select_pages``; V differs per page, so another choice would change the output."""
    g = gen("fused-ties")
    q, kt_pages, k_pages, v_pages, table, lengths, _ = _case(g, 2, 2, 4, 64, 16, 4, torch.float32, torch.float32, 64)
    kt_pages.copy_(kt_pages[:1].expand_as(kt_pages))  # every KT page the same: all scores tie
    lengths = torch.tensor([table.shape[1] * 16 - 5, 13], device=DEVICE).clamp(max=(table >= 0).sum(1) * 16)
    for topk, sink, recent in ((3, 0, 1), (5, 1, 2), (2, 0, 2)):
        args = (q, kt_pages, k_pages, v_pages, table, lengths, 4, 64, topk, 0.125, sink, recent)
        got, pages = fused_decode_launch(*args, num_splits=2, return_pages=True)
        page_idx, page_valid = paged_top_pages_torch(*args[:2], table, lengths, 4, 64, topk, sink, recent)
        assert torch.equal(pages.cpu(), _pages_list(page_idx, page_valid, pages.shape[-1]))
        torch.testing.assert_close(got, paged_fused_decode_torch(*args), atol=2e-5, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts for the interpreter's stand-in of 4 SMs")
@pytest.mark.parametrize("batch,kv_heads,width,launches", [
    (1, 1, 8, 3),    # 1 row: the attention split over the pages (select-and-attend + combine) after the scoring pass
    (3, 1, 40, 2),   # 3 rows fill the 4 "SMs" twice over, but 160 pages split the scoring pass: its own launch
    (3, 1, 4, 1),    # one program per (row, KV head) for both: the scoring pass inside the kernel
])
def test_launches_per_call_follow_the_schedule(batch, kv_heads, width, launches):
    from hf_rocketkv.kernels import launch as launch_module

    g = gen("fused-launches", batch, width)
    table = torch.arange(batch * width, dtype=torch.int32, device=DEVICE).view(batch, width)
    kt_pages = randn((batch * width, kv_heads, 4, 2, 16), torch.float32, g)
    pages = randn((batch * width, kv_heads, 16, 16), torch.float32, g)
    q = randn((batch, kv_heads, 4, 16), torch.float32, g)
    lengths = torch.full((batch,), width * 16 - 3, device=DEVICE)
    args = (q, kt_pages, pages, pages, table, lengths, 4, 16, 16, 0.25)
    count = [0]
    original = launch_module.TritonLaunch.__getitem__

    def counting(self, grid):
        count[0] += 1
        return original(self, grid)

    launch_module.TritonLaunch.__getitem__ = counting
    try:
        got = fused_decode_launch(*args)
    finally:
        launch_module.TritonLaunch.__getitem__ = original
    assert count[0] == launches
    torch.testing.assert_close(got, paged_fused_decode_torch(*args), atol=2e-5, rtol=0)


def test_registered_op_runs_through_the_dispatcher():
    g = gen("fused-op")
    q, kt_pages, k_pages, v_pages, table, lengths, _ = _case(g, 2, 2, 4, 64, 8, 4, torch.float32, torch.float32, 64)
    args = (q, kt_pages, k_pages, v_pages, table, lengths, 4, 64, 3, 0.125)
    got = torch.ops.hf_rocketkv.paged_fused_decode(*args, 0, 1, False, None, None)
    torch.testing.assert_close(got, paged_fused_decode_torch(*args), atol=2e-5, rtol=0)


def test_rows_too_wide_for_the_fused_selection_are_declined():
    kt_pages = torch.zeros((1, 1, 4, 2, 8), device=DEVICE)
    wide = torch.zeros((1, FUSED_MAX_PAGES // 4 + 1), dtype=torch.int32, device=DEVICE)
    assert fused_decode_supported(kt_pages, wide[:, :-1]) is None
    assert "FUSED_MAX_PAGES" in fused_decode_supported(kt_pages, wide)
    pages = torch.zeros((1, 1, 16, 8), device=DEVICE)
    with pytest.raises(ValueError, match="paged_fused_decode: .*FUSED_MAX_PAGES"):
        fused_decode_launch(torch.zeros((1, 1, 1, 8), device=DEVICE), kt_pages, pages, pages, wide,
                            torch.zeros(1, dtype=torch.long, device=DEVICE), 4, 8, 2, 1.0)


@pytest.mark.parametrize("seed", range(8))
def test_fused_decode_random_shapes(seed):
    """Random draws of the shapes and options above: selection and output equal the twin's."""
    g = gen("fused-random", seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    batch, kv_heads, group, head_dim = pick([1, 2, 3, 4, 5]), pick([1, 2]), pick([1, 4, 8]), pick([64, 128])
    page_tokens, dtype, kt_dtype = pick([4, 8, 16]), pick([torch.float32, torch.bfloat16]), pick(
        [torch.float32, torch.bfloat16, torch.float8_e5m2])
    kt_page = pick([k for k in (1, 2, 4) if k <= page_tokens])
    topr = head_dim if group == 1 and kt_dtype == torch.float8_e5m2 else pick([8, 32, head_dim])
    topk, sink = pick([1, 2, 5, 9]), pick([0, 1])
    recent = pick([r for r in (1, 2) if sink + r <= topk] or [1])
    sink = min(sink, topk - recent)
    q, kt_pages, k_pages, v_pages, table, lengths, _ = _case(g, batch, kv_heads, group, head_dim, page_tokens,
                                                             kt_page, dtype, kt_dtype, topr, per_head=pick([0, 1]))
    args = (q, kt_pages, k_pages, v_pages, table, lengths, kt_page, topr, topk, head_dim**-0.5, sink, recent,
            bool(pick([0, 1])))
    got, pages = fused_decode_launch(*args, num_splits=pick([None, 1, 2, 4]), one_launch=pick([None, False]),
                                     return_pages=True)
    page_idx, page_valid = paged_top_pages_torch(*args[:2], table, lengths, kt_page, topr, topk, sink, recent, args[-1])
    assert torch.equal(pages.cpu(), _pages_list(page_idx, page_valid, pages.shape[-1]))
    torch.testing.assert_close(got.double().cpu(), paged_fused_decode_torch(*args).double().cpu(),
                               atol=OUT_ATOL[dtype], rtol=0)


def test_stage2_kernel_is_validated_naming_the_field():
    from hf_rocketkv import RocketKVConfig

    assert RocketKVConfig().stage2_kernel == "auto"
    assert RocketKVConfig(stage2_kernel="fused").stage2_kernel == "fused"
    with pytest.raises(ValueError, match=r"RocketKVConfig.stage2_kernel must be one of \['auto', 'fused', 'split'\]"):
        RocketKVConfig(stage2_kernel="one_launch")


@pytest.mark.parametrize("kt_dtype", ["float32", "float8_e5m2"])
@pytest.mark.slow  # whole generate() calls under the Triton interpreter: ~12 s each
def test_generate_with_the_fused_stage2_gives_the_split_tokens(kt_dtype, monkeypatch):
    """A tiny random Llama through generate(): stage2_kernel="fused" runs the fused op on every decode step of every
    layer and gives the greedy tokens of "split" and of the PyTorch backend."""
    from hf_rocketkv import RocketKVConfig
    from hf_rocketkv.cache import stage2
    from tests.kernels.test_e2e_triton import _generate, _model

    model = _model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # left padding: ragged rows
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    config = RocketKVConfig(prompt_budget=16, window_size=4, kernel_size=3, topk=3, topr=16, page_size=2,
                            kt_cache_dtype=kt_dtype)
    chosen = []
    decide = stage2.fused_stage2
    monkeypatch.setattr(stage2, "fused_stage2", lambda layer: chosen.append(decide(layer)) or chosen[-1])
    out_torch, _ = _generate(model, ids, mask, config.replace(backend="torch"))
    assert not any(chosen)
    out_split, _ = _generate(model, ids, mask, config.replace(backend="triton", stage2_kernel="split"))
    assert chosen and not any(chosen)
    chosen.clear()
    out_fused, _ = _generate(model, ids, mask, config.replace(backend="triton", stage2_kernel="fused"))
    assert chosen and all(chosen)
    assert torch.equal(out_fused, out_split) and torch.equal(out_fused, out_torch)


def _gpu_case():
    g = gen("fused-gpu")
    q, kt_pages, k_pages, v_pages, table, lengths, _ = _case(g, 3, 2, 4, 64, 16, 4, torch.bfloat16,
                                                             torch.float8_e5m2, 64, per_head=True)
    return (q, kt_pages, k_pages, v_pages, table, lengths, 4, 64, 3, 0.125, 0, 1, False, None, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_decode_replays_in_a_cuda_graph():
    """Captured once (no host sync, static shapes), replayed over changed inputs: the eager op's output."""
    args = _gpu_case()
    q = args[0]
    static_q = q.clone()

    def call():
        return ops().paged_fused_decode(static_q, *args[1:])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    static_q.copy_(-q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops().paged_fused_decode(-q, *args[1:]))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the interpreter cannot run a triton_op on the fake tensors torch.compile traces with")
def test_fused_decode_compiles_fullgraph():
    args = _gpu_case()
    torch._dynamo.reset()
    compiled = torch.compile(ops().paged_fused_decode, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), ops().paged_fused_decode(*args))


def test_fused_decode_reads_nothing_back_from_the_device():
    """No host read of a tensor's value (item, nonzero, tolist...): launch shapes come from tensor shapes only, so
    the op can be captured in a CUDA graph."""
    from tests.cache.test_host_syncs import HostReads

    args = _gpu_case()
    ops().paged_fused_decode(*args)  # compiled (GPU) or traced (interpreter) outside the count
    with HostReads() as reads:
        ops().paged_fused_decode(*args)
    assert not reads.counts, dict(reads.counts)
    with HostReads() as reads:  # the counter sees a read
        args[5].max().item()
    assert reads.total == 1
