"""Masked-LM templates render LM-BFF's prompts character for character (Gao et al. 2021, the RoBERTa protocol).

LM-BFF writes a template in a small language of its own (``tokenize_multipart_input`` in its ``src/dataset.py``),
and MeZO's and the AdaZeta reference's RoBERTa scripts pass it the templates in :data:`LMBFF_TEMPLATES`. This
file interprets that language on its own, from its definition, and checks that our task specs
(``conf/task/<task>.yaml``, ``masked:``) render the same text on real and synthetic rows:

- a template is split at ``*``; ``cls``, ``mask``, ``sep`` and ``sep+`` are special tokens;
- ``sent_i`` is the example's sentence i; ``+`` in front adds a space before it, ``l`` lower-cases its first
  character, ``-`` drops its last character (``sent-_0``, ``+sentl_1``, ``sentl-_1``);
- any other part is literal text in which ``_`` stands for a space; empty parts add nothing.

LM-BFF encodes every part on its own and concatenates the ids; a one-character literal (``?``, ``,``, ``.``,
``:``) is looked up in the vocabulary as is. Our scoring encodes the rendered text in one piece. A byte-level BPE
never merges across a pre-token boundary, so both give the same ids exactly when every part boundary is also a
boundary of the pre-tokenisation of the whole text; :func:`pretokens_agree` checks that without a vocabulary.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pandas as pd
import pytest
from tokenizers.pre_tokenizers import ByteLevel
from tokenizers.processors import RobertaProcessing

from adazeta.models import TINY_WORDS, byte_tokenizer
from adazeta.settings import parse
from adazeta.scoring import encode
from adazeta.tasks.loaders import load_rows
from adazeta.tasks.spec import TaskSpec
from helpers import SHARED_DATA, compose_cfg, needs_shared_data

MASK = "<mask>"
SPECIAL = ("cls", "mask", "sep", "sep+")

SENTIMENT = "*cls**sent_0*_It_was*mask*.*sep+*"
NLI = "*cls**sent-_0*?*mask*,*+sentl_1**sep+*"
# The --template of each task in LM-BFF's, MeZO's and the AdaZeta reference's run_fewshot.sh.
LMBFF_TEMPLATES = {
    "sst2": SENTIMENT,
    "sst5": SENTIMENT,
    "mr": SENTIMENT,
    "cr": SENTIMENT,
    "snli": NLI,
    "mnli": NLI,
    "qnli": NLI,
    "rte": NLI,
    "trec": "*cls**mask*:*+sent_0**sep+*",
}
# Our field names for LM-BFF's text_a (sentence 0) and text_b (sentence 1).
SENTENCES = {
    "sst2": ("sentence",),
    "sst5": ("sentence",),
    "mr": ("sentence",),
    "cr": ("sentence",),
    "snli": ("premise", "hypothesis"),
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("premise", "hypothesis"),
    "trec": ("question",),
}

SENTENCE_PART = re.compile(r"(\+?)sent(l?)(-?)_(\d+)")


def lmbff_parts(template: str, sentences: list[str]) -> list[tuple[str, str]]:
    """The template's parts in order: (kind, text), kind "special" (text: its name), "sentence" or "literal"."""
    parts = []
    for part in template.split("*"):
        if part in SPECIAL:
            parts.append(("special", part))
            continue
        var = SENTENCE_PART.fullmatch(part)
        if var is None:
            if part:
                parts.append(("literal", part.replace("_", " ")))
            continue
        space, lower, drop_last, index = var.groups()
        text = sentences[int(index)]
        if lower:
            text = text[:1].lower() + text[1:]
        if drop_last:
            text = text[:-1]
        parts.append(("sentence", " " * len(space) + text))
    return parts


def lmbff_text(template: str, sentences: list[str], mask: str = MASK) -> str:
    """The text between LM-BFF's leading ``cls`` and closing ``sep+``, with the mask token written out."""
    parts = lmbff_parts(template, sentences)
    assert parts[0] == ("special", "cls") and parts[-1] == ("special", "sep+")
    inner = parts[1:-1]
    assert [name for kind, name in inner if kind == "special"] == ["mask"]
    return "".join(mask if kind == "special" else text for kind, text in inner)


# The reference scripts' limits per task (run_fewshot.sh): --max_seq_length (128 unless set), --first_sent_limit,
# --other_sent_limit.
REFERENCE_LIMITS = {
    "sst2": (128, None, None), "sst5": (128, 110, 20), "mr": (128, 110, 50), "cr": (128, 110, 50),
    "trec": (128, 110, None), "qnli": (128, None, None), "mnli": (256, 240, None), "snli": (256, None, None),
    "rte": (256, 240, None),
}


def lmbff_ids(template: str, sentences: list[str], tokenizer, limits=(None, None, None)) -> list[int] | None:
    """LM-BFF's input ids: every part encoded on its own, one-character literals looked up as tokens, sentence
    0 cut to ``first_sent_limit`` tokens and the others to ``other_sent_limit``, then the first ``max_length``
    ids kept; None where LM-BFF stops because that cut lost the mask."""
    max_length, first, other = limits
    special = {"cls": tokenizer.cls_token_id, "mask": tokenizer.mask_token_id, "sep": tokenizer.sep_token_id,
               "sep+": tokenizer.sep_token_id}
    ids: list[int] = []
    sentence_parts = [part for part in template.split("*") if SENTENCE_PART.fullmatch(part)]
    sentence = 0
    for kind, text in lmbff_parts(template, sentences):
        if kind == "special":
            ids.append(special[text])
        elif kind == "literal" and len(text) == 1:
            ids.append(tokenizer.convert_tokens_to_ids(text))
        else:
            new = tokenizer(text, add_special_tokens=False)["input_ids"]
            if kind == "sentence":
                index = int(SENTENCE_PART.fullmatch(sentence_parts[sentence]).group(4))
                limit = first if index == 0 else other
                new = new if limit is None else new[:limit]
                sentence += 1
            ids += new
    if max_length is not None and len(ids) > max_length:
        ids = ids[:max_length]
        if tokenizer.mask_token_id not in ids:
            return None
    return ids


def pretokens_agree(template: str, sentences: list[str]) -> bool:
    """Whether encoding the rendered text in one piece gives LM-BFF's ids with any byte-level BPE (RoBERTa's).

    The text is split at special tokens first; within a stretch, BPE merges never cross a pre-token boundary, so
    the ids agree when pre-tokenising the stretch gives the pre-tokens of its parts, one after the other.
    """
    level = ByteLevel(add_prefix_space=False, use_regex=True)

    def pieces(text: str) -> list[str]:
        return [piece for piece, _ in level.pre_tokenize_str(text)] if text else []

    stretches: list[list[str]] = [[]]
    for kind, text in lmbff_parts(template, sentences):
        if kind == "special":
            stretches.append([])
        else:
            stretches[-1].append(text)
    return all(pieces("".join(s)) == [p for text in s for p in pieces(text)] for s in stretches)


def spec(name: str) -> TaskSpec:
    return parse(compose_cfg([f"task={name}"])).task


def rendered(task: str, s: TaskSpec, sentences: list[str]) -> str:
    row = dict(zip(SENTENCES[task], sentences), label=0)
    return s.for_family("masked", MASK).render(row, 0).prompt


def roberta_style_tokenizer(words: tuple[str, ...] = ()):
    """The tiny byte-level BPE tokenizer with RoBERTa's ``<s> ... </s>`` around every text; ``words`` add merges."""
    tok = byte_tokenizer(list(TINY_WORDS) + list(words))
    tok.cls_token, tok.sep_token = "<s>", "</s>"
    tok.backend_tokenizer.post_processor = RobertaProcessing((tok.sep_token, tok.sep_token_id),
                                                             (tok.cls_token, tok.cls_token_id))
    return tok


def test_the_interpreter_reads_lmbff_templates_as_written():
    """Hand-derived strings, so that a slip shared by the interpreter and a task spec cannot hide."""
    assert lmbff_text(SENTIMENT, ["a gripping film ."]) == "a gripping film . It was<mask>."
    assert lmbff_text(NLI, ["A man runs.", "A person moves."]) == "A man runs?<mask>, a person moves."
    assert lmbff_text(NLI, ["Who runs?", "The man runs."]) == "Who runs?<mask>, the man runs."
    assert lmbff_text(LMBFF_TEMPLATES["trec"], ["Who wrote Hamlet ?"]) == "<mask>: Who wrote Hamlet ?"
    assert lmbff_parts("*cls**sentl-_1*_and*+sent_0**sep*", ["Go now", "Stop."]) == [
        ("special", "cls"), ("sentence", "stop"), ("literal", " and"), ("sentence", " Go now"), ("special", "sep")]


# Rows that exercise each rule: no final full stop, a final quote or space, a lower-case, quoted or numeric start.
SYNTHETIC = [
    ["A man runs.", "A person moves."],
    ["The dog barked", "Nothing happened."],
    ['She said "go."', '"Go" was said.'],
    ["Prices rose 5% in 1999 .", "iPhones sold well."],
    ["Who wrote Hamlet ?", "Ápple trees bloom."],
    ["x", "1990 was a year."],
]


@pytest.mark.parametrize("task", sorted(LMBFF_TEMPLATES))
def test_masked_templates_render_lmbff_text(task):
    s = spec(task)
    for sentences in SYNTHETIC:
        sentences = sentences[: len(SENTENCES[task])]
        assert rendered(task, s, sentences) == lmbff_text(LMBFF_TEMPLATES[task], sentences)


@pytest.mark.parametrize("task", sorted(LMBFF_TEMPLATES))
def test_encoding_gives_lmbff_ids(task):
    """Our ids (scoring.encode) are LM-BFF's, cls and sep included, whether or not part boundaries are word
    boundaries: the template's parts are encoded one by one, as LM-BFF does."""
    s, tok = spec(task), roberta_style_tokenizer(("It", "was", "man", "runs", "?"))
    for sentences in SYNTHETIC:
        sentences = sentences[: len(SENTENCES[task])]
        example = s.for_family("masked", tok.mask_token).render(dict(zip(SENTENCES[task], sentences)), 0)
        (ours,) = encode([example], tok, "masked", max_length=512)
        assert ours.prompt == lmbff_ids(LMBFF_TEMPLATES[task], sentences, tok)


def test_a_question_ending_in_space_question_mark_gets_lmbff_ids():
    """QNLI's "... become known as ?": LM-BFF encodes "... as " and "?" apart (" ", "?"); one piece merges " ?"."""
    s, tok = spec("qnli"), roberta_style_tokenizer(("?",))
    sentences = ["When did it become known as ?", "It became known in 1990."]
    assert not pretokens_agree(NLI, sentences)
    example = s.for_family("masked", tok.mask_token).render(dict(zip(SENTENCES["qnli"], sentences)), 0)
    (ours,) = encode([example], tok, "masked", max_length=512)
    assert ours.prompt == lmbff_ids(NLI, sentences, tok)


# --------------------------------------------------------------------------------------------------------------
# Real rows: LM-BFF's k-shot files, read as LM-BFF's processors read them, against our loader and template.

# TSV tasks: (folder, sentence column indices); read with csv, tab-separated, no quoting, header skipped.
LMBFF_TSV = {"sst2": ("SST-2", (0,)), "rte": ("RTE", (1, 2)), "qnli": ("QNLI", (1, 2)), "mnli": ("MNLI", (8, 9)),
             "snli": ("SNLI", (7, 8))}
# CSV tasks (sst-5, mr, cr, trec): pandas.read_csv without a header, the sentence in column 1.
LMBFF_CSV = {"sst5": "sst-5", "mr": "mr", "cr": "cr", "trec": "trec"}
SPLITS = {"train": "train", "dev": "dev", "eval": "test"}  # our split: LM-BFF's file stem (MNLI: *_matched)
SEEDS = (13, 21, 42, 87, 100)


def lmbff_sentences(task: str, folder: Path, split: str) -> list[list[str]] | None:
    """The sentences of every row of a split file, as LM-BFF reads them; None when the file is not there."""
    stem = SPLITS[split] + ("_matched" if task == "mnli" and split != "train" else "")
    if task in LMBFF_TSV:
        path = folder / f"{stem}.tsv"
        if not path.is_file():
            return None
        with open(path, encoding="utf-8-sig") as f:
            lines = list(csv.reader(f, delimiter="\t", quotechar=None))[1:]
        return [[line[i] for i in LMBFF_TSV[task][1]] for line in lines]
    path = folder / f"{stem}.csv"
    if not path.is_file():
        return None
    return [[line[1]] for line in pd.read_csv(path, header=None).values.tolist()]


def kshot_folder(task: str) -> Path:
    name = LMBFF_TSV[task][0] if task in LMBFF_TSV else LMBFF_CSV[task]
    return SHARED_DATA / "lm-bff" / "k-shot" / name


REAL_TASKS = sorted(t for t in LMBFF_TEMPLATES if kshot_folder(t).is_dir())


@needs_shared_data
@pytest.mark.parametrize("task", REAL_TASKS)
def test_real_rows_render_lmbff_text(task):
    s, template, compared = spec(task), LMBFF_TEMPLATES[task], 0
    bound = s.for_family("masked", MASK)
    for seed in SEEDS:
        for split in SPLITS:
            theirs = lmbff_sentences(task, kshot_folder(task) / f"16-{seed}", split)
            if theirs is None:  # MNLI's and SNLI's test sets are not in the shared data
                continue
            rows, _ = load_rows(bound, split, str(SHARED_DATA), k=16, kshot_seed=seed)
            assert len(rows) == len(theirs)
            for row, sentences in zip(rows, theirs):
                assert bound.render(row, row["label"]).prompt == lmbff_text(template, sentences)
            compared += len(rows)
    assert compared >= 5 * 2 * 16 * len(s.labels)  # every seed's train and dev at least


@needs_shared_data
@pytest.mark.parametrize("task", REAL_TASKS)
def test_real_rows_get_lmbff_ids(task):
    """Every row of one data seed's splits, NLI premises ending in ".?" or " ?" included."""
    s, template, tok = spec(task), LMBFF_TEMPLATES[task], roberta_style_tokenizer(("?", "It", "was"))
    folder, checked, unclean, limited = kshot_folder(task) / "16-13", 0, 0, 0
    for split in SPLITS:
        theirs = lmbff_sentences(task, folder, split)
        if theirs is None:
            continue
        bound = s.for_family("masked", tok.mask_token)
        rows, _ = load_rows(bound, split, str(SHARED_DATA), k=16, kshot_seed=13)
        examples = [bound.render(row, row["label"]) for row in rows]
        for ours, sentences in zip(encode(examples, tok, "masked", max_length=10**6), theirs):
            expected = lmbff_ids(template, sentences, tok, REFERENCE_LIMITS[task])
            if expected is None:  # LM-BFF stops on this row; we cut around the mask instead
                assert tok.mask_token_id in ours.prompt and len(ours.prompt) == REFERENCE_LIMITS[task][0]
                continue
            assert ours.prompt == expected, sentences
            unclean += not pretokens_agree(template, sentences)
            limited += ours.truncated
        checked += len(rows)
    assert checked >= 2 * 16 * len(s.labels)
    if task in ("rte", "qnli"):
        assert unclean > 0  # the rows one-piece encoding would get wrong are among those checked
    if task in ("rte", "mr", "qnli"):
        assert limited > 0  # and rows the sentence limits or the length cut (one token per character here)


@needs_shared_data
@pytest.mark.parametrize("task", [t for t in REAL_TASKS if LMBFF_TEMPLATES[t] == SENTIMENT])
def test_real_single_sentences_get_lmbff_ids_with_any_byte_level_bpe(task):
    """Sentence, " It was", mask, ".": boundaries that RoBERTa's pre-tokeniser keeps, on every real row."""
    for seed in SEEDS:
        for split in SPLITS:
            for sentences in lmbff_sentences(task, kshot_folder(task) / f"16-{seed}", split) or []:
                assert pretokens_agree(SENTIMENT, sentences), sentences
