"""Scores of one prediction against its reference answers, all in [0, 1]; and the fidelity metrics of a method's
next-token distributions against the full cache's (``fidelity_metrics``).

substring           1 if any reference occurs in the prediction (case-insensitive). Passkey and LongBench default.
string_match_part   RULER's metric for QA tasks: 1 if any reference occurs (same as substring).
string_match_all    RULER's metric for the other tasks: fraction of the references that occur.
qa_f1               LongBench's token-level F1 (max over references), for free-form answers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable

import torch


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def substring(prediction: str, answers: list[str]) -> float:
    pred = _norm(prediction)
    return float(any(_norm(a) in pred for a in answers if a.strip()))


def string_match_part(prediction: str, answers: list[str]) -> float:
    return substring(prediction, answers)


def string_match_all(prediction: str, answers: list[str]) -> float:
    refs = [a for a in answers if a.strip()]
    if not refs:
        return 0.0
    pred = _norm(prediction)
    return sum(_norm(a) in pred for a in refs) / len(refs)


def _f1_tokens(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def qa_f1(prediction: str, answers: list[str]) -> float:
    best = 0.0
    pred = _f1_tokens(prediction)
    for answer in answers:
        ref = _f1_tokens(answer)
        common = Counter(pred) & Counter(ref)
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(pred), same / len(ref)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


METRICS: dict[str, Callable[[str, list[str]], float]] = {
    "substring": substring,
    "string_match_part": string_match_part,
    "string_match_all": string_match_all,
    "qa_f1": qa_f1,
}


def score(metric: str, prediction: str, answers: list[str]) -> float:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {sorted(METRICS)}")
    return METRICS[metric](prediction, answers)


def fidelity_metrics(reference: torch.Tensor, log_probs: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """A method's next-token log-probabilities ``log_probs`` against the full cache's ``reference``, both ``[P, V]``
    (natural logs, every row a distribution), at P teacher-forced positions whose true next tokens are ``target``
    ``[P]``. The fidelity task's numbers (docs/accuracy.md):

    top1_agreement       fraction of positions where the method's most likely token is the full cache's
                         (``argmax``: the lowest index among equal maxima)
    mean_kl, max_kl      KL(full || method) = sum_v p_full(v) * (log p_full(v) - log p_method(v)) per position, in
                         nats, its mean and max over the positions (a token the full cache gives probability 0
                         adds 0)
    next_token_accuracy  fraction of positions where the method's most likely token is ``target``
    """
    if reference.shape != log_probs.shape or reference.dim() != 2 or target.shape != reference.shape[:1]:
        raise ValueError(f"fidelity_metrics needs reference and log_probs [P, V] and target [P], got "
                         f"{tuple(reference.shape)}, {tuple(log_probs.shape)} and {tuple(target.shape)}")
    p_full = reference.exp()
    kl = torch.where(p_full > 0, p_full * (reference - log_probs), 0.0).sum(-1)
    method_top = log_probs.argmax(-1)
    return {
        "top1_agreement": float((method_top == reference.argmax(-1)).float().mean()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "next_token_accuracy": float((method_top == target).float().mean()),
    }
