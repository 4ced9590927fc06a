"""Batched evaluation: many examples and all their candidates per forward, one host sync per split."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from adazeta.scoring import Batch, Scorer, objective_loss

if TYPE_CHECKING:
    from adazeta.generation import GenerationSet


@dataclass
class EvalResult:
    loss: float
    score: float  # the task's main metric (``metric``): accuracy, or F1 of the generations for generation tasks
    n: int
    metrics: dict[str, float] = field(default_factory=dict)  # generation tasks: f1 and em
    # Fraction of examples (with two or more candidates) whose candidates all score the same, to TIE_TOL: a
    # healthy model almost never ties; a model whose residual stream overflowed float32 (the final norm then
    # outputs zeros, every logit is 0) ties on every example, and its loss is exactly ln(#candidates).
    tied: float = 0.0
    metric: str = "accuracy"  # what ``score`` is: accuracy | f1

    @classmethod
    def restore(cls, state: dict) -> "EvalResult":
        """An EvalResult from its ``dataclasses.asdict`` (a checkpoint's; earlier releases named score accuracy)."""
        state = dict(state)
        if "accuracy" in state:
            state["score"] = state.pop("accuracy")
        return cls(**state)


TIE_TOL = 1e-6  # candidate scores (mean log-likelihoods or logits) this close count as equal


@torch.no_grad()
def evaluate(
    scorer: Scorer,
    batches: Sequence[Batch],
    generation: "GenerationSet | None" = None,
    desc: str | None = None,
) -> EvalResult:
    """Mean loss (the task's objective) and score over pre-collated batches (already on the model's device).

    The score is the accuracy; with ``generation`` (SQuAD, DROP) it is the F1 of greedy generations (``metric``
    says which), and F1 / EM go to ``metrics``.
    ``desc``: name of a progress bar over the batches, shown on a terminal (``tracking.show_progress``).
    """
    from tqdm.auto import tqdm

    from adazeta.tracking import show_progress

    model, objective = scorer.model, scorer.objective.kind
    was_training = model.training
    model.eval()
    loss_sum = correct = tied = multi = None
    n = 0
    shown = desc is not None and show_progress() and len(batches) > 1
    for batch in tqdm(batches, desc=desc, leave=False, dynamic_ncols=True, disable=not shown):
        scores = scorer.scores(batch)
        loss = objective_loss(scores, batch.gold, objective, reduction="sum")
        hits = (scores.argmax(dim=1) == batch.gold).sum()
        ties, several = tie_counts(scores)
        loss_sum = loss if loss_sum is None else loss_sum + loss
        correct = hits if correct is None else correct + hits
        tied = ties if tied is None else tied + ties
        multi = several if multi is None else multi + several
        n += batch.num_examples
    metrics = {}
    if generation is not None:
        from adazeta.generation import generation_metrics

        metrics = generation_metrics(model, generation)
    model.train(was_training)
    metric = "f1" if generation is not None else "accuracy"
    if n == 0:
        return EvalResult(float("nan"), float("nan"), 0, metric=metric)
    score = metrics["f1"] if generation is not None else float(correct) / n  # the one sync point
    tied_fraction = float(tied) / float(multi) if float(multi) else 0.0
    return EvalResult(float(loss_sum) / n, score, n, metrics, tied_fraction, metric)


def tie_counts(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(examples whose finite candidate scores are all within TIE_TOL, examples with >= 2 finite candidates)."""
    finite = torch.isfinite(scores)
    hi = scores.masked_fill(~finite, float("-inf")).amax(dim=1)
    lo = scores.masked_fill(~finite, float("inf")).amin(dim=1)
    several = finite.sum(dim=1) >= 2
    return ((hi - lo <= TIE_TOL) & several).sum(), several.sum()
