"""The code some tasks need: render hooks for templates that are more than placeholders, and flatteners for
nested local files. Each is registered by name and named from the task's YAML (``hook:``, ``local.flatten:``).

Render hooks follow the MeZO templates (Malladi et al. 2023, ``templates.py`` in its code).
"""

from __future__ import annotations

from typing import Any, Callable

from adazeta.errors import ConfigError
from adazeta.registry import FLATTENERS
from adazeta.tasks.spec import HOOKS, Example, PromptFormat, TaskSpec, fill

Flattener = Callable[[dict[str, Any], str], list[dict[str, Any]]]


def _field(row: dict[str, Any], key: str, where: str) -> Any:
    if key not in row:
        fields = ", ".join(sorted(k for k in row if not k.startswith("_")))
        raise ConfigError(f"{where}: the row has no field {key!r} (fields: {fields})")
    return row[key]


def lower_first_word(choice: str) -> str:
    """COPA's choices continue a sentence: first word lower-cased, except the pronoun "I" (MeZO's CopaTemplate)."""
    words = choice.split(" ")
    if words[0] != "I":
        words[0] = words[0].lower()
    return " ".join(words)


@HOOKS.register("copa", PromptFormat)
def copa(spec: TaskSpec, fmt: PromptFormat, row: dict[str, Any], gold: int) -> Example:
    """``{premise without final period} so|because`` + each choice; the LM loss trains the gold choice.

    The conjunction's trailing space travels with the candidate (" the sun was rising."), so that a BPE tokenizer
    sees the choice's first word as it would in running text; MeZO scores the same tokens by tokenizing prompt
    and choice together.
    """
    where = f"task {spec.name!r}"
    premise = str(_field(row, "premise", where)).rstrip()
    if premise.endswith("."):
        premise = premise[:-1]
    question = _field(row, "question", where)
    conjunctions = {"effect": " so", "cause": " because"}
    if question not in conjunctions:
        raise ConfigError(f"{where}: COPA question {question!r} is not 'cause' or 'effect'")
    choices = [" " + lower_first_word(str(_field(row, k, where)).strip()) for k in ("choice1", "choice2")]
    return Example(premise + conjunctions[question], choices, gold)


@HOOKS.register("record", PromptFormat)
def record(spec: TaskSpec, fmt: PromptFormat, row: dict[str, Any], gold: int) -> Example:
    """Passage with ``@highlight`` lines as ``- `` bullets, then ``\\n-``; a candidate per entity: the query with
    the placeholder filled (MeZO's ReCoRDTemplateGPT3). The gold candidate is the first entity among the answers.
    """
    where = f"task {spec.name!r}"
    passage = str(_field(row, "passage", where)).replace("@highlight\n", "- ")
    query = str(_field(row, "query", where))
    entities = sorted(set(_field(row, "entities", where)))  # the Hub's order; local files list every mention
    answers = list(_field(row, "answers", where))
    gold = next((i for i, e in enumerate(entities) if e in answers), -1)
    if gold < 0:
        raise ConfigError(f"{where}: no answer of {answers} is among the entities {entities}")
    candidates = [" " + query.replace("@placeholder", e) for e in entities]
    return Example(f"{passage}\n-", candidates, gold, {"answers": answers})


def answer_list(value: Any) -> list[str]:
    """The acceptable answers of a QA row: SQuAD's ``{"text": [...]}``, DROP's ``{"spans": [...]}`` or a list."""
    if isinstance(value, dict):
        value = value.get("text", value.get("spans"))
    if isinstance(value, str):
        value = [value]
    return [str(v) for v in value or []]


@HOOKS.register("qa", PromptFormat)
def qa(spec: TaskSpec, fmt: PromptFormat, row: dict[str, Any], gold: int) -> Example:
    """A generation task (SQuAD, DROP): the template, and the first answer as the one candidate (the LM-loss
    target, followed by the newline at which generation stops); every answer goes to ``meta["answers"]``."""
    where = f"task {spec.name!r}"
    answers = answer_list(_field(row, "answers", where))
    if not answers:
        raise ConfigError(f"{where}: a row has no answer; generation tasks need at least one")
    return Example(fill(fmt.template, row, where), [" " + answers[0].strip() + "\n"], 0, {"answers": answers})


def _nested(row: dict[str, Any], path: str, where: str, layout: str) -> Any:
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ConfigError(f"{where}: missing {path!r}; expected the {layout} layout")
        value = value[key]
    return value


@FLATTENERS.register("multirc", dict)
def flatten_multirc(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """SuperGLUE MultiRC: one paragraph per line, ``passage.questions[].answers[]`` -> one row per answer."""
    layout = "MultiRC (passage.text, passage.questions[].question, .answers[].text, .label)"
    text = _nested(row, "passage.text", where, layout)
    out = []
    for q in _nested(row, "passage.questions", where, layout):
        question = _nested(q, "question", where, layout)
        for a in _nested(q, "answers", where, layout):
            out.append(
                {
                    "paragraph": text,
                    "question": question,
                    "answer": _nested(a, "text", where, layout),
                    "label": _nested(a, "label", where, layout),
                    "idx": {"paragraph": row.get("idx"), "question": q.get("idx"), "answer": a.get("idx")},
                }
            )
    return out


@FLATTENERS.register("record", dict)
def flatten_record(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """SuperGLUE ReCoRD: ``passage.text`` with ``passage.entities[]`` spans (inclusive ends) and ``qas[]``."""
    layout = "ReCoRD (passage.text, passage.entities[].start/.end, qas[].query, .answers[].text)"
    text = _nested(row, "passage.text", where, layout)
    entities = [text[e["start"] : e["end"] + 1] for e in _nested(row, "passage.entities", where, layout)]
    return [
        {
            "passage": text,
            "query": _nested(qa_, "query", where, layout),
            "entities": entities,
            "answers": [a["text"] for a in qa_.get("answers", [])],
            "idx": qa_.get("idx"),
        }
        for qa_ in _nested(row, "qas", where, layout)
    ]


@FLATTENERS.register("wsc", dict)
def flatten_wsc(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """SuperGLUE WSC: the span fields sit under ``target``; lift them to the top, as the Hub copy has them."""
    target = _nested(row, "target", where, "WSC (text, target.span1_text, target.span2_text, label)")
    return [{**{k: v for k, v in row.items() if k != "target"}, **target}]
