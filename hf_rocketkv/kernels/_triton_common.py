"""Helpers shared by the Triton kernels: dtype maps, exact rounding casts, launch-size heuristics.

Rounding: Triton's interpreter (TRITON_INTERPRET=1, used by the CPU tests) truncates instead of rounding to nearest
even when it narrows fp32 to bfloat16 or float8_e5m2, so a plain ``.to()`` would differ from PyTorch by one ulp on
CPU. ``round_to`` first rounds the fp32 value to the nearest-even value representable in the target dtype with
integer arithmetic (the same on every backend), so the final ``.to()`` is exact everywhere. The rules are those of
``torch.Tensor.to`` for finite values; values that overflow float8_e5m2 (|x| > 57344) become inf as in PyTorch on
the CPU interpreter, and the hardware conversion decides on the GPU.

float8_e4m3fn (``DT_FP8E4``, the fp8 K/V pages of the KV block pool) is not in ``DTYPE_CODE`` (no kernel stores KT or
outputs in it): the fp8 paged kernels quantize through ``quantize_e4m3``, which clamps to +-448 first (as
``kernels/fp8.quantize_fp8``), so the rounding never meets a value e4m3 cannot hold.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# the tensor types a kernel takes raw pointers of: a subclass (DTensor, a quantized weight) is the caller's to handle
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

TORCH_TO_TL = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float8_e5m2: tl.float8e5,
}

# integer codes for the dtypes a kernel stores or computes in (passed as tl.constexpr)
DT_FP32, DT_FP16, DT_BF16, DT_FP8E5 = 0, 1, 2, 3
DT_FP8E4 = 4  # float8_e4m3fn: fp8 K/V pages only (see the module docstring)
DTYPE_CODE = {torch.float32: DT_FP32, torch.float16: DT_FP16, torch.bfloat16: DT_BF16, torch.float8_e5m2: DT_FP8E5}


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODE:
        raise TypeError(f"hf_rocketkv Triton kernels support {sorted(map(str, DTYPE_CODE))}, got {dtype}")
    return DTYPE_CODE[dtype]


# Triton decides when it decorates each kernel (at this package's import) whether the kernel runs under its
# interpreter; read once here too, so the launchers' checks (several per layer and decode step) cost no environment
# lookup and always agree with the kernels they launch
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether this process's kernels run under Triton's interpreter (TRITON_INTERPRET=1 when they were imported)."""
    return _INTERPRETING


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device``; a small stand-in on CPU (interpreter), so tests exercise split paths."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def count_strides(counts: torch.Tensor, batch: int, num_kv_heads: int, name: str) -> tuple[int, int]:
    """(row, KV head) strides of a per-row [B] or per-(row, KV head) [B, Hkv] count tensor: a [B] tensor gets a
    head stride of 0, so kernels always index ``counts[b * s_b + h * s_h]``."""
    if counts.dim() == 1 and counts.shape[0] == batch:
        return counts.stride(0), 0
    if counts.dim() == 2 and counts.shape[0] == batch and counts.shape[1] == num_kv_heads:
        return counts.stride(0), counts.stride(1)
    from ..selection.stage2_pages import per_head

    per_head(counts, batch, num_kv_heads, name)  # raises the shape error
    raise AssertionError("unreachable")


@triton.jit
def load_count(count_ptr, b, h, s_cb, s_ch, limit, COUNT_DIV: tl.constexpr):
    """counts[b, h] (stride 0 over heads for a [B] tensor) divided by COUNT_DIV rounding up, clamped to [0, limit]:
    with COUNT_DIV = page_size a token count becomes a page count (``num_pages``) without a separate launch."""
    c = tl.load(count_ptr + b * s_cb + h * s_ch).to(tl.int64)
    if COUNT_DIV != 1:
        c = (c + COUNT_DIV - 1) // COUNT_DIV
    return tl.minimum(tl.maximum(c, 0), limit).to(tl.int32)


def kernel_owns_count(seen: torch.Tensor, batch: int) -> bool:
    """Whether a one-program-per-row append kernel may advance ``seen`` itself: each row's program owns its count
    (one row, or ``[B]`` counts that are not one value broadcast over the rows); a count shared by several programs
    must be advanced outside the launch, since the others may still be reading it."""
    return batch == 1 or (seen.dim() == 1 and seen.stride(0) != 0)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1). Plain Python: triton's helpers are JIT callables (~10 us per host call)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """(page, KV head) strides of an fp8 page scale, ``[N]`` (head stride 0) or ``[N, Hkv]``; (0, 0) without one."""
    if scale is None:
        return 0, 0
    return scale.stride(0), scale.stride(1) if scale.dim() == 2 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch sizes (plain Python, see ``next_pow2``)."""
    return -(-a // b)


@triton.jit
def tanh_f32(x):
    """tanh of fp32 ``x`` from exp2 (no libdevice call, the same code on every Triton): ``1 - 2 / (e^2x + 1)``, which
    is +-1 in fp32 beyond |x| = 15, where ``x`` is clamped so that exp2 never overflows (logit soft-capping)."""
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _rtne_drop_bits(x, DROP: tl.constexpr):
    """fp32 ``x`` rounded to nearest even after clearing its DROP low mantissa bits (exact for finite normals)."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> DROP) & 1
    bits = (bits + ((1 << (DROP - 1)) - 1) + lsb) & (-(1 << DROP))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _with_sign_of(x, magnitude):
    """``magnitude`` (>= 0) with the sign bit of ``x``, set bitwise: Triton compiles ``-t`` as ``0 - t``, which turns
    a -0.0 into +0.0 on the GPU (the interpreter negates), and PyTorch keeps -0.0 when a tiny negative rounds to 0."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, DT: tl.constexpr):
    """fp32 ``x`` rounded to the value of dtype code DT that ``torch`` would produce, still as fp32."""
    if DT == 2:  # bfloat16: 7 stored mantissa bits, same exponent range as fp32 (subnormals included)
        y = _rtne_drop_bits(x, 16)
    elif DT == 3:  # float8_e5m2: 2 mantissa bits, normals from 2**-14, subnormal spacing 2**-16
        ax = tl.abs(x)
        normal = _rtne_drop_bits(x, 21)
        tiny = _with_sign_of(x, _rtne_drop_bits(ax + 6.103515625e-05, 21) - 6.103515625e-05)
        y = tl.where(ax < 6.103515625e-05, tiny, normal)
    elif DT == 4:  # float8_e4m3fn: 3 mantissa bits, normals from 2**-6, subnormal spacing 2**-9 (no inf; |x| <= 448)
        ax = tl.abs(x)
        normal = _rtne_drop_bits(x, 20)
        tiny = _with_sign_of(x, _rtne_drop_bits(ax + 0.015625, 20) - 0.015625)
        y = tl.where(ax < 0.015625, tiny, normal)
    elif DT == 1:  # float16: 10 mantissa bits, normals from 2**-14, subnormal spacing 2**-24 (>= 65520 -> inf
        # at the cast). Integer operations, not a float round trip: LLVM may narrow the arithmetic that produced x
        # to half precision and contract it into an FMA through fptrunc/fpext (seen on an H200), eager never does
        ax = tl.abs(x)
        normal = _rtne_drop_bits(x, 13)
        tiny = _with_sign_of(x, _rtne_drop_bits(ax + 6.103515625e-05, 13) - 6.103515625e-05)
        y = tl.where(ax < 6.103515625e-05, tiny, normal)
    else:
        y = x
    return y


@triton.jit
def cast_to(x, DT: tl.constexpr):
    """fp32 ``x`` converted to dtype code DT with PyTorch's rounding on every backend."""
    y = round_to(x, DT)
    if DT == 2:
        out = y.to(tl.bfloat16)
    elif DT == 3:
        out = y.to(tl.float8e5)
    elif DT == 4:
        out = y.to(tl.float8e4nv)
    elif DT == 1:
        out = y.to(tl.float16)
    else:
        out = y
    return out


@triton.jit
def quantize_e4m3(x, scale):
    """fp32 ``x / scale`` (IEEE division) clamped to +-448 and rounded to float8_e4m3fn: ``kernels/fp8.quantize_fp8``
    bit for bit."""
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return cast_to(y, 4)  # DT_FP8E4
