"""Step-level records of one generate() call, shared by the tensor-parallel worker and its single-process oracle.

``record_steps(model, cache, input_ids, attention_mask, new_tokens, pad)`` runs greedy generate and returns, in
float32: the kept positions of every (layer, row, KV head) after stage 1, for the first decode steps the pages
stage 2 selected per (layer, row, KV head) with the score gap around the top-k boundary (so a mismatch can be told
from a tie), and the logits of those steps.
"""

from __future__ import annotations

import torch

from hf_rocketkv import RocketKVLayer
from hf_rocketkv.selection.stage2_pages import num_pages, page_scores

RECORDED_STEPS = 3


def record_steps(model, cache, input_ids, attention_mask, new_tokens: int, pad: int) -> dict:
    steps: list[list] = []
    original = RocketKVLayer.attend_decode

    def recording(layer, query, scaling):
        if len(steps) < RECORDED_STEPS * len(cache.layers):
            batch, heads, _, dim = query.shape
            q = query.reshape(batch, layer.keys.shape[1], heads // layer.keys.shape[1], dim)
            config = layer.config
            n_pages = num_pages(layer.lengths, config.page_size)
            probs = page_scores(q, layer.kt, n_pages, config.topr)
            page_idx, valid = layer.ops.top_pages(q, layer.kt, layer.lengths, config.page_size, config.topr,
                                                  config.topk)
            chosen = [[sorted(int(p) for p, ok in zip(page_idx[b, h], valid[b, h]) if ok)
                       for h in range(q.shape[1])] for b in range(batch)]
            margins = []
            for b in range(batch):
                row = []
                for h in range(q.shape[1]):
                    scores = probs[b, h, : int(n_pages[b])].sort(descending=True).values
                    k = min(config.topk, scores.numel())
                    row.append(float(scores[k - 2] - scores[k - 1]) if 1 < k < scores.numel() else 1.0)
                margins.append(row)
            steps.append(dict(layer=cache.layers.index(layer), pages=chosen, margins=margins))
        return original(layer, query, scaling)

    RocketKVLayer.attend_decode = recording
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=new_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=pad, output_logits=True,
                return_dict_in_generate=True,
                disable_compile=True,  # eager decode steps (on a GPU too): the recording runs at every step
            )
    finally:
        RocketKVLayer.attend_decode = original
    kept = []
    for i, layer in enumerate(cache.layers):
        positions = cache.kept_positions(i)
        kept.append([[positions[b, h, : int(layer.lengths[b])].tolist() for h in range(positions.shape[1])]
                     for b in range(positions.shape[0])])
    return dict(
        tokens=out.sequences.tolist(),
        logits=[out.logits[s].tolist() for s in range(min(RECORDED_STEPS + 1, len(out.logits)))],
        kept=kept,
        steps=steps,
    )
