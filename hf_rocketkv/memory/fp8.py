"""fp8 (e4m3) KV storage: the PyTorch reference of quantize / dequantize with per-page or per-head scales.

The arithmetic lives in ``kernels/fp8.py`` (the kernels that read and write fp8 pages match it, and kernels sit below
the memory layer); the pool and its tests use it from here.
"""

from ..kernels.fp8 import (  # noqa: F401
    FP8_DTYPE, FP8_MAX, SCALE_DTYPE, SCALE_GRANULARITIES, dequantize_fp8, fp8_scales, quantize_fp8, quantize_pages)
