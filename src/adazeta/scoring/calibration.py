"""Calibrated zero-shot and ICL scoring: a bias per candidate added to every example's candidate scores.

A prompted model's raw scores carry a prior over the answers that has nothing to do with the input (SmolLM2 on
MeZO's SST-2 template prefers " great" for almost any sentence). Two corrections, both chosen before test is seen:

- ``contextual`` (Zhao et al. 2021, "Calibrate Before Use"): score content-free inputs (``N/A``, the empty string,
  ``[MASK]``) in the task's template, with the same demonstrations for ICL, average their distributions over the
  candidates, p_cf, and add ``-log p_cf`` to every example's scores: their W = diag(p_cf)^-1, b = 0. It uses no
  label.
- ``prior``: a bias per candidate fitted on the dev split's labels, the one that minimises the dev cross-entropy
  of softmax(scores + bias) (a convex problem; a class-prior correction). Dev scores are then optimistic; test is
  clean.

The scores are the ones evaluation ranks candidates by: mean log-likelihood per candidate token (the
log-probability of the label word when it is one token) or the masked LM's logit; their softmax over the
candidates is the model's distribution over the answers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from adazeta.errors import ConfigError
from adazeta.scoring.evaluate import evaluate
from adazeta.scoring import Encoded, Scorer
from adazeta.tasks.spec import BoundTask, Example

CALIBRATIONS = ("none", "contextual", "prior")
CONTENT_FREE = ("N/A", "", "[MASK]")  # Zhao et al.'s content-free inputs


def content_free_examples(task: BoundTask) -> list[Example]:
    """The task's template with every input field (``text_fields``) replaced by each content-free string."""
    if task.format.hook or not task.candidates:
        raise ConfigError(f"method.calibration=contextual needs a template with a fixed candidate set; task "
                          f"{task.name!r} builds its prompts or candidates per example: use calibration=prior or none")
    out = []
    for text in CONTENT_FREE:
        row = {field: text for field in task.spec.text_fields}
        try:
            out.append(task.render(row, 0))
        except (ConfigError, KeyError) as err:
            raise ConfigError(f"method.calibration=contextual: task {task.name!r}'s template uses a field outside "
                              f"task.text_fields ({err}); list every input field there") from None
    return out


def all_scores(scorer: Scorer, encoded: Sequence[Encoded], batch_size: int) -> torch.Tensor:
    """(N, C) candidate scores of ``encoded`` in its order (every example with the same number of candidates)."""
    if len({len(e.candidates) for e in encoded}) != 1:
        raise ConfigError("calibration needs the same number of candidates for every example; this task varies")
    kept = evaluate(scorer, scorer.batches(encoded, batch_size, sort=True), keep=True).predictions
    return torch.tensor(kept.scores, dtype=torch.float32)


def contextual_bias(content_free_scores: torch.Tensor) -> torch.Tensor:
    """-log of the mean distribution over candidates of the content-free inputs (Zhao et al.'s diag(p_cf)^-1)."""
    p_cf = torch.softmax(content_free_scores.double(), dim=1).mean(dim=0)
    bias = -torch.log(p_cf)
    return (bias - bias.mean()).float()  # only differences between candidates matter


def prior_bias(scores: torch.Tensor, gold: torch.Tensor, steps: int = 100) -> torch.Tensor:
    """The bias b (summing to 0) that minimises the mean cross-entropy of softmax(scores + b) against ``gold``."""
    if len(gold) == 0:
        raise ConfigError("method.calibration=prior is fitted on dev, and this run has no dev examples")
    scores, gold = scores.double(), gold.long()
    bias = torch.zeros(scores.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([bias], lr=1.0, max_iter=steps, tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(scores + bias, gold)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    b = bias.detach()
    return (b - b.mean()).float()


def calibrate(scorer: Scorer, kind: str, content_free: Sequence[Encoded] | None, dev: Sequence[Encoded],
              batch_size: int) -> tuple[Scorer, dict[str, Any] | None]:
    """``scorer`` with the bias of calibration ``kind`` (unchanged for none), and what the record keeps of it."""
    if kind == "none":
        return scorer, None
    if kind == "contextual":
        if not content_free:
            raise ConfigError("method.calibration=contextual: no content-free prompts were built")
        cf = all_scores(scorer, content_free, batch_size)
        bias = contextual_bias(cf)
        info = {"content_free": list(CONTENT_FREE), "p_cf": torch.softmax(cf.double(), 1).mean(0).tolist()}
    else:
        dev_scores = all_scores(scorer, dev, batch_size)
        bias = prior_bias(dev_scores, torch.tensor([e.gold for e in dev]))
        info = {"fitted_on": "dev", "examples": len(dev)}
    return dataclasses.replace(scorer, bias=bias.to(scorer.device)), {"kind": kind, "bias": bias.tolist(), **info}
