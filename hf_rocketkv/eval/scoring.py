"""Scores of one prediction against its reference answers, all in [0, 1].

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
