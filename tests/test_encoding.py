"""Prompt + candidates -> token ids (``scoring.encode``): MeZO's joint tokenisation and truncation, never refusal.

MeZO tokenises each verbalised string (prompt + candidate) in one piece and scores its tail; a SentencePiece
tokenizer (Llama-2, Gemma) tokenises a lone candidate differently (a word-start marker, a prefix space), so
candidates are read off the joint tokenisation. Long inputs are cut as the references cut them: decoders keep
BOS and the prompt's last tokens (MeZO); masked LMs keep the mask and the template around it (LM-BFF).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from adazeta.errors import ConfigError
from adazeta.models import byte_tokenizer
from adazeta.run import run
from adazeta.settings import parse
from adazeta.scoring import candidate_scores, collate, encode
from adazeta.tasks.loaders import load_rows
from adazeta.tasks.spec import Example
from helpers import SHARED_DATA, SHARED_MODELS, compose_cfg, needs_shared_data, needs_shared_model

MARK = "▁"  # SentencePiece's word-start marker
SP_WORDS = ["Yes", "No", "Maybe", "great", "terrible", "It", "was", "good", "film", "Does", "this", "mean"]


def sentencepiece_tokenizer(legacy: bool = False):
    """A tiny Llama-style tokenizer: BPE over characters with byte fallback, ``▁`` word starts, a BOS token.

    ``legacy=False`` is today's Llama / Gemma layout (a Metaspace pre-tokenizer that prepends ``▁`` to the text);
    ``legacy=True`` is Llama-2's original one (a normalizer that prepends ``▁`` and turns every space into ``▁``).
    """
    from transformers import LlamaTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])}
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789?.,'\"-" + MARK:
        vocab.setdefault(c, len(vocab))
    merges = []
    for word in [MARK + w for w in SP_WORDS] + SP_WORDS:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                vocab[word[:i]] = len(vocab)
                merges.append((word[: i - 1], word[i - 1]))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    if legacy:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(MARK), normalizers.Replace(" ", MARK)])
        backend.decoder = decoders.Sequence([decoders.Replace(MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=MARK, prepend_scheme="first", split=False)
        backend.decoder = decoders.Metaspace(replacement=MARK, prepend_scheme="first", split=False)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = LlamaTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                             add_bos_token=True)
    tok.pad_token = "<unk>"
    return tok


def roberta_style_tokenizer():
    """The tiny models' byte-level tokenizer with RoBERTa's special tokens around every text: ``<s> ... </s>``."""
    tok = byte_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.bos_token_id), ("</s>", tok.eos_token_id)]
    )
    return tok


def pieces(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


RTE_LIKE = Example('A film was good.\nDoes this mean that "It was good." is true? Yes or No?\n', ["Yes", "No"], 0)
SST2_LIKE = Example("good film It was", [" terrible", " great"], 1)


@pytest.mark.parametrize("legacy", [False, True], ids=["metaspace", "legacy-normalizer"])
def test_candidates_are_the_tail_of_the_joint_sentencepiece_tokenisation(legacy):
    tok = sentencepiece_tokenizer(legacy)
    # On its own a candidate is tokenised as a word of its own, unlike inside the verbalised string.
    assert pieces(tok, "Yes") == [MARK + "Yes"] and pieces(tok, RTE_LIKE.prompt + "Yes")[-1] == "Yes"
    if legacy:
        assert pieces(tok, " great") == [MARK, MARK + "great"]  # the spurious word-start token
    assert pieces(tok, SST2_LIKE.prompt + " great")[-1] == MARK + "great"
    for ex in (RTE_LIKE, SST2_LIKE):
        (enc,) = encode([ex], tok, "causal", max_length=512)
        assert enc.prompt[0] == tok.bos_token_id and not enc.truncated
        for cand, ids in zip(ex.candidates, enc.candidates):
            # MeZO's ids: tokenizer.encode(prompt + candidate), BOS included; its last option_len are scored.
            assert enc.prompt + ids == tok(ex.prompt + cand)["input_ids"]
            assert len(ids) == len(tok(ex.prompt + cand)["input_ids"]) - len(tok(ex.prompt)["input_ids"])
        separate = [tok(c, add_special_tokens=False)["input_ids"] for c in ex.candidates]
        if ex is RTE_LIKE or legacy:  # Metaspace tokenises " great" alone as in the joint string
            assert enc.candidates != separate


def test_shared_prompt_scores_equal_mezo_scores_of_the_whole_verbalised_strings():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = sentencepiece_tokenizer(legacy=True)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    examples = [RTE_LIKE, SST2_LIKE, Example("It was", [" a great film", " No"], 0)]
    batch = collate(encode(examples, tok, "causal", 512), "causal", tok.pad_token_id)
    with torch.no_grad():
        ours = candidate_scores(model, batch, "causal")
        for i, ex in enumerate(examples):
            for j, cand in enumerate(ex.candidates):  # MeZO: mean log-probability of the last option_len tokens
                ids = tok(ex.prompt + cand)["input_ids"]
                option_len = len(ids) - len(tok(ex.prompt)["input_ids"])
                logp = F.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
                mezo = torch.stack([logp[t - 1, ids[t]] for t in range(len(ids) - option_len, len(ids))]).mean()
                torch.testing.assert_close(ours[i, j], mezo, atol=1e-5, rtol=1e-5)


def test_byte_level_candidates_are_the_joint_tail_and_a_trailing_space_goes_with_the_candidate():
    tok = byte_tokenizer()
    for ex in (RTE_LIKE, SST2_LIKE):
        (enc,) = encode([ex], tok, "causal", 512)
        assert enc.prompt == tok(ex.prompt, add_special_tokens=False)["input_ids"]  # nothing changes here
        assert enc.candidates == [tok(c, add_special_tokens=False)["input_ids"] for c in ex.candidates]
    # A prompt ending in a space (ReCoRD's "- "): the joint string has no lone space token; as in MeZO, which
    # strips the prompt's trailing spaces, the prompt ends before it and the candidate is " Yes ...".
    ex = Example("passage\n- ", ["Yes it is", "No"], 0)
    (enc,) = encode([ex], tok, "causal", 512)
    assert enc.prompt == tok("passage\n-", add_special_tokens=False)["input_ids"]
    assert enc.candidates == [tok(" " + c, add_special_tokens=False)["input_ids"] for c in ex.candidates]
    with pytest.raises(ConfigError, match="candidate '' adds no token"):
        encode([Example("passage", ["", "No"], 0)], tok, "causal", 512)


def test_long_causal_prompts_keep_bos_and_their_last_tokens():
    tok = sentencepiece_tokenizer()
    ex = Example("film " * 60 + "It was", [" terrible", " a great film"], 1)
    (full,) = encode([ex], tok, "causal", 512)
    (cut,) = encode([ex], tok, "causal", 32)
    longest = max(len(c) for c in cut.candidates)
    assert cut.truncated and not full.truncated
    assert cut.candidates == full.candidates  # candidates are never cut
    assert len(cut.prompt) + longest == 32 and cut.prompt[0] == tok.bos_token_id
    assert cut.prompt[1:] == full.prompt[-(31 - longest) :]
    with pytest.raises(ConfigError, match="does not fit model.max_length=3"):
        encode([ex], tok, "causal", 3)


@pytest.mark.parametrize(
    "prompt, expect",
    [
        # (prompt, the text that survives) with max_length 24; one token per character here, plus one for each
        # space ("Ġ") and the mask. The mask within the first 24 tokens: LM-BFF's cut, the first 24 tokens
        # (no </s>); else the text around the mask, <s> and </s> kept.
        ("why ? <mask> , " + "x" * 40, "<s>why ? <mask> , " + "x" * 13),  # QNLI: the sentence's tail goes
        ("<mask> : " + "q" * 40, "<s><mask> : " + "q" * 19),  # TREC
        ("y" * 40 + " It was <mask> .", "<s>" + "y" * 11 + " It was <mask> .</s>"),  # SST-2: its head goes
        ("p" * 30 + " ? <mask> , " + "h" * 30, "<s>" + "p" * 8 + " ? <mask> , " + "h" * 7 + "</s>"),  # both
    ],
)
def test_long_masked_prompts_keep_the_mask_and_the_template(prompt, expect):
    tok = roberta_style_tokenizer()
    (enc,) = encode([Example(prompt, ["Yes", "No"], 0)], tok, "masked", max_length=24)
    assert enc.truncated and len(enc.prompt) == 24
    assert enc.prompt == tok(expect, add_special_tokens=False)["input_ids"]
    assert enc.candidates == [tok(" Yes", add_special_tokens=False)["input_ids"],
                              tok(" No", add_special_tokens=False)["input_ids"]]


# --------------------------------------------------------------------------------------------------------------
# Real rows from ../shared/data

CAUSAL_TASKS = ("boolq", "cb", "copa", "multirc", "rte", "sst2", "wic")
MASKED_TASKS = ("cr", "mnli", "mr", "qnli", "rte", "snli", "sst2", "sst5")


def real_examples(task: str, family: str, mask_token: str | None, longest: int = 6, shortest: int = 2):
    """The longest (and a few of the shortest) rendered examples of every split of the task present offline."""
    bound = parse(compose_cfg([f"task={task}"])).task.for_family(family, mask_token)
    out = []
    for split in ("train", "dev", "eval"):
        if family == "causal" and split == "dev":
            continue  # the causal protocol samples dev from train
        try:
            rows, _ = load_rows(bound, split, str(SHARED_DATA))
        except ConfigError:  # the split is not offline (BoolQ's full train set, MNLI's test set)
            continue
        examples = sorted((bound.render(r, r.get("label", 0)) for r in rows),
                          key=lambda e: len(e.prompt) + max(len(c) for c in e.candidates))
        out += examples[:shortest] + examples[-longest:]
    assert out, f"no offline data for {task}"
    return out


@needs_shared_data
@pytest.mark.parametrize("task", MASKED_TASKS)
def test_longest_real_masked_rows_are_truncated_around_the_mask(task):
    tok = roberta_style_tokenizer()
    examples = real_examples(task, "masked", tok.mask_token)
    max_length = 48
    full = encode(examples, tok, "masked", 10**6)
    cut = encode(examples, tok, "masked", max_length)
    assert sum(e.truncated for e in cut) == sum(e.truncated or len(e.prompt) > max_length for e in full) > 0
    for f, c in zip(full, cut):
        assert c.candidates == f.candidates and len(c.prompt) == min(len(f.prompt), max_length)
        if tok.mask_token_id in f.prompt[:max_length]:  # LM-BFF's cut: the first max_length tokens
            assert c.prompt == f.prompt[:max_length]
            continue
        assert c.prompt[0] == tok.bos_token_id and c.prompt[-1] == tok.eos_token_id
        at, f_at = c.prompt.index(tok.mask_token_id), f.prompt.index(tok.mask_token_id)
        # The template's tokens next to the mask survive (" It was" / " ?" / " ," are at most 4 tokens away).
        assert c.prompt[max(at - 4, 1) : at + 3] == f.prompt[f_at - (at - max(at - 4, 1)) : f_at + 3]


@needs_shared_data
@pytest.mark.parametrize("task", CAUSAL_TASKS)
@pytest.mark.parametrize("tokenizer", ["byte-level", "sentencepiece"])
def test_longest_real_causal_rows_are_cut_from_the_left(task, tokenizer):
    tok = byte_tokenizer() if tokenizer == "byte-level" else sentencepiece_tokenizer()
    examples = real_examples(task, "causal", None)
    max_length = 96
    full = encode(examples, tok, "causal", 10**6)
    cut = encode(examples, tok, "causal", max_length)
    longest = [max(len(c) for c in e.candidates) for e in full]
    assert sum(e.truncated for e in cut) == sum(len(e.prompt) + n > max_length for e, n in zip(full, longest)) > 0
    bos = 1 if tokenizer == "sentencepiece" else 0
    for f, c, n in zip(full, cut, longest):
        assert c.candidates == f.candidates
        assert len(c.prompt) + n == min(len(f.prompt) + n, max_length)
        assert c.prompt[:bos] == f.prompt[:bos] and c.prompt[bos:] == f.prompt[len(f.prompt) - len(c.prompt) + bos :]


@needs_shared_data
def test_qnli_on_tiny_roberta_truncates_and_records_how_many(tmp_path):
    overrides = ["model=tiny-roberta", "task=qnli", "method=zero_shot", f"data.dir={SHARED_DATA}",
                 "data.num_eval=200", "wandb.mode=disabled"]
    cfg = compose_cfg(overrides)
    record = run(cfg, tmp_path)
    assert record["status"] == "finished"
    saved = json.loads((tmp_path / "result.json").read_text())
    # The count, recomputed: examples whose prompt is longer than QNLI's reference length, 128 tokens (below
    # model.max_length, 384), with the model's tokenizer.
    from adazeta.tasks.loaders import DataConfig, load_task

    s = parse(cfg)
    tok = byte_tokenizer()
    data = load_task(s.bound_task().with_mask(tok.mask_token), DataConfig(dir=str(SHARED_DATA), num_eval=200), s.seed)
    expected = {split: sum(len(tok(e.prompt)["input_ids"]) > 128 for e in getattr(data, split))
                for split in ("train", "dev", "eval")}
    assert saved["truncated"] == expected and expected["eval"] > 0


@pytest.mark.slow
@needs_shared_data
@needs_shared_model
def test_smollm2_ids_are_unchanged_on_real_sst2_and_rte():
    """SmolLM2's byte-level BPE never merges across the prompt/candidate boundary: the joint tail is the
    candidate's own tokenisation, so every id is what separate encoding gave before."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHARED_MODELS / "SmolLM2-135M-Instruct",
                                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not getattr(tok, "add_bos_token", False)
    examples = []
    for task in ("sst2", "rte"):
        bound = parse(compose_cfg([f"task={task}"])).task.for_family("causal")
        for split in ("train", "eval"):
            rows, _ = load_rows(bound, split, str(SHARED_DATA))
            examples += [bound.render(r, r["label"]) for r in rows[:3000]]
    for ex, enc in zip(examples, encode(examples, tok, "causal", 512)):
        assert enc.prompt == tok(ex.prompt, add_special_tokens=False)["input_ids"]
        assert enc.candidates == [tok(c, add_special_tokens=False)["input_ids"] for c in ex.candidates]
        assert not enc.truncated
