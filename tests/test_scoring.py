"""Candidate scoring: the packed, shared-prompt computation equals the plain one-sequence-per-candidate one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adazeta.models import ModelConfig, load_model
from adazeta.scoring import batch_loss, candidate_scores, collate, encode
from adazeta.tasks.spec import Example

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_ROBERTA = {
    "model_type": "roberta",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 130,
    "type_vocab_size": 1,
}


def tiny(family: str = "causal"):
    arch = TINY_LLAMA if family == "causal" else TINY_ROBERTA
    return load_model(ModelConfig(name="t", family=family, random_init=True, architecture=arch, device="cpu"), seed=1)


def plain_scores(model, tokenizer, examples: list[Example]) -> torch.Tensor:
    """Reference: each (prompt, candidate) a separate sequence, full-vocabulary log-softmax everywhere."""
    rows = []
    for ex in examples:
        prompt = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        scores = []
        for cand in ex.candidates:
            ids = tokenizer(cand, add_special_tokens=False)["input_ids"]
            seq = torch.tensor([prompt + ids])
            logp = F.log_softmax(model(input_ids=seq).logits.float(), dim=-1)[0]
            picked = [logp[len(prompt) + k - 1, tok] for k, tok in enumerate(ids)]
            scores.append(torch.stack(picked).mean())
        rows.append(torch.stack(scores))
    return torch.stack(rows)


EXAMPLES_MULTI = [
    Example("the movie was", [" great fun", " bad"], 0),
    Example("a long plot, and then", [" it ended", " nothing happened at all"], 1),
    Example("x", [" yes", " no"], 1),
]
EXAMPLES_SINGLE = [  # one byte each: the shared-prompt path
    Example("the movie was", ["+", "-"], 0),
    Example("a long plot, then the end", ["A", "B"], 1),
    Example("short", ["1", "2"], 0),
]


@pytest.mark.parametrize("examples", [EXAMPLES_MULTI, EXAMPLES_SINGLE, EXAMPLES_MULTI + EXAMPLES_SINGLE])
def test_packed_scores_equal_plain_scores(examples):
    loaded = tiny()
    enc = encode(examples, loaded.tokenizer, "causal", max_length=256)
    batch = collate(enc, "causal", loaded.tokenizer.pad_token_id)
    with torch.no_grad():
        ours = candidate_scores(loaded.model, batch, "causal")
        ref = plain_scores(loaded.model, loaded.tokenizer, examples)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    loss = batch_loss(loaded.model, batch, "causal")
    torch.testing.assert_close(loss, F.cross_entropy(ref, torch.tensor([e.gold for e in examples])), atol=1e-5, rtol=0)


def test_shared_prompt_uses_one_row_per_example():
    loaded = tiny()
    enc = encode(EXAMPLES_SINGLE + EXAMPLES_MULTI[:1], loaded.tokenizer, "causal", max_length=256)
    batch = collate(enc, "causal", loaded.tokenizer.pad_token_id)
    assert batch.input_ids.shape[0] == len(EXAMPLES_SINGLE) + 2  # single-token: 1 row each; multi: 1 per candidate


def test_uneven_candidate_counts_are_padded_with_minus_inf():
    loaded = tiny()
    examples = [Example("a", ["1", "2", "3"], 2), Example("b", ["1", "2"], 0)]
    batch = collate(encode(examples, loaded.tokenizer, "causal", 64), "causal", loaded.tokenizer.pad_token_id)
    with torch.no_grad():
        scores = candidate_scores(loaded.model, batch, "causal")
    assert scores.shape == (2, 3)
    assert torch.isinf(scores[1, 2]) and torch.isfinite(scores[0]).all()


def test_long_prompts_are_cut_from_the_left():
    loaded = tiny()
    ex = Example("X" * 100 + " the question?", [" yes", " no"], 0)
    (enc,) = encode([ex], loaded.tokenizer, "causal", max_length=32)
    tail = loaded.tokenizer(" the question?", add_special_tokens=False)["input_ids"]
    assert len(enc.prompt) + max(len(c) for c in enc.candidates) <= 32
    assert enc.prompt[-len(tail) :] == tail  # the question survives whole


def test_masked_scores_are_label_word_logits_at_the_mask():
    loaded = tiny("masked")
    tok = loaded.tokenizer
    examples = [Example(f"good film . It was {tok.mask_token} .", ["great", "terrible"], 1)]
    enc = encode(examples, tok, "masked", max_length=128)
    batch = collate(enc, "masked", tok.pad_token_id, tok.mask_token_id)
    with torch.no_grad():
        ours = candidate_scores(loaded.model, batch, "masked")
        logits = loaded.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[0]
    at = enc[0].prompt.index(tok.mask_token_id)
    word_ids = [tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in ("great", "terrible")]
    torch.testing.assert_close(ours[0], logits[at, word_ids], atol=1e-5, rtol=1e-5)
