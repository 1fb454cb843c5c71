"""Step-level records of one generate() call, shared by the tensor-parallel workers and their single-process oracle,
and the tie rule that compares them.

``record_steps(model, cache, input_ids, attention_mask, new_tokens, pad)`` runs greedy generate and returns, in
float32: the kept positions of every (layer, row, KV head) after stage 1, for the first decode steps the pages
stage 2 selected per (layer, row, KV head) (with the cache's forced sink and recent pages) and the scores of every
page in use (so a mismatch can be told from a tie), and the logits of those steps.

``pages_differ_beyond_ties(got, want, scores, dtype, got_scores=...)`` is the tie rule. Two runs that compute the same scores with
another reduction order (tensor-parallel shards and an all-reduce against one process) may swap pages whose scores
are equal up to rounding, and nothing else: every page one run took and the other left out must score within
``TIE_ULPS`` units of ``dtype``'s epsilon, relative to the larger of the two scores, of a page taken in its place.
The margin is relative because page scores are softmax probabilities whose size falls with the number of pages
(1/NP on a flat row: ~2e-3 at 512 pages, ~1e-9 for a page far below the top): a fixed absolute margin excuses any
swap among small scores (a bug) and no swap among large ones. 1,024 float32 ulps is 1.2e-4 relative, the tolerance
the tests hold the logits to. Deeper layers of a random model amplify the shards' reduction-order differences: on
two H100s (float32, 4 layers, 8k tokens) a layer-3 swap of pages 1.5e-3 apart relative broke that margin. So where
both runs' scores are known, a swap is also a tie when the gap is within twice the runs' measured score
disagreement on that head (exact: the other run chose by its own scores), and the disagreement itself is held to
``NOISE_REL`` of the head's largest score (a wrong head or page map disagrees by the scores' own size).
"""

from __future__ import annotations

import torch

from hf_rocketkv import RocketKVLayer
from hf_rocketkv.selection.stage2_pages import num_pages, page_scores

RECORDED_STEPS = 3
TIE_ULPS = 1024
NOISE_REL = 0.02  # the most two runs' page scores of one head may disagree, relative to its largest score


def tie_tolerance(dtype: torch.dtype = torch.float32, ulps: int = TIE_ULPS) -> float:
    """The relative score gap still counted as a tie: ``ulps`` units of ``dtype``'s machine epsilon."""
    return ulps * torch.finfo(dtype).eps


def pages_differ_beyond_ties(got: list[int], want: list[int], scores: list[float],
                             dtype: torch.dtype = torch.float32, ulps: int = TIE_ULPS,
                             got_scores: list[float] | None = None) -> str | None:
    """None when page set ``got`` equals ``want`` up to ties, else why not.

    ``scores`` are the reference run's page scores (index = page id), ``got_scores`` (optional) the other run's. A
    tie swap replaces a page ``a`` of ``want`` by a page ``b`` of ``got`` with ``scores[a] - scores[b]`` within the
    margin: ``tol * max(|scores[a]|, |scores[b]|)`` (``tol = tie_tolerance(dtype, ulps)``: rounding alone), or, with
    ``got_scores``, twice the two runs' largest score disagreement on this head (``score_noise``), if that is
    larger. The second term is exact, not a guess: the other run took ``b`` over ``a``, so ``got_scores[b] >=
    got_scores[a]``, and then ``scores[a] - scores[b] <= |scores[a] - got_scores[a]| + |got_scores[b] -
    scores[b]| <= 2 * noise``; a swap across a wider gap means a selection that did not follow its own scores.
    (That the noise itself stays small is ``score_noise``'s caller's check.) Both sets must hold as many pages."""
    only_want, only_got = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if len(got) != len(want) or len(only_want) != len(only_got):
        return f"{len(got)} pages against {len(want)}"
    tol = tie_tolerance(dtype, ulps)
    noise = score_noise(got_scores, scores) if got_scores is not None else 0.0
    for a in only_want:
        for b in only_got:
            gap, scale = scores[a] - scores[b], max(abs(scores[a]), abs(scores[b]))
            if gap > max(tol * scale, 2 * noise):
                return (f"page {a} (score {scores[a]:.9g}) swapped for page {b} (score {scores[b]:.9g}): relative "
                        f"gap {gap / scale:.3g} > {tol:.3g}, and gap {gap:.3g} > twice the runs' score "
                        f"disagreement {noise:.3g}")
    return None


def score_noise(got_scores: list[float], want_scores: list[float]) -> float:
    """The two runs' largest disagreement on one head's page scores (absolute); both list every page in use."""
    if len(got_scores) != len(want_scores):
        raise ValueError(f"score_noise: {len(got_scores)} page scores against {len(want_scores)}")
    return max((abs(g - w) for g, w in zip(got_scores, want_scores)), default=0.0)


def record_steps(model, cache, input_ids, attention_mask, new_tokens: int, pad: int) -> dict:
    steps: list[list] = []
    original = RocketKVLayer.attend_decode

    def recording(layer, query, scaling):
        if len(steps) < RECORDED_STEPS * len(cache.layers):
            batch, heads, _, dim = query.shape
            q = query.reshape(batch, layer.keys.shape[1], heads // layer.keys.shape[1], dim)
            config = layer.config
            sink_pages, recent_pages = config.stage2_forced_pages
            n_pages = num_pages(layer.lengths, config.page_size)
            probs = page_scores(q, layer.kt, n_pages, config.topr, config.stage2_per_head_bound)
            page_idx, valid = layer.ops.top_pages(q, layer.kt, layer.lengths, config.page_size, config.topr,
                                                  config.topk, sink_pages=sink_pages, recent_pages=recent_pages,
                                                  per_head_bound=config.stage2_per_head_bound)
            chosen = [[sorted(int(p) for p, ok in zip(page_idx[b, h], valid[b, h]) if ok)
                       for h in range(q.shape[1])] for b in range(batch)]
            scores = [[probs[b, h, : int(n_pages[b])].tolist() for h in range(q.shape[1])] for b in range(batch)]
            steps.append(dict(layer=cache.layers.index(layer), pages=chosen, scores=scores))
        return original(layer, query, scaling)

    RocketKVLayer.attend_decode = recording
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=attention_mask, cache=cache, max_new_tokens=new_tokens,
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
