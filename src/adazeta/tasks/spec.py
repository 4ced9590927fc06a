"""Task specs are data: dataset sources, label order, templates, candidates and the training objective.

A spec comes from ``conf/task/<name>.yaml``. One task name serves both model families:

- ``causal`` is the MeZO protocol: a prompt and candidate continuations scored by their length-normalised
  log-likelihood; data from ``hub`` / ``local`` (SuperGLUE, GLUE), sampled 1,000 train / 500 dev / 1,000 test;
- ``masked`` is the LM-BFF protocol: a template holding the model's mask token, scored by the label words'
  logits at the mask; data from ``masked_data`` (the LM-BFF k-shot layout locally, or k per class sampled from
  the Hub).

Every source maps its columns onto the task's own field names (``rename``), so one template fits all sources.
Templates fill ``{field}`` placeholders; ``{field|filter}`` applies a filter from :data:`FILTERS` (e.g.
``{question|upper_first}``; ``drop_last`` and ``lower_first`` are LM-BFF's ``sent-_0`` and ``sentl_1``, so that
masked templates render LM-BFF's prompts character for character). Templates that need more than that (COPA,
ReCoRD, SQuAD, DROP) name a hook registered in :data:`HOOKS` (``adazeta.tasks.hooks``). Bump ``version`` whenever
a template, a candidate or a protocol changes: it is recorded with every result.
"""

from __future__ import annotations

import dataclasses

import string
from dataclasses import dataclass, field
from typing import Any, Callable

from adazeta.errors import ConfigError
from adazeta.tasks.family import FAMILIES, Family
from adazeta.tasks.family import family as as_family
from adazeta.registry import HOOKS

METRICS = ("accuracy", "f1")
# classification: cross-entropy over the candidates' scores; lm: the language-model loss of the gold candidate
# (COPA, ReCoRD); generation: lm loss for training, greedy generation scored by F1 / exact match (SQuAD, DROP).
OBJECTIVES = ("classification", "lm", "generation")
LOCAL_FORMATS = ("jsonl", "tsv", "csv")


@dataclass
class HubSource:
    """A dataset on the Hugging Face Hub that loads without a loading script (parquet or json files)."""

    path: str  # dataset id, e.g. nyu-mll/glue
    name: str | None = None  # dataset config, e.g. sst2
    train_split: str = "train"
    eval_split: str = "validation"  # the test split of the protocol (SuperGLUE/GLUE test labels are hidden)
    rename: dict[str, str] = field(default_factory=dict)  # hub column -> the task's field name
    drop_labels: list[Any] = field(default_factory=list)  # rows with these raw labels are dropped (SNLI: -1)
    revision: str | None = None  # a commit or tag, for reproducible downloads


@dataclass
class LocalSource:
    """Files under the data directory. ``kshot``: they live in ``<dir>/<k>-<seed>/`` (the LM-BFF layout)."""

    dir: str  # folder under the data directory, e.g. superglue/RTE
    format: str  # jsonl | tsv | csv
    train: list[str] = field(default_factory=list)  # files concatenated into the train split
    eval: list[str] = field(default_factory=list)  # files concatenated into the evaluation (test) split
    dev: list[str] = field(default_factory=list)  # fixed dev files (LM-BFF k-shot); empty: dev sampled from train
    kshot: bool = False  # true: files are read from <dir>/<data.k>-<data.kshot_seed>/
    train_dir: str | None = None  # folder of the train files when it is not `dir` (BoolQ: fewglue32/BoolQ)
    flatten: str | None = None  # a registered flattener for nested JSON rows (multirc, record, wsc)
    columns: list[str] | None = None  # column names of header-less tsv/csv files, in order
    ragged: bool = False  # rows may hold extra columns before the last one (SNLI's label2..label5)
    rename: dict[str, str] = field(default_factory=dict)  # file column -> the task's field name
    note: str | None = None  # appended to a missing-file error: where else the data can come from

    def __post_init__(self) -> None:
        if self.format not in LOCAL_FORMATS:
            raise ConfigError(f"local.format={self.format!r} is not one of {', '.join(LOCAL_FORMATS)}")
        if self.format == "jsonl" and self.columns:
            raise ConfigError("local.columns names the columns of header-less tsv/csv files; remove it for jsonl")


@dataclass
class MaskedData:
    """Where a masked LM's k-shot splits come from (LM-BFF protocol): local files, else k per class from the Hub."""

    local: LocalSource | None = None  # the k-shot files (LM-BFF's layout: <dir>/<k>-<seed>/)
    hub: HubSource | None = None  # else k examples per class drawn from the Hub's train split

    def __post_init__(self) -> None:
        if isinstance(self.local, dict):
            self.local = LocalSource(**self.local)
        if isinstance(self.hub, dict):
            self.hub = HubSource(**self.hub)


@dataclass
class PromptFormat:
    """How one model family sees an example. ``{field}`` placeholders are filled from the row."""

    template: str = ""  # the prompt, with {field} placeholders (and filters: {premise|drop_last})
    candidates: list[str] = field(default_factory=list)  # one per label, in label-index order
    hook: str | None = None  # a registered render hook, for templates that need code
    # Masked (LM-BFF) templates: token limits of the first sentence and of the others, and of the whole prompt
    # (capped by model.max_length), as LM-BFF's --first_sent_limit, --other_sent_limit and --max_seq_length.
    first_sent_limit: int | None = None  # tokens of the first sentence at most (LM-BFF --first_sent_limit)
    other_sent_limit: int | None = None  # tokens of each other sentence at most (--other_sent_limit)
    max_length: int | None = None  # tokens of the whole prompt at most (--max_seq_length; model.max_length caps it)

    def __post_init__(self) -> None:
        for name in ("first_sent_limit", "other_sent_limit", "max_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"task.<family>.{name}={value!r} must be an int >= 1, or null for no limit")


@dataclass
class TaskSpec:
    name: str  # the task's name: labels its runs and tables (task=<name> on the command line)
    version: int  # bumped when a template, a candidate or a protocol changes; recorded with every result
    objective: str = "classification"  # classification | lm | generation (see OBJECTIVES)
    metric: str = "accuracy"  # accuracy, or f1 for generation tasks (exact match is reported beside it)
    f1_objective: bool = False  # generation tasks: ZO methods minimise -F1 of the greedy generation instead
    label_field: str | None = "label"  # null: the hook derives the gold answer (ReCoRD, SQuAD, DROP)
    labels: list[Any] = field(default_factory=list)  # raw label values in index order
    # What an integer label in a data file means where it is not the position in `labels`: the dataset's own
    # integer order (Hugging Face's ClassLabel names: BoolQ 0 = false, MNLI 0 = entailment). null: the position.
    int_labels: list[Any] | None = None
    text_fields: list[str] = field(default_factory=list)  # fields every row must have (after `rename`)
    hub: HubSource | None = None  # causal (MeZO protocol) data
    local: LocalSource | None = None  # causal (MeZO protocol) data from local files (offline; data.dir)
    causal: PromptFormat | None = None  # how a decoder sees an example: template, candidates or a hook
    masked: PromptFormat | None = None  # how a masked LM sees it (LM-BFF templates and token limits)
    masked_data: MaskedData | None = None  # masked (LM-BFF protocol) data
    num_dev: int | None = None  # overrides data.num_dev (MeZO protocol: CB and COPA use 100)

    def __post_init__(self) -> None:
        if isinstance(self.hub, dict):
            self.hub = HubSource(**self.hub)
        if isinstance(self.local, dict):
            self.local = LocalSource(**self.local)
        if isinstance(self.masked_data, dict):
            self.masked_data = MaskedData(**self.masked_data)
        for fam in FAMILIES:  # each family's prompt format is the task's key of its name
            value = getattr(self, fam)
            if isinstance(value, dict):
                setattr(self, fam, PromptFormat(**value))
        where = f"task {self.name!r}"
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"{where}: objective={self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.metric not in METRICS:
            raise ConfigError(f"task.metric={self.metric!r} is not one of {', '.join(METRICS)}")
        if (self.objective == "generation") != (self.metric == "f1"):
            raise ConfigError(f"{where}: metric={self.metric!r} does not fit objective={self.objective!r}; "
                              "generation tasks are scored by f1, the others by accuracy")
        if self.f1_objective and self.objective != "generation":
            raise ConfigError(f"{where}: f1_objective=true needs objective=generation (it scores generated answers)")
        if self.int_labels is not None and sorted(map(str, self.int_labels)) != sorted(map(str, self.labels)):
            raise ConfigError(f"{where}: int_labels={self.int_labels} must list the labels {self.labels} in the "
                              "dataset's integer order")
        if self.num_dev is not None and self.num_dev < 1:
            raise ConfigError(f"task.num_dev={self.num_dev} must be >= 1, or null to use data.num_dev")
        if not (self.causal or self.masked):
            raise ConfigError(f"{where} needs a `causal` or a `masked` prompt format")
        if self.causal and not (self.hub or self.local):
            raise ConfigError(f"{where} has a causal format but no `hub` or `local` data source")
        if self.masked and not (self.masked_data and (self.masked_data.hub or self.masked_data.local)):
            raise ConfigError(f"{where} has a masked format but no `masked_data` with a `hub` or `local` source")
        for fam in FAMILIES.values():
            fmt = getattr(self, fam.name)
            if fmt:
                self._check_format(fam, fmt)

    def _check_format(self, family: Family, fmt: PromptFormat) -> None:
        """Fail at start-up on a template that could only fail at render time."""
        where = f"task {self.name!r}: {family}"
        if fmt.hook:
            HOOKS.get(fmt.hook)  # an unknown hook lists the known ones
            return
        if self.label_field is None:
            raise ConfigError(f"{where} has no hook, so the task needs a label_field to know the gold candidate")
        if len(fmt.candidates) != len(self.labels):
            raise ConfigError(
                f"{where}.candidates has {len(fmt.candidates)} entries but labels has {len(self.labels)}; "
                "give one candidate per label, in label order"
            )
        allowed = set(self.text_fields) | ({"mask"} if family.reads_mask else set())
        for name, _ in template_fields(fmt.template, f"{where}.template"):
            if name not in allowed:
                raise ConfigError(
                    f"{where}.template uses {{{name}}}, which is not in text_fields ({', '.join(self.text_fields)}); "
                    "add it there or fix the template"
                )
        used = {n for n, _ in template_fields(fmt.template, where)}
        if self.text_fields and not used & set(self.text_fields):
            raise ConfigError(
                f"{where}.template={fmt.template!r} uses none of text_fields ({', '.join(self.text_fields)}), so "
                f"every example would get the same prompt; put {{{self.text_fields[0]}}} in it"
            )
        if family.reads_mask and "mask" not in used:
            raise ConfigError(f"{where}.template has no {{mask}}; a masked template needs the mask position")

    def for_family(self, family: Family | str, mask_token: str | None = None) -> "BoundTask":
        """The task as ``family``'s models see it: its protocol's sources and its prompt format, resolved once.

        ``mask_token``: a masked model's tokenizer fills ``{mask}`` with it; unknown before the tokenizer loads, so
        the checks before loading bind without it and ``BoundTask.with_mask`` adds it.
        """
        family = as_family(family)
        fmt = getattr(self, family.name, None)
        if fmt is None:
            raise ConfigError(
                f"task {self.name!r} has no prompt format for {family} models; pick another task or model"
            )
        if family.kshot_data:
            hub, local = self.masked_data.hub, self.masked_data.local  # type: ignore[union-attr]
        else:
            hub, local = self.hub, self.local
        return BoundTask(self, family, fmt, hub, local, mask_token)

    def label_index(self, value: Any, where: str) -> int:
        """Normalise a raw label to its index in ``labels``: exact value, then case-insensitive text, then an index.

        Local files and Hub copies disagree (``"entailment"`` against ``0``, ``true`` against ``1``); types are
        compared exactly first because ``True == 1`` in Python. An integer (or an integral ``1.0``, as pandas
        writes a label column) that is not itself a label means ``int_labels[i]`` where the task gives that order,
        else the i-th label.
        """
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, str) and _integral_text(value) and not any(str(lab) == value for lab in self.labels):
            value = int(float(value))
        for i, lab in enumerate(self.labels):
            if type(value) is type(lab) and value == lab:
                return i
        if isinstance(value, (str, bool)):
            text = str(value).strip().lower()
            for i, lab in enumerate(self.labels):
                if str(lab).lower() == text:
                    return i
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(self.labels):
            return self.labels.index(self.int_labels[value]) if self.int_labels else value
        raise ConfigError(f"{where}: label {value!r} is not one of {self.labels}")


def _integral_text(text: str) -> bool:
    """'1', ' 2 ', '1.0', '-1': text of an integer (TSV and CSV labels arrive as text)."""
    try:
        return float(text).is_integer()
    except ValueError:
        return False


@dataclass(frozen=True)
class BoundTask:
    """A task bound to one model family (``TaskSpec.for_family``): what the loaders, the templates, calibration and
    ICL need, resolved once, so that no step asks the spec for the family's sources or format again.

    ``hub`` / ``local`` are the family's protocol sources (masked: ``masked_data``'s), ``format`` its prompt format.
    """

    spec: TaskSpec
    family: Family
    format: PromptFormat
    hub: HubSource | None
    local: LocalSource | None
    mask_token: str | None = None  # the tokenizer's mask token, which a masked template's {mask} holds

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def candidates(self) -> list[str]:
        return self.format.candidates

    def with_mask(self, mask_token: str | None) -> "BoundTask":
        """The same task with the tokenizer's mask token, once the tokenizer is loaded."""
        return dataclasses.replace(self, mask_token=mask_token)

    def render(self, row: dict[str, Any], gold: int) -> Example:
        """Render one row with the family's template. Deterministic: the same row always gives the same text."""
        spec, fmt = self.spec, self.format
        if fmt.hook:
            example = HOOKS.get(fmt.hook).builder(spec, fmt, row, gold)
            return _lstrip(example) if self.family.strips_hook_prompt else example
        values = dict(row)
        if self.family.reads_mask:
            if self.mask_token is None:
                raise ConfigError(f"task {spec.name!r}: masked template needs the tokenizer's mask token")
            values["mask"] = self.mask_token
            pieces = fill_parts(fmt.template, values, f"task {spec.name!r}")
            # For encoding as LM-BFF does (``Scorer.encode``): the parts one by one, each sentence within its limit.
            meta = {
                "parts": [text for text, _ in pieces],
                "sentences": [i for i, (_, name) in enumerate(pieces) if name not in (None, "mask")],
                "limits": {"first_sent_limit": fmt.first_sent_limit, "other_sent_limit": fmt.other_sent_limit,
                           "max_length": fmt.max_length},
            }
            return Example("".join(text for text, _ in pieces), list(fmt.candidates), gold, meta)
        # MeZO's encode_prompt strips the leading whitespace of every prompt (``.lstrip()``): a paragraph that starts
        # with a space or a newline does not start the prompt with it.
        return Example(fill(fmt.template, values, f"task {spec.name!r}").lstrip(), list(fmt.candidates), gold)


@dataclass
class Example:
    """One rendered example: a prompt, its candidates, and the index of the gold candidate.

    ``meta["answers"]`` holds every acceptable answer of a generation task (scored by F1 / exact match);
    A masked example keeps its template's pieces for encoding: ``meta["parts"]`` (their concatenation is the
    prompt), ``meta["sentences"]`` (which parts are sentences) and ``meta["limits"]`` (LM-BFF's token limits).
    """

    prompt: str
    candidates: list[str]
    gold: int
    meta: dict[str, Any] = field(default_factory=dict)
    # The example's row in its source split (file or Hub), for per-example predictions; not part of its identity.
    row: int | None = field(default=None, compare=False)


RenderHook = Callable[["TaskSpec", PromptFormat, dict[str, Any], int], Example]


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def _lower_first(text: str) -> str:
    """The text with its first character lower-cased (LM-BFF's ``sentl_i``: the hypothesis after the comma)."""
    return text[:1].lower() + text[1:]


def _drop_last(text: str) -> str:
    """The text without its last character, whatever it is (LM-BFF's ``sent-_i``: the premise's full stop)."""
    return text[:-1]


# Filters a template may apply to a field: ``{span2_text|lower}``. Small on purpose; anything more is a hook.
FILTERS: dict[str, Callable[[str], str]] = {
    "lower": str.lower,
    "strip": str.strip,
    "upper_first": _upper_first,
    "lower_first": _lower_first,
    "drop_last": _drop_last,
}


def template_fields(template: str, where: str = "template") -> list[tuple[str, list[str]]]:
    """The (field, filters) pairs of a template, checking every filter is known."""
    out = []
    for _, spec, _, _ in string.Formatter().parse(template):
        if not spec:
            continue
        name, *filters = [part.strip() for part in spec.split("|")]
        for f in filters:
            if f not in FILTERS:
                raise ConfigError(f"{where}: unknown filter {f!r} in {{{spec}}}; known: {', '.join(sorted(FILTERS))}")
        out.append((name, filters))
    return out


def fill_parts(template: str, row: dict[str, Any], where: str = "template") -> list[tuple[str, str | None]]:
    """The template's pieces, filled, none empty: ``(text, field name)``, the name None for a literal.

    A literal's trailing space before a field goes with the field (``", {hypothesis}"`` gives ``","`` and
    ``" the hypothesis"``): these are the parts LM-BFF's template language encodes one by one (``*,*`` and
    ``*+sentl_1*``), so that a masked prompt is tokenised as LM-BFF tokenises it (``Scorer.encode``).
    """
    parts: list[tuple[str, str | None]] = []
    for literal, spec, _, _ in string.Formatter().parse(template):
        lead = ""
        if spec and literal.endswith(" "):
            literal, lead = literal[:-1], " "
        if literal:
            parts.append((literal, None))
        if not spec:
            continue
        name, *filters = [part.strip() for part in spec.split("|")]
        if name not in row:
            fields = ", ".join(sorted(k for k in row if not k.startswith("_")))
            raise ConfigError(f"{where}: the row has no field {name!r} (fields: {fields})")
        value = str(row[name])
        for f in filters:
            if f not in FILTERS:
                raise ConfigError(f"{where}: unknown filter {f!r}; known: {', '.join(sorted(FILTERS))}")
            value = FILTERS[f](value)
        if lead + value:
            parts.append((lead + value, name))
    return parts


def fill(template: str, row: dict[str, Any], where: str = "template") -> str:
    """Fill ``{field}`` / ``{field|filter}`` placeholders from the row, naming the missing field if there is one."""
    return "".join(text for text, _ in fill_parts(template, row, where))


def _lstrip(example: Example) -> Example:
    return example if example.prompt == example.prompt.lstrip() else dataclasses.replace(
        example, prompt=example.prompt.lstrip())
