"""Batched evaluation: many examples and all their candidates per forward, one host sync per split."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from adazeta.scoring import Batch, Scorer, gold_lengths, objective_loss

if TYPE_CHECKING:
    import numpy as np

    from adazeta.scoring.generation import GenerationSet


@dataclass
class Predictions:
    """One evaluation's per-example results, in the split's order, so that two runs on the same examples can be
    compared example by example (paired tests: ``adazeta.stats``).

    ``scores[i]`` holds example i's candidate scores (length-normalised log-likelihoods, or logits for a masked
    LM; log-probabilities for the linear probe), one per candidate; ``pred`` the argmax, ``gold`` the gold index.
    Generation tasks (SQuAD, DROP) have no candidate scores: ``texts`` holds each greedy answer and ``f1`` /
    ``em`` its scores against the gold answers; ``pred`` and ``gold`` are then empty.
    """

    gold: list[int] = field(default_factory=list)
    pred: list[int] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)
    texts: list[str] | None = None
    f1: list[float] | None = None
    em: list[float] | None = None

    @property
    def correct(self) -> list[float]:
        """Per example: 1.0 / 0.0 for a classification, the F1 of its answer for a generation task."""
        if self.f1 is not None:
            return list(self.f1)
        return [float(p == g) for p, g in zip(self.pred, self.gold)]

    def __len__(self) -> int:
        return len(self.f1) if self.f1 is not None else len(self.gold)

    @classmethod
    def from_scores(cls, scores: "np.ndarray | list[list[float]]", gold: Sequence[int]) -> "Predictions":
        rows = [[float(v) for v in row] for row in scores]
        return cls([int(g) for g in gold], [max(range(len(r)), key=r.__getitem__) for r in rows], rows)


@dataclass
class Dependence:
    """How much one evaluation's answers depend on its input, from its per-example candidate scores.

    A model that collapsed to one answer (a first-order TT run that answers every sentence "positive", its dev loss
    near ln 2) can still score its candidates apart, so it ties on no example: what gives it away is that the answer,
    and the gap between the candidates' scores, hardly move from one example to the next. Measured over the examples
    with the split's usual number of candidates (all of them for a classification task), every score finite.
    """

    examples: int  # examples measured
    answer: int  # the candidate (by position) answered most often
    answer_share: float  # share of the measured examples that give that answer
    gold_share: float  # share of them whose gold answer it is: how skewed the labels are towards it
    # sqrt(mean over candidates j >= 1 of the variance across examples of score_j - score_0): for two candidates,
    # the standard deviation of the score gap; 0 when every example scores its candidates the same way.
    gap_std: float


def dependence(predictions: Predictions | None) -> Dependence | None:
    """The input dependence of kept ``predictions`` (None for a generation task, or fewer than two examples with
    two or more candidates)."""
    if predictions is None or not predictions.scores:
        return None
    k = max(len(row) for row in predictions.scores)
    rows = [i for i, row in enumerate(predictions.scores) if len(row) == k]
    if k < 2 or len(rows) < 2:
        return None
    scores = torch.tensor([predictions.scores[i] for i in rows], dtype=torch.float64)
    keep = torch.isfinite(scores).all(dim=1)
    if int(keep.sum()) < 2:
        return None
    scores, pred = scores[keep], torch.tensor([predictions.pred[i] for i in rows])[keep]
    gold = torch.tensor([predictions.gold[i] for i in rows])[keep]
    answer = int(torch.bincount(pred, minlength=k).argmax())
    gaps = scores[:, 1:] - scores[:, :1]
    return Dependence(examples=len(pred), answer=answer, answer_share=float((pred == answer).double().mean()),
                      gold_share=float((gold == answer).double().mean()),
                      gap_std=float(gaps.var(dim=0, unbiased=False).mean().sqrt()))


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
    predictions: Predictions | None = None  # per example, when ``evaluate`` was asked to keep them
    dependence: Dependence | None = None  # how much the answers depend on the input (kept classification scores)

    @classmethod
    def restore(cls, state: dict) -> "EvalResult":
        """An EvalResult from its ``dataclasses.asdict`` (a checkpoint's; earlier releases named score accuracy)."""
        state = dict(state)
        if "accuracy" in state:
            state["score"] = state.pop("accuracy")
        if isinstance(state.get("predictions"), dict):
            state["predictions"] = Predictions(**state["predictions"])
        if isinstance(state.get("dependence"), dict):
            state["dependence"] = Dependence(**state["dependence"])
        return cls(**state)


TIE_TOL = 1e-6  # candidate scores (mean log-likelihoods or logits) this close count as equal


@torch.no_grad()
def evaluate(
    scorer: Scorer,
    batches: Sequence[Batch],
    generation: "GenerationSet | None" = None,
    desc: str | None = None,
    keep: bool = False,
) -> EvalResult:
    """Mean loss (the task's objective) and score over pre-collated batches (already on the model's device).

    The score is the accuracy; with ``generation`` (SQuAD, DROP) it is the F1 of greedy generations (``metric``
    says which), and F1 / EM go to ``metrics``.
    ``desc``: name of a progress bar over the batches, shown on a terminal (``tracking.show_progress``).
    ``keep``: also return the per-example ``Predictions``, in the split's order (each batch's ``index``); their
    scores leave the device once, at the end, with the other totals.
    """
    from tqdm.auto import tqdm

    from adazeta.tracking import EvalProgress, show_progress

    model, objective = scorer.model, scorer.objective.kind
    was_training = model.training
    model.eval()
    loss_sum = correct = tied = multi = weight_sum = None
    n = 0
    kept: list[tuple[Batch, torch.Tensor]] = []
    bars = desc is not None and show_progress()
    shown = bars and len(batches) > 1
    # Without a bar (a log file, CI, a sweep), log lines: when it starts, every 30 s, when it ends.
    lines = None
    if desc is not None and not bars and len(batches):
        lines = EvalProgress(desc, sum(b.num_examples for b in batches), len(batches))
    for done, batch in enumerate(tqdm(batches, desc=desc, leave=False, dynamic_ncols=True, disable=not shown), 1):
        scores = scorer.scores(batch)
        lengths = gold_lengths(batch) if scorer.objective.token_weighted and objective != "classification" else None
        loss = objective_loss(scores, batch.gold, objective, reduction="sum", lengths=lengths)
        weight = lengths.sum() if lengths is not None else None
        weight_sum = weight if weight_sum is None else weight_sum + weight
        hits = (scores.argmax(dim=1) == batch.gold).sum()
        ties, several = tie_counts(scores)
        loss_sum = loss if loss_sum is None else loss_sum + loss
        correct = hits if correct is None else correct + hits
        tied = ties if tied is None else tied + ties
        multi = several if multi is None else multi + several
        n += batch.num_examples
        if keep:
            kept.append((batch, scores.detach()))
        if lines is not None:
            lines.batch(done, n)
    metrics = {}
    predictions = None
    if generation is not None:
        from adazeta.scoring.generation import generation_rows

        if lines is not None:
            lines.generating()

        texts, f1s, ems = generation_rows(model, generation)
        metrics = {"f1": sum(f1s) / len(f1s), "em": sum(ems) / len(ems)} if texts else {"f1": float("nan"), "em": float("nan")}
        if keep:
            predictions = Predictions(texts=texts, f1=f1s, em=ems)
    elif keep:
        predictions = gather_predictions(kept, n)
    model.train(was_training)
    metric = "f1" if generation is not None else "accuracy"
    if n == 0:
        return EvalResult(float("nan"), float("nan"), 0, metric=metric)
    score = metrics["f1"] if generation is not None else float(correct) / n  # the one sync point
    tied_fraction = float(tied) / float(multi) if float(multi) else 0.0
    mean_loss = float(loss_sum) / (float(weight_sum) if weight_sum is not None else n)  # per token, or per example
    if lines is not None:
        lines.done(mean_loss, score, metric)
    return EvalResult(mean_loss, score, n, metrics, tied_fraction, metric, predictions, dependence(predictions))


def gather_predictions(kept: list[tuple[Batch, torch.Tensor]], n: int) -> Predictions:
    """Per-example rows from each batch's scores, put back in the split's order (``Batch.index``)."""
    out = Predictions([0] * n, [0] * n, [[] for _ in range(n)])
    start = 0
    for batch, scores in kept:
        b = batch.num_examples
        where = list(batch.index) if batch.index is not None else list(range(start, start + b))
        start += b
        per_example = torch.bincount(batch.candidate_slot.cpu() // batch.max_candidates, minlength=b).tolist()
        rows = scores.float().cpu().tolist()
        for r, (i, k) in enumerate(zip(where, per_example)):
            row = rows[r][:k]
            out.scores[i] = row
            out.gold[i] = int(batch.gold[r])
            out.pred[i] = max(range(k), key=row.__getitem__) if k else -1
    return out


def tie_counts(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(examples whose finite candidate scores are all within TIE_TOL, examples with >= 2 finite candidates)."""
    finite = torch.isfinite(scores)
    hi = scores.masked_fill(~finite, float("-inf")).amax(dim=1)
    lo = scores.masked_fill(~finite, float("inf")).amin(dim=1)
    several = finite.sum(dim=1) >= 2
    return ((hi - lo <= TIE_TOL) & several).sum(), several.sum()
