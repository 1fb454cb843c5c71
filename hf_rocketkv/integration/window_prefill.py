"""A sliding layer's prefill attention as one flash call with a window, on CUDA in 16-bit.

Why: transformers hands a sliding layer (Gemma 2/3, gpt-oss, Cohere 2, Mistral windows) a mask of the whole
``n x kv`` square and its sdpa runs under it, so a long prompt's sliding layers attend (or at least mask and copy) far
more than the ``n x window`` logits they can see; ``attend_in_spans`` (integration/attention.py) cuts that to query
spans, but each span is still an SDPA call under a materialised mask, with its grouped-query keys repeated per query
head. PyTorch's flash attention takes the window itself (``window_size_left`` / ``window_size_right`` of
``torch.ops.aten._flash_attention_forward``): one call per layer, no mask, grouped-query heads read in place, the
keys outside each query's window skipped block by block.

Where the mask is exactly the window's band. In flash's causal mode the right edge of each query's keys is aligned
to the bottom right when there are fewer queries than keys (PyTorch's flash_attn/mask.h: query row ``i`` of ``n``
sees key columns ``c`` with ``i + kv - n - window_size_left <= c <= i + kv - n + window_size_right``, and
``is_causal`` sets ``window_size_right = 0``). transformers' sliding mask (masking_utils
``sliding_window_causal_mask_function``) lets position ``q`` see positions ``k`` with ``q - W < k <= q``: ``W`` keys,
itself included. So with ``window_size_left = W - 1``, query ``j`` of a forward of ``n`` queries over ``kv`` keys (its
own token at column ``kv - n + j``, the stored window before the new tokens) sees columns
``kv - n + j - (W - 1) <= c <= kv - n + j``: the band. ``is_window_band`` checks that transformers' mask is exactly
that band in every row (no padding, nothing else masked) on the device, once per forward (``window_band`` memoises
the answer per mask object in the call's ``CallState``); anything else stays on the existing path.

Sinks (gpt-oss' learned per-head logits): flash returns each row's log-sum-exp ``lse`` of its scaled logits; the sink
is one more key with a zero value, so each row keeps the share ``exp(lse) / (exp(lse) + exp(sink))`` of its output
(``selection/logit_features.with_sinks``). Soft-capping (Gemma 2) is not an argument of this op: it stays on the
existing path.

Shapes: query ``[B, Hq, n, D]``, key / value ``[B, Hkv, kv, D]`` (``kv >= n``; query head ``h`` reads KV head
``h // (Hq / Hkv)``, which flash does natively); the op takes ``[B, L, H, D]`` (sequence before heads: the transposed
views, no copy) and returns ``[B, n, Hq, D]`` and ``lse`` ``[B, Hq, n]`` fp32; ``flash_window_attention`` returns
``[B, n, Hq, D]`` contiguous, what the attention module reshapes next. Masks are sdpa-style ``[B, 1, n, kv]``: bool
(True = may attend) or additive float (0 = may attend).
"""

from __future__ import annotations

import torch
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from ..selection.logit_features import LogitFeatures, with_sinks
from .call_state import call_state

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256  # flash's forward: head dims up to 256 ...
FLASH_HEAD_DIM_MULTIPLE = 8  # ... in multiples of 8
BAND_BLOCK_ELEMENTS = 1 << 26  # mask entries is_window_band compares at a time (64 MiB of bool temporaries)

# PyTorch's flash attention op, which takes a window (window_size_left / window_size_right, torch >= 2.4; the
# package's floor is 2.5) and returns each row's log-sum-exp (F.scaled_dot_product_attention takes neither)
_FLASH_FORWARD = getattr(torch.ops.aten, "_flash_attention_forward", None)
_TAKES_WINDOW = _FLASH_FORWARD is not None


def flash_window_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None,
                      features: LogitFeatures) -> bool:
    """Whether ``flash_window_attention`` may run this call (host-side shapes and flags only, no sync): a window, the
    op present, no soft-capping, more than one query (a decode step keeps its own kernels) and no more queries than
    keys, a head dim flash supports (at most ``FLASH_MAX_HEAD_DIM``, a multiple of ``FLASH_HEAD_DIM_MULTIPLE``),
    grouped-query heads that divide, and a device and dtype flash takes (``flash_device_runs``)."""
    if not _TAKES_WINDOW or window is None or isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return False
    if features.softcap is not None:
        return False
    n, kv, dim = query.shape[2], key.shape[2], query.shape[-1]
    if n < 2 or kv < n or dim > FLASH_MAX_HEAD_DIM or dim % FLASH_HEAD_DIM_MULTIPLE:
        return False
    if key.shape[-1] != dim or value.shape[-1] != dim or query.shape[1] % key.shape[1]:
        return False
    return flash_device_runs(query, key, value)


def flash_device_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether PyTorch's flash kernel takes these inputs on their device: CUDA, fp16 / bf16 alike, a contiguous last
    dim, and what PyTorch itself checks (the GPU's architecture among them; no sync). ``is_causal=False`` in the
    check, as torch.nn.attention.bias asks before its lower-right flash call: the check's causal flag means
    upper-left, which it refuses for fewer queries than keys."""
    if query.device.type != "cuda" or query.dtype not in FLASH_DTYPES:
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or any(t.stride(-1) != 1 for t in (query, key, value)):
        return False
    return can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, query.shape[1] != key.shape[1]))


def is_window_band(mask: torch.Tensor | None, n: int, kv: int, window: int) -> bool:
    """Whether ``mask`` (sdpa-style ``[B, 1, n, kv]``, bool or additive float) lets query ``j`` see exactly the key
    columns ``kv - n + j - (window - 1) <= c <= kv - n + j`` in every row: compared on the device with the band
    built from ``arange``, ``BAND_BLOCK_ELEMENTS`` mask entries at a time (a 128k prompt's mask is 15 GiB of bool: no
    temporary of its size), one sync at the end. ``None`` (transformers skipped the mask: the sdpa path reads it as
    causal, upper left) is the band only for a square forward no longer than the window, where causal is the band."""
    if mask is None:
        return n == kv and kv <= window
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (n, kv):
        return False
    rows = max(1, BAND_BLOCK_ELEMENTS // max(kv * mask.shape[0], 1))
    column = torch.arange(kv, device=mask.device)
    differs = torch.zeros((), dtype=torch.bool, device=mask.device)
    for start in range(0, n, rows):
        block = mask[:, :, start:start + rows]
        allowed = block if block.dtype == torch.bool else block == 0
        own = kv - n + torch.arange(start, start + block.shape[2], device=mask.device)  # each query's own column
        band = (column[None, :] <= own[:, None]) & (column[None, :] > own[:, None] - window)
        differs |= (allowed != band).any()
    return not bool(differs)


def window_band(layer, mask: torch.Tensor | None, n: int, kv: int, window: int) -> bool:
    """``is_window_band``, compared once per forward: every sliding layer of a forward gets the same mask object, so
    the answer is remembered in the call's ``CallState`` (``answer_of_mask``: a weak reference to the mask and the
    shapes it was asked for; a new forward's mask is a new object). A ``None`` mask needs no device and no memo."""
    if mask is None:
        return is_window_band(None, n, kv, window)
    return call_state(layer).answer_of_mask("band", mask, (n, kv, window),
                                            lambda: is_window_band(mask, n, kv, window))


def flash_window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                           window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query over the ``window`` keys ending at its own column (the band, module docstring) in one
    flash call, ``[B, n, Hq, D]`` contiguous. With ``sinks`` (``[Hq]`` logits) each row then keeps the share of its
    softmax that falls on real keys (``with_sinks``, from the log-sum-exp flash returns)."""
    n, kv = query.shape[2], key.shape[2]
    out, lse = _FLASH_FORWARD(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, n, kv,
                              0.0, True, False, scale=scaling, window_size_left=window - 1,
                              window_size_right=0)[:2]
    return out.contiguous() if sinks is None else with_sinks(out, lse, sinks)
