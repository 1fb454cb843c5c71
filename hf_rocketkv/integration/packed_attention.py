"""The attention of a packed forward (``cache/packed_step.py``): decoding rows and a prompt chunk in one row.

``rocketkv_attention`` hands a call whose keys came from a ``PackedStepCache`` here. The packed queries
``[1, Hq, D + C, d]`` are split as the cache split the keys: the first ``D`` become one query per decoding row
``[D, Hq, 1, d]`` and go through the batch layer's decode path (stage 2, or the ring of a sliding-window layer, with
no mask: the rows' lengths say what each row holds), the last ``C`` through the prefilling cache's layer with the
chunk's own mask (exact causal attention, stage 1 where the prompt ends). The outputs are put back in the packed
order, ``[1, D + C, Hq, d]``.
"""

from __future__ import annotations

import torch

from ..cache.packed_step import PackedLayer


def packed_attention(attend, module: torch.nn.Module, query: torch.Tensor, layer: PackedLayer,
                     attention_mask: torch.Tensor | None, scaling: float | None, dropout: float,
                     **kwargs) -> torch.Tensor:
    """``attend`` (the ``rocketkv`` attention function) once over the decoding rows and once over the chunk;
    ``[1, D + C, Hq, d]``."""
    (dk, dv), (ck, cv) = layer.take()
    rows = layer.rows
    decode_query = query[0, :, :rows].transpose(0, 1).unsqueeze(2).contiguous()  # [D, Hq, 1, d]
    decoded, _ = attend(module, decode_query, dk, dv, None, scaling, dropout, **kwargs)  # [D, 1, Hq, d]
    mask = layer.step.chunk_mask(attention_mask, ck.shape[2], layer.layer_idx)
    prefilled, _ = attend(module, query[:, :, rows:], ck, cv, mask, scaling, dropout, **kwargs)  # [1, C, Hq, d]
    return torch.cat([decoded.reshape(1, rows, *decoded.shape[2:]), prefilled], dim=1)
