"""Batched evaluation: many examples and all their candidates per forward, one host sync per split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from adazeta.scoring import Batch, candidate_scores, classification_loss


@dataclass
class EvalResult:
    loss: float
    accuracy: float
    n: int


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch], family: str) -> EvalResult:
    """Mean candidate cross-entropy and accuracy over pre-collated batches (already on the model's device)."""
    was_training = model.training
    model.eval()
    loss_sum = correct = None
    n = 0
    for batch in batches:
        scores = candidate_scores(model, batch, family)
        loss = classification_loss(scores, batch.gold, reduction="sum")
        hits = (scores.argmax(dim=1) == batch.gold).sum()
        loss_sum = loss if loss_sum is None else loss_sum + loss
        correct = hits if correct is None else correct + hits
        n += batch.num_examples
    model.train(was_training)
    if n == 0:
        return EvalResult(float("nan"), float("nan"), 0)
    return EvalResult(float(loss_sum) / n, float(correct) / n, n)  # the one sync point
