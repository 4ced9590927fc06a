"""What a task trains on and how a split is scored, beyond candidate classification (MeZO protocol).

- ``classification``: cross-entropy over the candidates' scores, accuracy (every classification task);
- ``lm``: the language-model loss on the gold candidate's tokens; accuracy still picks the best candidate
  (COPA, ReCoRD: MeZO trains them "not as classification");
- ``generation``: the LM loss on the gold answer for training and dev loss; greedy generation scored by F1
  (the task's main metric: the ``f1`` column of eval.csv, ``dev_f1`` / ``test_f1`` in result.json) and exact match (SQuAD, DROP). With
  ``task.f1_objective`` a zeroth-order method minimises -F1 of the generation instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import torch
    from torch import nn

    from adazeta.scoring.generation import GenerationSet
    from adazeta.tasks.loaders import TaskData
    from adazeta.tasks.spec import TaskSpec


@dataclass
class Objective:
    """The task's objective as the training loop and evaluation need it; the default is classification."""

    kind: str = "classification"  # classification | lm | generation
    dev_generation: "GenerationSet | None" = None  # generation tasks: dev prompts and answers
    test_generation: "GenerationSet | None" = None
    zo_loss: "Callable[[nn.Module, Sequence[Any]], torch.Tensor] | None" = None  # non-differentiable ZO loss
    # LM loss averaged over all gold tokens of a batch (MeZO's reduction; train.lm_reduction=token) instead of over
    # examples (each example's mean token loss, then their mean: train.lm_reduction=example)
    token_weighted: bool = False

    @property
    def trains_on_gold_only(self) -> bool:
        """The LM loss reads only the gold candidate: the others need not be scored at train time."""
        return self.kind != "classification"


def gold_only(items: Sequence[Any]) -> list[Any]:
    """Each example (``Example`` or ``Encoded``) reduced to its gold candidate, for the LM loss."""
    return [dataclasses.replace(it, candidates=[it.candidates[it.gold]], gold=0) for it in items]


def build_objective(
    spec: "TaskSpec", data: "TaskData", encoded: dict[str, Sequence[Any]], tokenizer: Any, max_length: int,
    batch_size: int = 32,
) -> Objective:
    """The objective of ``spec``; generation tasks get their dev/test generation sets (and the ZO F1 loss)."""
    if spec.objective != "generation":
        return Objective(spec.objective)
    from adazeta.scoring.generation import F1Loss, GenerationSet, stop_token_ids

    stops = stop_token_ids(tokenizer)

    def generation_set(split: str) -> GenerationSet:
        prompts = [e.prompt for e in encoded[split]]
        answers = [ex.meta["answers"] for ex in getattr(data, split)]
        return GenerationSet.build(prompts, answers, tokenizer, max_length, stops, batch_size=batch_size)

    zo_loss = F1Loss(tokenizer, max_length, stops, batch_size=batch_size) if spec.f1_objective else None
    return Objective("generation", generation_set("dev"), generation_set("eval"), zo_loss)
