"""The eval metrics (eval/scoring.py) on strings whose scores are worked out by hand, and the fidelity metrics
(top-1 agreement, KL(full || method), next-token accuracy) on hand-made distributions and against a plain-Python
float64 reference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hf_rocketkv.eval.scoring import fidelity_metrics, qa_f1, score, string_match_all, string_match_part, substring


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


def test_scores_where_found_and_missing_do_not_mirror():
    """Cases whose score changes if found and missing references swap, or precision and recall do (the cases above
    score 0.5 and recall 1 either way): expected values by hand."""
    assert string_match_all("AAA, BBB and CCC", ["AAA", "BBB", "CCC", "DDD"]) == 0.75  # 3 of 4
    assert string_match_all("nothing here", ["AAA", "BBB", "CCC", "DDD"]) == 0.0
    # pred [red], ref [red, fox]: precision 1, recall 1/2, F1 = 2 * 1 * 0.5 / 1.5 = 2/3
    assert qa_f1("red", ["red fox"]) == pytest.approx(2 / 3)
    # pred [big, red, fox, runs], ref [red, fox]: precision 1/2, recall 1, F1 = 2/3
    assert qa_f1("big red fox runs", ["red fox"]) == pytest.approx(2 / 3)
    # the best reference counts wherever it is: a first reference with nothing in common does not end the search
    assert qa_f1("red fox", ["blue whale", "red fox"]) == 1.0
    assert qa_f1("red fox", ["blue whale", "red", "fox red"]) == 1.0


# ------------------------------------------------------------------------------------------------ fidelity metrics
# Hand-made next-token distributions over 3 tokens at 3 positions (full cache P, method Q). Worked out by hand:
#   position 0: KL = 0.5 ln(0.5/0.8) + 2 * 0.25 ln(0.25/0.1) = 0.5 ln(1.5625); argmax 0 and 0 (agree)
#   position 1: Q = P, KL = 0; argmax 1 and 1 (agree)
#   position 2: KL = 0.7 ln(0.7/0.2) + 0.2 ln(0.2/0.7) + 0 = 0.5 ln(3.5); argmax 0 and 1 (disagree)
# KL(Q || P) differs at position 0 (0.8 ln 1.6 + 0.2 ln 0.4), so the direction is checked too.
FULL = [[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [0.7, 0.2, 0.1]]
METHOD = [[0.8, 0.1, 0.1], [0.1, 0.6, 0.3], [0.2, 0.7, 0.1]]
TARGET = [2, 2, 1]  # the method's argmax [0, 1, 1] hits position 2 only; the full cache's [0, 1, 0] none
KL_BY_HAND = [0.5 * math.log(1.5625), 0.0, 0.5 * math.log(3.5)]


def log_of(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


def test_fidelity_metrics_on_hand_made_distributions():
    got = fidelity_metrics(log_of(FULL), log_of(METHOD), torch.tensor(TARGET))
    assert got["top1_agreement"] == pytest.approx(2 / 3)
    assert got["next_token_accuracy"] == pytest.approx(1 / 3)
    assert got["mean_kl"] == pytest.approx(sum(KL_BY_HAND) / 3, rel=1e-12)
    assert got["max_kl"] == pytest.approx(0.5 * math.log(3.5), rel=1e-12)
    assert got["mean_kl"] != pytest.approx((0.8 * math.log(1.6) + 0.2 * math.log(0.4) + 0.5 * math.log(3.5)) / 3)


def test_fidelity_metrics_of_identical_distributions():
    got = fidelity_metrics(log_of(FULL), log_of(FULL), torch.tensor(TARGET))
    assert got == {"top1_agreement": 1.0, "mean_kl": 0.0, "max_kl": 0.0, "next_token_accuracy": 0.0}


def test_kl_counts_nothing_for_tokens_the_full_cache_rules_out():
    """0 * log 0 = 0: a token of probability 0 under the full cache adds nothing (not NaN); the method giving 0 to a
    token the full cache allows makes KL infinite."""
    full, method = log_of([[0.0, 0.5, 0.5]]), log_of([[0.5, 0.25, 0.25]])
    assert fidelity_metrics(full, method, torch.tensor([1]))["mean_kl"] == pytest.approx(math.log(2))
    assert fidelity_metrics(method, full, torch.tensor([1]))["mean_kl"] == math.inf


def kl_float64(p_rows, q_rows):
    """KL(P || Q) per row, from the definition, in plain Python floats."""
    return [sum(p * math.log(p / q) for p, q in zip(ps, qs) if p > 0) for ps, qs in zip(p_rows, q_rows)]


@pytest.mark.parametrize("seed", range(4))
def test_fidelity_metrics_match_a_float64_reference_on_random_distributions(seed):
    """float32 log-softmax rows as the eval produces them, against plain-Python KL, argmax and accuracy."""
    generator = torch.Generator().manual_seed(seed)
    positions, vocab = 17, 50
    full = torch.log_softmax(3 * torch.randn(positions, vocab, generator=generator), dim=-1)
    method = torch.log_softmax(full + torch.randn(positions, vocab, generator=generator), dim=-1)
    target = torch.randint(vocab, (positions,), generator=generator)
    p_rows, q_rows = full.double().exp().tolist(), method.double().exp().tolist()
    kl = kl_float64(p_rows, q_rows)
    top = [max(range(vocab), key=row.__getitem__) for row in q_rows]
    top_full = [max(range(vocab), key=row.__getitem__) for row in p_rows]
    got = fidelity_metrics(full, method, target)
    assert got["mean_kl"] == pytest.approx(sum(kl) / positions, rel=1e-4)
    assert got["max_kl"] == pytest.approx(max(kl), rel=1e-4)
    assert got["top1_agreement"] == pytest.approx(sum(a == b for a, b in zip(top, top_full)) / positions)
    assert got["next_token_accuracy"] == pytest.approx(sum(a == t for a, t in zip(top, target.tolist())) / positions)


def test_fidelity_metrics_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[P, V\]"):
        fidelity_metrics(log_of(FULL), log_of(FULL)[:2], torch.tensor(TARGET))
    with pytest.raises(ValueError, match=r"target \[P\]"):
        fidelity_metrics(log_of(FULL), log_of(FULL), torch.tensor(TARGET[:2]))


def test_run_fidelity_sample_reports_each_method_against_the_full_cache(monkeypatch):
    """The runner's records (eval/runner.py) from hand-made log-probs: the reference is the full cache's, whatever
    the order of the methods, and each method's numbers are its own."""
    from hf_rocketkv import RocketKVConfig
    from hf_rocketkv.eval import decode, runner
    from hf_rocketkv.eval.methods import build_methods
    from hf_rocketkv.eval.tasks.base import FidelitySample

    table = {"full": FULL, "stage1": METHOD, "stage2": FULL}
    monkeypatch.setattr(decode, "shared_prefix", lambda model, ids, tail: None)
    monkeypatch.setattr(decode, "prefill", lambda model, method, prefix, n: SimpleNamespace(cache=method.name))
    monkeypatch.setattr(decode, "kept_tokens_per_layer", lambda cache: [10, 10])
    monkeypatch.setattr(decode, "teacher_forced_log_probs",
                        lambda model, prefilled, start, ids: iter(log_of(table[prefilled.cache]).float()))
    model = torch.nn.Linear(1, 1)
    sample = FidelitySample("fidelity", 0, context_ids=[5] * 8, continuation_ids=TARGET)
    methods = build_methods(["stage1", "full", "stage2"], RocketKVConfig())
    records = {r["method"]: r for r in runner.run_fidelity_sample(model, sample, methods)}
    assert set(records) == {"stage1", "full", "stage2"}
    assert records["stage1"]["top1_agreement"] == pytest.approx(2 / 3)
    assert records["stage1"]["mean_kl"] == pytest.approx(sum(KL_BY_HAND) / 3, rel=1e-6)
    assert records["stage1"]["max_kl"] == pytest.approx(0.5 * math.log(3.5), rel=1e-6)
    assert records["stage1"]["next_token_accuracy"] == pytest.approx(1 / 3)
    for name in ("full", "stage2"):
        assert records[name]["top1_agreement"] == 1.0 and records[name]["mean_kl"] == 0.0
        assert records[name]["next_token_accuracy"] == 0.0
    assert records["stage1"]["positions"] == 3 and records["stage1"]["context_tokens"] == 8
