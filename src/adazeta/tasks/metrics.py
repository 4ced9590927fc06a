"""Generation metrics: SQuAD's token F1 and exact match (Rajpurkar et al. 2016, the official v1.1 script).

MeZO scores SQuAD and DROP alike with these; the prediction is compared with every gold answer and the best
match counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, squeeze whitespace (SQuAD v1.1 normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall after normalisation; 1.0 when both normalise to empty."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def best_f1(prediction: str, answers: Sequence[str]) -> float:
    """F1 against the closest gold answer (0.0 when there is none)."""
    return max((token_f1(prediction, a) for a in answers), default=0.0)


def best_exact_match(prediction: str, answers: Sequence[str]) -> float:
    return max((exact_match(prediction, a) for a in answers), default=0.0)
