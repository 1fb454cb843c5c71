"""The tensor-parallel step checks' tie rule (tp_steps.pages_differ_beyond_ties) on hand-made page scores: a swap
of pages whose scores agree to rounding is a tie at any scale, a swap across a real gap is not, however small the
scores (the absolute 1e-6 margin it replaces excused every swap among scores below 1e-6)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.tp_steps import TIE_ULPS, pages_differ_beyond_ties, score_noise, tie_tolerance

F32_EPS = 2.0**-23  # float32's machine epsilon (IEEE 754 binary32: 23 fraction bits)


def test_tolerance_is_ulps_of_the_dtype():
    assert tie_tolerance(torch.float32) == TIE_ULPS * F32_EPS
    assert tie_tolerance(torch.bfloat16, ulps=1) == 2.0**-7
    assert tie_tolerance(torch.float32, ulps=4) == 4 * F32_EPS


def test_equal_sets_agree_whatever_the_scores():
    assert pages_differ_beyond_ties([0, 3, 5], [0, 3, 5], [0.0] * 6) is None
    assert pages_differ_beyond_ties([], [], []) is None


@pytest.mark.parametrize("scale", [1e-12, 1e-9, 2e-3, 0.5])
def test_swap_of_scores_equal_to_rounding_is_a_tie_at_every_scale(scale):
    # pages 1 and 2 score alike up to 100 ulps of their own size, page 0 is forced in both
    a, b = scale, scale * (1 - 100 * F32_EPS)
    scores = [0.9, a, b, scale / 4]
    assert pages_differ_beyond_ties([0, 2], [0, 1], scores) is None
    assert pages_differ_beyond_ties([0, 1], [0, 2], scores) is None


@pytest.mark.parametrize("scale", [1e-12, 1e-9, 2e-3, 0.5])
def test_swap_across_a_real_gap_is_no_tie_at_any_scale(scale):
    # a 1e-3 relative gap (8,389 ulps): far more than rounding; at 1e-9 the gap is 1e-12 absolute, which a fixed
    # 1e-6 margin took for a tie
    scores = [0.9, scale, scale * (1 - 1e-3), scale / 4]
    why = pages_differ_beyond_ties([0, 2], [0, 1], scores)
    assert why is not None and "page 1" in why and "page 2" in why


def test_margin_sits_at_the_tolerance():
    tol = TIE_ULPS * F32_EPS
    inside = [1.0, 1.0 - 0.5 * tol]
    outside = [1.0, 1.0 - 2 * tol]
    assert pages_differ_beyond_ties([1], [0], inside) is None
    assert pages_differ_beyond_ties([1], [0], outside) is not None


def test_every_swapped_pair_must_tie():
    # pages 1, 2 swapped for 3, 4: page 2 ties page 3 but page 1 is far above page 4
    scores = [1.0, 0.5, 0.3, 0.3, 0.1]
    assert pages_differ_beyond_ties([0, 3, 4], [0, 1, 2], scores) is not None
    tied = [1.0, 0.3, 0.3, 0.3, 0.3]
    assert pages_differ_beyond_ties([0, 3, 4], [0, 1, 2], tied) is None


def test_another_page_count_is_no_tie():
    assert "2 pages against 3" in pages_differ_beyond_ties([0, 1], [0, 1, 2], [0.5, 0.5, 0.5])


def test_a_swap_the_other_runs_scores_explain_is_a_tie():
    # the reference ranks page 1 over page 2 by 1e-3 relative; the other run's scores are 6e-4 off on each and rank
    # page 2 first, so it took page 2: within twice their disagreement (the most a flip can need), a tie
    want = [0.9, 0.5, 0.4995, 0.1]
    got = [0.9, 0.5 - 3e-4, 0.4995 + 3e-4, 0.1]
    assert score_noise(got, want) == pytest.approx(3e-4)
    assert pages_differ_beyond_ties([0, 2], [0, 1], want) is not None  # rounding alone cannot explain it
    assert pages_differ_beyond_ties([0, 2], [0, 1], want, got_scores=got) is None


def test_a_swap_beyond_twice_the_disagreement_is_no_tie():
    # the other run's scores agree to 1e-5 but it took a page 0.1 below: its selection did not follow its scores
    want = [0.9, 0.5, 0.4, 0.1]
    got = [0.9 + 1e-5, 0.5, 0.4 - 1e-5, 0.1]
    why = pages_differ_beyond_ties([0, 2], [0, 1], want, got_scores=got)
    assert why is not None and "twice the runs' score disagreement" in why


def test_score_noise_is_the_largest_disagreement_and_needs_every_page():
    assert score_noise([0.5, 0.25, 0.25], [0.5, 0.2, 0.3]) == pytest.approx(0.05)
    assert score_noise([], []) == 0.0
    with pytest.raises(ValueError, match="2 page scores against 3"):
        score_noise([0.5, 0.5], [0.3, 0.3, 0.4])
