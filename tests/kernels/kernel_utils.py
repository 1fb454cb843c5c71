"""Helpers shared by the kernel tests (imported as ``tests.kernels.kernel_utils``)."""

import zlib

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2)

# max |triton - reference| on outputs stored in each dtype (outputs are rounded to it; accumulation is fp32)
OUT_ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
MIN_EXPONENT = {torch.bfloat16: -126, torch.float16: -14}


def spacing(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between neighbouring values of 16-bit ``dtype`` around float64 ``v`` (its unit in the last
    place)."""
    _, exponent = torch.frexp(v.abs().clamp_min(2.0 ** MIN_EXPONENT[dtype]))
    return torch.ldexp(torch.ones_like(v), exponent - 1 - MANTISSA_BITS[dtype])


def gen(*key) -> torch.Generator:
    """A generator seeded from the test's parameters (stable across processes, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, dtype, g, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def ops():
    """TRITON_OPS (imported lazily, after tests/conftest.py chose the interpreter on CPU)."""
    from hf_rocketkv.kernels.triton_ops import TRITON_OPS

    return TRITON_OPS


def selected_slots(page_idx, page_valid, lengths, b: int, h: int, kt_page: int) -> list[int]:
    """The token slots a sparse-attention oracle attends for row ``b``, KV head ``h``: every token of each valid
    selected KT page, below the head's length (``lengths`` per head, ``[B, Hkv]``)."""
    slots = [int(p) * kt_page + t for p, ok in zip(page_idx[b, h].tolist(), page_valid[b, h].tolist()) if ok
             for t in range(kt_page)]
    return [s for s in slots if s < int(lengths[b, h])]


def page_table(pages_per_row, num_pages, g):
    """Rows own ``pages_per_row[b]`` distinct random pages of a pool of ``num_pages``; -1 pads to the widest."""
    order = torch.randperm(num_pages, generator=g).tolist()
    width = max(pages_per_row)
    rows, used = [], 0
    for count in pages_per_row:
        rows.append(order[used : used + count] + [-1] * (width - count))
        used += count
    assert used <= num_pages
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def query_without_channel_ties(shape, dtype, kt_dtype, topr, g):
    """A query whose group-summed |q| (after rounding to the KT dtype) has no tie at the top-r boundary.

    Ties there make the channel set ambiguous (torch.topk leaves their order unspecified), so they are redrawn.
    """
    for _ in range(50):
        # magnitudes spread over many binades keep fp8-rounded sums distinct
        q = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
        q = q.to(dtype)
        if topr >= shape[-1]:
            return q.to(DEVICE)
        a = q.to(kt_dtype).float().abs().sum(dim=2).sort(dim=-1, descending=True).values
        if bool((a[..., topr - 1] > a[..., topr]).all()):
            return q.to(DEVICE)
    raise AssertionError("could not draw a tie-free query")
