"""The model families, each an object that says what its family decides, so that no other module asks which one.

A family is chosen once, from ``model.family`` or the model's own config (``adazeta.models.infer_family``), and
travels as this object: the scorer, the bound task, the loaders, the probe and the export read what they need
from it (where the answer is read, whether examples share a row, which auto class loads it, ...).

- **causal** (decoders; MeZO's protocol): a candidate is scored by its mean token log-likelihood after the prompt;
  examples may be packed several to a row; prompts start with BOS when the tokenizer adds one; a hook-rendered
  prompt loses its leading whitespace.
- **masked** (RoBERTa-style encoders with an MLM head; LM-BFF's protocol): the answer is a label word's logit at
  the prompt's mask token; one row per example; the data are LM-BFF's k-shot splits where the task has them.
"""

from __future__ import annotations

import dataclasses

from adazeta.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
    """What a model family decides about prompts, scoring, data and loading."""

    name: str
    auto_class: str  # transformers' auto class of its LM head
    reads_mask: bool  # the answer is read at the prompt's mask token (a label word); else after the prompt's end
    packs: bool  # examples may share a row (the ``packed`` layout)
    starts_with_bos: bool  # prompts start with the tokenizer's BOS token when the tokenizer adds one
    strips_hook_prompt: bool  # a hook-rendered prompt loses its leading whitespace
    kshot_data: bool  # reads the task's ``masked_data`` sources (LM-BFF's k-shot splits)
    # The task config's keys it never reads (the other family's prompt format and data): a run of this family is
    # not a different run when only they differ (``adazeta.runs.rundir``).
    unread_task_keys: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name


CAUSAL = Family("causal", "AutoModelForCausalLM", reads_mask=False, packs=True, starts_with_bos=True,
                strips_hook_prompt=True, kshot_data=False, unread_task_keys=("task.masked.", "task.masked_data."))
MASKED = Family("masked", "AutoModelForMaskedLM", reads_mask=True, packs=False, starts_with_bos=False,
                strips_hook_prompt=False, kshot_data=True,
                unread_task_keys=("task.causal.", "task.hub.", "task.local."))
FAMILIES: dict[str, Family] = {f.name: f for f in (CAUSAL, MASKED)}


def family(value: "str | Family") -> Family:
    """The family named ``value`` (a Family is returned as it is); a ConfigError names the known ones."""
    if isinstance(value, Family):
        return value
    found = FAMILIES.get(value)  # type: ignore[arg-type]
    if found is None:
        raise ConfigError(f"model.family={value!r} is unknown; known: {', '.join(FAMILIES)}")
    return found
