"""The eval metrics (eval/scoring.py) on strings whose scores are worked out by hand."""

from __future__ import annotations

import pytest

from hf_rocketkv.eval.scoring import qa_f1, score, string_match_all, string_match_part, substring


def test_scoring_functions():
    assert substring("The pass key is 12345.", ["12345"]) == 1.0
    assert substring("The pass key is 1234.", ["12345"]) == 0.0
    assert substring("ANSWER: Paris", ["paris"]) == 1.0
    assert string_match_part("x 7 y", ["7", "8"]) == 1.0
    assert string_match_all("AAA and CCC", ["AAA", "BBB", "CCC", "DDD"]) == 0.5
    assert string_match_all("anything", []) == 0.0
    assert qa_f1("the big red fox", ["a red fox"]) == pytest.approx(0.8)
    assert qa_f1("nothing", ["red fox"]) == 0.0
    assert score("string_match_all", "a b", ["a", "c"]) == 0.5
    with pytest.raises(ValueError, match="unknown metric"):
        score("bleu", "a", ["a"])
