"""Every task's templates on fixture rows: MeZO's or LM-BFF's prompts, a candidate per label, the right label word."""

from __future__ import annotations

import dataclasses

import pytest

from adazeta.errors import ConfigError
from adazeta.tasks.family import CAUSAL, MASKED
from adazeta.settings import parse
from adazeta.tasks.spec import BoundTask, TaskSpec
from helpers import CONF, compose_cfg

MASK = "<mask>"
TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
DECODER_TASKS = ["sst2", "rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "record", "squad", "drop"]
MASKED_TASKS = ["sst2", "sst5", "mr", "cr", "snli", "mnli", "qnli", "rte", "trec"]

NLI = {"premise": "A man runs.", "hypothesis": "A person moves."}
SENTENCE = {"sentence": "a gripping film"}
# A fixture row per task, its MeZO or LM-BFF prompts (masked: LM-BFF's exact strings, checked against LM-BFF's
# template language in tests/test_lmbff_templates.py), and each raw label's word (candidate).
FIXTURES = {
    "sst2": (SENTENCE, "a gripping film It was", "a gripping film It was<mask>.", {0: "terrible", 1: "great"}),
    "rte": (NLI, 'A man runs.\nDoes this mean that "A person moves." is true? Yes or No?\n',
            "A man runs?<mask>, a person moves.", {"entailment": "Yes", "not_entailment": "No"}),
    "cb": (NLI, 'Suppose A man runs. Can we infer that "A person moves."? Yes, No, or Maybe?\n', None,
           {"entailment": "Yes", "contradiction": "No", "neutral": "Maybe"}),
    "boolq": ({"passage": "Cats purr.", "question": "do cats purr"}, "Cats purr. Do cats purr?\n", None,
              {True: "Yes", False: "No"}),
    "wic": ({"word": "bank", "sentence1": "He sat by the bank.", "sentence2": "The bank was shut."},
            'Does the word "bank" have the same meaning in these two sentences? Yes, No?\n'
            "He sat by the bank.\nThe bank was shut.\n", None, {False: "No", True: "Yes"}),
    "wsc": ({"text": "Mark told Pete he was late.", "span1_text": "Pete", "span2_text": "He"},
            'Mark told Pete he was late.\nIn the previous sentence, does the pronoun "he" refer to Pete? Yes or No?\n',
            None, {False: "No", True: "Yes"}),
    "multirc": ({"paragraph": "Cats purr.", "question": "What do cats do?", "answer": "Purr"},
                'Cats purr.\nQuestion: What do cats do?\nI found this answer "Purr". Is that correct? Yes or No?\n',
                None, {0: "No", 1: "Yes"}),
    "sst5": (SENTENCE, None, "a gripping film It was<mask>.",
             {0: "terrible", 1: "bad", 2: "okay", 3: "good", 4: "great"}),
    "mr": (SENTENCE, None, "a gripping film It was<mask>.", {0: "terrible", 1: "great"}),
    "cr": (SENTENCE, None, "a gripping film It was<mask>.", {0: "terrible", 1: "great"}),
    "snli": (NLI, None, "A man runs?<mask>, a person moves.",
             {"contradiction": "No", "entailment": "Yes", "neutral": "Maybe"}),
    "mnli": (NLI, None, "A man runs?<mask>, a person moves.",
             {"contradiction": "No", "entailment": "Yes", "neutral": "Maybe"}),
    "qnli": ({"question": "Who runs?", "sentence": "A man runs."}, None, "Who runs?<mask>, a man runs.",
             {"entailment": "Yes", "not_entailment": "No"}),
    "trec": ({"question": "Who wrote Hamlet ?"}, None, "<mask>: Who wrote Hamlet ?",
             {"DESC": "Description", "ENTY": "Entity", "ABBR": "Expression", "HUM": "Human", "LOC": "Location",
              "NUM": "Number"}),
}
HOOK_TASKS = {"copa", "record", "squad", "drop"}


def spec(name: str, *overrides: str) -> TaskSpec:
    return parse(compose_cfg([f"task={name}", *overrides])).task


def test_every_task_of_the_paper_tables_exists_with_the_right_families():
    assert set(DECODER_TASKS) | set(MASKED_TASKS) == set(TASKS)
    for name in TASKS:
        s = spec(name)
        assert s.name == name and s.version >= 1
        assert (s.causal is not None) == (name in DECODER_TASKS)
        assert (s.masked is not None) == (name in MASKED_TASKS)
    assert FIXTURES.keys() | HOOK_TASKS == set(TASKS)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_templates_render_spec_prompts_and_label_words(name):
    row, causal_prompt, masked_prompt, words = FIXTURES[name]
    s = spec(name)
    assert len(words) == len(s.labels)
    for family, expected in (("causal", causal_prompt), ("masked", masked_prompt)):
        if expected is None:
            assert getattr(s, family) is None
            continue
        task = s.for_family(family, MASK)
        for raw, word in words.items():
            gold = s.label_index(raw, "fixture")
            ex = task.render({**row, "label": gold}, gold)
            assert ex.prompt == expected
            assert len(ex.candidates) == len(s.labels)
            assert ex.candidates[ex.gold].strip() == word
        assert task.render(row, 0).prompt == expected  # deterministic


def test_causal_sst2_candidates_carry_their_leading_space():
    # The prompt ends with "was": the candidate must be " great", scored as the next word.
    assert spec("sst2").causal.candidates == [" terrible", " great"]


@pytest.mark.parametrize("question,conj", [("cause", " because"), ("effect", " so")])
def test_copa_hook(question, conj):
    s = spec("copa")
    row = {"premise": "The man fell.", "choice1": "He tripped.", "choice2": "I laughed.", "question": question}
    ex = s.for_family("causal").render(row, 1)
    assert ex.prompt == "The man fell" + conj
    assert ex.candidates == [" he tripped.", " I laughed."]  # first word lower-cased, except "I"
    assert ex.gold == 1 and s.objective == "lm"


def test_record_hook():
    row = {
        "passage": "Rain fell on Paris.\n@highlight\nParis is wet",
        "query": "@placeholder got wet.",
        "entities": ["Rain", "Paris", "Paris"],
        "answers": ["Paris"],
    }
    record = spec("record").for_family("causal")
    ex = record.render(row, 0)
    assert ex.prompt == "Rain fell on Paris.\n- Paris is wet\n-"
    assert ex.candidates == [" Paris got wet.", " Rain got wet."]  # one per distinct entity
    assert ex.gold == 0 and ex.meta["answers"] == ["Paris"]
    with pytest.raises(ConfigError, match="no answer"):
        record.render({**row, "answers": ["Lyon"]}, 0)


def test_generation_hooks_keep_every_answer():
    squad = {"title": "Cats", "context": "Cats purr.", "question": " What do cats do? ",
             "answers": {"text": ["purr", "they purr"], "answer_start": [5, 0]}}
    ex = spec("squad").for_family("causal").render(squad, 0)
    assert ex.prompt == "Title: Cats\nContext: Cats purr.\nQuestion: What do cats do?\nAnswer:"
    assert ex.candidates == [" purr\n"] and ex.meta["answers"] == ["purr", "they purr"]
    drop = {"context": "Two cats sat.", "question": "How many cats?", "answers": {"spans": ["2"], "types": ["number"]}}
    ex = spec("drop").for_family("causal").render(drop, 0)
    assert ex.prompt == "Passage: Two cats sat.\nQuestion: How many cats?\nAnswer:"
    assert ex.meta["answers"] == ["2"]
    s = spec("squad")
    assert s.objective == "generation" and s.metric == "f1" and s.f1_objective is False


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["task.causal.template='{sentence|shout} It was'"], "unknown filter 'shout'"),
        (["task.causal.template='{sentnce} It was'"], r"uses \{sentnce\}, which is not in text_fields"),
        (["task.causal.template='It was'"], r"uses none of text_fields \(sentence\), so every example would get "
                                            r"the same prompt; put \{sentence\} in it"),
        (["task.masked.template='{sentence} It was .'"], r"has no \{mask\}"),
        (["task.metric=f1"], "does not fit objective"),
        (["task.objective=regression"], "objective='regression' is not one of"),
        (["task.f1_objective=true"], "needs objective=generation"),
        (["task.causal.candidates=[' bad']"], "candidates has 1 entries but labels has 2"),
    ],
)
def test_bad_specs_fail_at_parse_time_in_one_line(overrides, message):
    extra = [o if o.split("=")[0] in ("task.metric", "task.objective", "task.causal.template", "task.masked.template",
                                      "task.causal.candidates") else "+" + o for o in overrides]
    with pytest.raises(ConfigError, match=message) as err:
        spec("sst2", *extra)
    assert "\n" not in str(err.value)


def test_unknown_hook_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown task render hook 'copaa'.*known: copa"):
        spec("copa", "task.causal.hook=copaa")


def test_a_task_without_the_family_format_says_so():
    for name, family in (("copa", "masked"), ("trec", "causal")):
        with pytest.raises(ConfigError) as err:
            spec(name).for_family(family)
        assert str(err.value) == (f"task {name!r} has no prompt format for {family} models; "
                                  "pick another task or model")


def test_a_task_bound_to_a_family_holds_that_protocol_s_sources_and_format():
    s = spec("sst2")
    causal, masked = s.for_family("causal"), s.for_family("masked")
    assert isinstance(causal, BoundTask) and causal.spec is s and causal.name == "sst2"
    # causal: the MeZO protocol's sources (GLUE); masked: LM-BFF's k-shot layout, from masked_data
    assert (causal.family, causal.format, causal.hub, causal.local) == (CAUSAL, s.causal, s.hub, s.local)
    assert (masked.family, masked.format) == (MASKED, s.masked)
    assert s.for_family(MASKED) == masked  # a name or the Family itself: bound to the same object
    assert (masked.hub, masked.local) == (s.masked_data.hub, s.masked_data.local)
    assert masked.local is not s.local and masked.local.kshot and not causal.local.kshot
    assert causal.candidates == s.causal.candidates and masked.candidates == s.masked.candidates


def test_the_mask_token_binds_once_the_tokenizer_is_known():
    s = spec("sst2")
    before = s.for_family("masked")  # the checks before any model loads: no tokenizer yet
    assert before.mask_token is None
    with pytest.raises(ConfigError, match="masked template needs the tokenizer's mask token"):
        before.render(SENTENCE, 1)
    after = before.with_mask(MASK)
    assert after.mask_token == MASK and before.mask_token is None  # a new binding; the first one is unchanged
    assert after == s.for_family("masked", MASK)
    assert after.render(SENTENCE, 1).prompt == "a gripping film It was<mask>."
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.family = CAUSAL
