"""Arrival counters (kernels/arrivals.py): the selection's merge and the sparse attention's combine run in the launch
before them, by each group's last program. The results are the references' (the selection rule on the kernel's own
page scores; float64-close attention), element for element those of the two-launch form, the counters are left 0,
and the second launch does not happen."""

import pytest
import torch

from hf_rocketkv.kernels import select_pages as select_module
from hf_rocketkv.kernels import sparse_decode_attention as attention_module
from hf_rocketkv.kernels.page_scores import page_scores_launch
from hf_rocketkv.kernels.select_pages import select_plan, top_pages_launch
from hf_rocketkv.kernels.sparse_decode_attention import sparse_decode_attention_launch, sparse_decode_attention_torch
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import DEVICE, OUT_ATOL, gen, randn
from tests.kernels.test_select_pages import _kt, assert_same_selection

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


class CountedLaunch:
    """A TritonLaunch stand-in that counts the launches through it (``launch[grid](...)``) and runs them."""

    def __init__(self, launch):
        self.launch, self.count = launch, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.launch[grid]


def counted(monkeypatch, module, name: str) -> CountedLaunch:
    launch = CountedLaunch(getattr(module, name))
    monkeypatch.setattr(module, name, launch)
    return launch


def zeros(entries: int) -> torch.Tensor:
    return torch.zeros(entries, dtype=torch.int32, device=DEVICE)


# (num_pages, topk, page_size, chunk, merge_block, per-head lengths): chunks the one merge level folds in; several
# merge levels (the counters then unused: the merge launches stay)
SELECT_CASES = [
    (70, 8, 4, 16, 64, False),  # 5 chunks of 16 pages, one level of fan-in 8
    (90, 3, 2, 8, 32, True),  # 12 chunks of 8 pages, per-head token counts, empty and partial rows
    (40, 6, 4, None, None, False),  # one chunk: no merge either way
    (150, 4, 1, 16, 16, False),  # 10 chunks, fan-in 4: two levels, the counters left alone
]


@pytest.mark.parametrize("num_pages,topk,page_size,chunk,merge_block,per_head", SELECT_CASES)
def test_the_selection_merges_in_the_chunk_launch(monkeypatch, num_pages, topk, page_size, chunk, merge_block,
                                                   per_head):
    g = gen("arrivals-select", num_pages, topk, page_size, chunk)
    batch, kv_heads, group, head_dim, topr, sink, recent = 3, 2, 4, 32, 12, 1, 2
    q = randn((batch, kv_heads, group, head_dim), torch.float32, g)
    kt = _kt(batch, kv_heads, num_pages, head_dim, torch.float32, g)
    if per_head:
        lengths = torch.tensor([[num_pages * page_size, 0], [7, 33 * page_size + 1], [1, num_pages * page_size - 3]])
    else:
        lengths = torch.tensor([num_pages * page_size, 41 * page_size - 2, 0])
    lengths = lengths.to(DEVICE)
    levels = select_plan(num_pages, topk, chunk, merge_block)["levels"]
    merges = counted(monkeypatch, select_module, "_select_merge_launch")
    counters = zeros(batch * kv_heads + 5)
    idx, valid = top_pages_launch(q, kt, lengths, page_size, topr, topk, sink, recent, chunk=chunk,
                                  merge_block=merge_block, counters=counters)
    assert merges.count == (0 if len(levels) <= 1 else len(levels))
    assert not counters.any()
    n_pages = ref.num_pages(lengths, page_size)
    want = ref.select_pages(page_scores_launch(q, kt, n_pages, topr), n_pages, topk, sink, recent)
    assert_same_selection(idx, valid, *want)
    two_launch = top_pages_launch(q, kt, lengths, page_size, topr, topk, sink, recent, chunk=chunk,
                                  merge_block=merge_block)
    assert merges.count == (0 if not levels else 2 * len(levels) - (len(levels) == 1))
    assert torch.equal(idx, two_launch[0]) and torch.equal(valid, two_launch[1])


# (dtype, group, head_dim, page_size, num_splits, sinks, softcap)
ATTENTION_CASES = [
    (torch.float32, 4, 32, 4, 3, False, None),
    (torch.bfloat16, 2, 64, 8, 4, True, None),
    (torch.float16, 1, 48, 4, 2, False, 30.0),
    (torch.float32, 3, 16, 4, 1, True, None),  # one split: written directly, no combine either way
]


@pytest.mark.parametrize("dtype,group,head_dim,page_size,splits,sinks,softcap", ATTENTION_CASES)
def test_the_attention_combines_in_the_split_launch(monkeypatch, dtype, group, head_dim, page_size, splits, sinks,
                                                     softcap):
    g = gen("arrivals-attention", dtype, group, head_dim, page_size, splits)
    batch, kv_heads, capacity = 3, 2, 10 * page_size
    k = 6
    q = randn((batch, kv_heads, group, head_dim), dtype, g)
    keys = randn((batch, kv_heads, capacity, head_dim), dtype, g)
    values = randn((batch, kv_heads, capacity, head_dim), dtype, g)
    lengths = torch.tensor([capacity, 4 * page_size + 1, 0], device=DEVICE)  # full, partial page, empty row
    page_idx = torch.stack([torch.randperm(capacity // page_size, generator=g)[:k] for _ in range(batch * kv_heads)])
    page_idx = page_idx.view(batch, kv_heads, k).to(DEVICE)
    page_valid = (torch.rand((batch, kv_heads, k), generator=g) > 0.2).to(DEVICE)
    sink_logits = randn((kv_heads * group,), torch.float32, g) if sinks else None
    reduces = counted(monkeypatch, attention_module, "_sparse_decode_reduce_launch")
    counters = zeros(batch * kv_heads)
    out = sparse_decode_attention_launch(q, keys, values, page_idx, page_valid, lengths, page_size, 0.3,
                                         num_splits=splits, block_n=16, softcap=softcap, sinks=sink_logits,
                                         counters=counters)
    assert reduces.count == 0 and not counters.any()
    want = sparse_decode_attention_torch(q.double(), keys.double(), values.double(), page_idx, page_valid, lengths,
                                         page_size, 0.3, softcap=softcap, sinks=sink_logits)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=OUT_ATOL[dtype])
    two_launch = sparse_decode_attention_launch(q, keys, values, page_idx, page_valid, lengths, page_size, 0.3,
                                                num_splits=splits, block_n=16, softcap=softcap, sinks=sink_logits)
    assert reduces.count == (splits > 1)
    assert torch.equal(out, two_launch)  # the same combine arithmetic (_combine_head)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter runs the programs in order; a GPU races them")
def test_stale_counters_are_seen():
    """The counters decide who combines: a buffer left at 1 makes a row's second-to-last split combine before the last
    one wrote (what the zero invariant prevents), so the test above could fail."""
    g = gen("arrivals-stale")
    q = randn((1, 1, 2, 32), torch.float32, g)
    keys, values = randn((1, 1, 64, 32), torch.float32, g), randn((1, 1, 64, 32), torch.float32, g)
    page_idx = torch.arange(8, device=DEVICE).view(1, 1, 8)
    page_valid = torch.ones((1, 1, 8), dtype=torch.bool, device=DEVICE)
    lengths = torch.tensor([64], device=DEVICE)
    args = (q, keys, values, page_idx, page_valid, lengths, 8, 0.2)
    fresh = sparse_decode_attention_launch(*args, num_splits=4, block_n=16, counters=zeros(1))
    stale = zeros(1) + 1
    early = sparse_decode_attention_launch(*args, num_splits=4, block_n=16, counters=stale)
    assert not torch.equal(fresh, early)


@pytest.mark.parametrize("make", [
    lambda: zeros(4).long(),
    lambda: zeros(3),  # 2 rows x 2 KV heads need 4
    lambda: zeros(8)[::2],
    lambda: [0, 0, 0, 0],
], ids=["int64", "too-few", "strided", "list"])
def test_counters_of_another_shape_are_refused(make):
    g = gen("arrivals-refused")
    q = randn((2, 2, 1, 16), torch.float32, g)
    keys = randn((2, 2, 16, 16), torch.float32, g)
    page_idx = torch.zeros((2, 2, 2), dtype=torch.long, device=DEVICE)
    page_valid = torch.ones((2, 2, 2), dtype=torch.bool, device=DEVICE)
    lengths = torch.tensor([16, 16], device=DEVICE)
    counters = make()
    with pytest.raises(ValueError, match="counters must be None or a contiguous int32 tensor of at least 4"):
        sparse_decode_attention_launch(q, keys, keys, page_idx, page_valid, lengths, 4, 0.2, counters=counters)
    kt = _kt(2, 2, 4, 16, torch.float32, g)
    with pytest.raises(ValueError, match="top_pages: counters must be"):
        top_pages_launch(q, kt, lengths, 4, 8, 2, counters=counters)
