"""Task specs are data: dataset sources, label order, templates and candidates (SPEC §6).

A spec comes from ``conf/task/<name>.yaml``. It holds one prompt format per model family: ``causal`` (the MeZO
protocol: a prompt and candidate continuations scored by length-normalised log-likelihood) and ``masked``
(the LM-BFF protocol: a template with the mask token, scored by the label words' logits at the mask).
Templates that need code (COPA, ReCoRD, ...) name a hook registered in :data:`HOOKS`. Bump ``version``
whenever a template or a candidate changes: it is recorded with every result.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any, Callable

from adazeta.errors import ConfigError
from adazeta.registry import Registry

METRICS = ("accuracy", "f1")


@dataclass
class HubSource:
    path: str  # dataset id that loads without a loading script (parquet), e.g. nyu-mll/glue
    name: str | None = None  # dataset config, e.g. sst2
    train_split: str = "train"
    eval_split: str = "validation"


@dataclass
class LocalSource:
    dir: str  # folder under the data directory, e.g. superglue/RTE
    format: str  # jsonl | tsv
    train: list[str] = field(default_factory=list)  # files concatenated into the train split
    eval: list[str] = field(default_factory=list)  # files concatenated into the evaluation split


@dataclass
class PromptFormat:
    """How one model family sees an example. ``{field}`` placeholders are filled from the row."""

    template: str
    candidates: list[str] = field(default_factory=list)  # one per label, in label-index order
    hook: str | None = None  # a registered render hook, for templates that need code


@dataclass
class TaskSpec:
    name: str
    version: int
    metric: str = "accuracy"
    label_field: str = "label"
    labels: list[Any] = field(default_factory=list)  # raw label values in index order
    text_fields: list[str] = field(default_factory=list)  # fields every row must have
    hub: HubSource | None = None
    local: LocalSource | None = None
    causal: PromptFormat | None = None
    masked: PromptFormat | None = None
    num_dev: int | None = None  # overrides data.num_dev (SPEC §6: CB and COPA use 100)

    def __post_init__(self) -> None:
        if isinstance(self.hub, dict):
            self.hub = HubSource(**self.hub)
        if isinstance(self.local, dict):
            self.local = LocalSource(**self.local)
        for fam in ("causal", "masked"):
            value = getattr(self, fam)
            if isinstance(value, dict):
                setattr(self, fam, PromptFormat(**value))
        if self.metric not in METRICS:
            raise ConfigError(f"task.metric={self.metric!r} is not one of {', '.join(METRICS)}")
        if not (self.hub or self.local):
            raise ConfigError(f"task {self.name!r} needs a `hub` or a `local` data source")
        for fam in ("causal", "masked"):
            fmt = getattr(self, fam)
            if fmt and not fmt.hook and len(fmt.candidates) != len(self.labels):
                raise ConfigError(
                    f"task {self.name!r}: {fam}.candidates has {len(fmt.candidates)} entries but labels has "
                    f"{len(self.labels)}; give one candidate per label, in label order"
                )

    def prompt_format(self, family: str) -> PromptFormat:
        fmt = getattr(self, family, None)
        if fmt is None:
            raise ConfigError(f"task {self.name!r} has no prompt format for {family} models; pick another task or model")
        return fmt

    def label_index(self, value: Any, where: str) -> int:
        """Normalise a raw label to its index in ``labels``: exact value, then case-insensitive text, then an index.

        Local files and Hub copies disagree (``"entailment"`` against ``0``, ``true`` against ``1``); types are
        compared exactly first because ``True == 1`` in Python.
        """
        for i, lab in enumerate(self.labels):
            if type(value) is type(lab) and value == lab:
                return i
        if isinstance(value, (str, bool)):
            text = str(value).strip().lower()
            for i, lab in enumerate(self.labels):
                if str(lab).lower() == text:
                    return i
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(self.labels):
            return value
        raise ConfigError(f"{where}: label {value!r} is not one of {self.labels}")


@dataclass
class Example:
    """One rendered example: a prompt, its candidates, and the index of the gold candidate."""

    prompt: str
    candidates: list[str]
    gold: int
    meta: dict[str, Any] = field(default_factory=dict)


RenderHook = Callable[[TaskSpec, PromptFormat, dict[str, Any], int], Example]
HOOKS: Registry[RenderHook] = Registry("task render hook")


def fill(template: str, row: dict[str, Any], where: str = "template") -> str:
    """Fill ``{field}`` placeholders from the row, naming the missing field if there is one."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    missing = [n for n in names if n not in row]
    if missing:
        raise ConfigError(f"{where}: the row has no field {missing[0]!r} (fields: {', '.join(sorted(row))})")
    return template.format_map({n: str(row[n]) for n in names})


def render(spec: TaskSpec, family: str, row: dict[str, Any], gold: int, mask_token: str | None = None) -> Example:
    """Render one row with the family's template. Deterministic: the same row always gives the same text."""
    fmt = spec.prompt_format(family)
    if fmt.hook:
        return HOOKS.get(fmt.hook).builder(spec, fmt, row, gold)
    values = dict(row)
    if family == "masked":
        if mask_token is None:
            raise ConfigError(f"task {spec.name!r}: masked template needs the tokenizer's mask token")
        values["mask"] = mask_token
    return Example(fill(fmt.template, values, f"task {spec.name!r}"), list(fmt.candidates), gold)
