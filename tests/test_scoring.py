"""Candidate scoring: the packed, shared-prompt computation equals the plain one-sequence-per-candidate one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adazeta.models import ModelConfig, load_model
from adazeta.scoring.evaluate import evaluate
from adazeta.models import byte_tokenizer
from adazeta.scoring import (
    LAYOUTS,
    Scorer,
    PACKED_MODEL_TYPES,
    batch_loss,
    candidate_scores,
    collate,
    encode,
    packing_supported,
    replica_losses,
)
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


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("examples", [EXAMPLES_MULTI, EXAMPLES_SINGLE, EXAMPLES_MULTI + EXAMPLES_SINGLE])
def test_packed_scores_equal_plain_scores(examples, layout):
    loaded = tiny()
    enc = encode(examples, loaded.tokenizer, "causal", max_length=256)
    batch = collate(enc, "causal", loaded.tokenizer.pad_token_id, layout=layout)
    assert batch.packed == (layout == "packed")
    with torch.no_grad():
        ours = candidate_scores(loaded.model, batch, "causal")
        ref = plain_scores(loaded.model, loaded.tokenizer, examples)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    loss = batch_loss(loaded.model, batch, "causal")
    torch.testing.assert_close(loss, F.cross_entropy(ref, torch.tensor([e.gold for e in examples])), atol=1e-5, rtol=0)


def test_rows_layout_uses_one_row_per_example_or_candidate():
    loaded = tiny()
    enc = encode(EXAMPLES_SINGLE + EXAMPLES_MULTI[:1], loaded.tokenizer, "causal", max_length=256)
    batch = collate(enc, "causal", loaded.tokenizer.pad_token_id, layout="rows")
    assert not batch.packed
    assert batch.input_ids.shape[0] == len(EXAMPLES_SINGLE) + 2  # single-token: 1 row each; multi: 1 per candidate


def test_packed_layout_holds_each_prompt_once_and_pads_less():
    loaded = tiny()
    enc = encode(EXAMPLES_MULTI + EXAMPLES_SINGLE, loaded.tokenizer, "causal", max_length=256)
    packed = collate(enc, "causal", loaded.tokenizer.pad_token_id)
    rows = collate(enc, "causal", loaded.tokenizer.pad_token_id, layout="rows")
    # Every prompt once, every candidate's tokens but its last: nothing else but padding.
    assert int(packed.attention_mask.sum()) == sum(len(e.prompt) + sum(len(c) - 1 for c in e.candidates) for e in enc)
    assert packed.input_ids.shape[1] == max(e.num_tokens() for e in enc)  # no row longer than the longest example
    assert packed.input_ids.numel() < rows.input_ids.numel()


def test_a_shared_prompt_is_projected_to_the_vocabulary_once():
    loaded = tiny()
    enc = encode(EXAMPLES_SINGLE, loaded.tokenizer, "causal", max_length=256)
    for layout in LAYOUTS:
        batch = collate(enc, "causal", loaded.tokenizer.pad_token_id, layout=layout)
        assert batch.targets.numel() == 6  # two one-token candidates per example...
        assert batch.positions.numel() == 3  # ...read at one position per example


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


# Tiny configs of every architecture the packed layout is allowed on (PACKED_MODEL_TYPES).
ARCHITECTURES = {
    "llama": TINY_LLAMA,
    "mistral": TINY_LLAMA,
    "qwen2": TINY_LLAMA,
    "qwen3": {**TINY_LLAMA, "head_dim": 8},
    "gemma": {**TINY_LLAMA, "head_dim": 8},
    "opt": {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "word_embed_proj_dim": 32},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4},
    "gpt_neox": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
    "phi": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
}


def test_every_packed_architecture_has_a_tiny_config_here():
    assert set(ARCHITECTURES) == set(PACKED_MODEL_TYPES)


@pytest.mark.parametrize(
    "model_type, attention", [(t, "sdpa") for t in sorted(ARCHITECTURES)] + [("llama", "eager"), ("gpt2", "eager")]
)
def test_packed_layout_is_exact_on_every_allowed_architecture(model_type, attention):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = byte_tokenizer()
    arch = {k: v for k, v in ARCHITECTURES[model_type].items() if k != "model_type"}
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), **arch)
    config.pad_token_id = tok.pad_token_id
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert packing_supported(model)
    examples = EXAMPLES_MULTI + EXAMPLES_SINGLE
    batch = collate(encode(examples, tok, "causal", 256), "causal", tok.pad_token_id)
    with torch.no_grad():
        torch.testing.assert_close(candidate_scores(model, batch, "causal"), plain_scores(model, tok, examples),
                                   atol=1e-5, rtol=1e-5)


def test_models_without_packing_support_fall_back_to_rows(monkeypatch):
    loaded = tiny()
    batch = collate(encode(EXAMPLES_MULTI, loaded.tokenizer, "causal", 256), "causal", loaded.tokenizer.pad_token_id)
    monkeypatch.setattr(loaded.model.config, "_attn_implementation", "flash_attention_2")
    assert not packing_supported(loaded.model)  # flash kernels ignore custom masks
    monkeypatch.setattr(loaded.model.config, "_attn_implementation", "sdpa")
    monkeypatch.setattr(loaded.model.config, "model_type", "unknown")  # runnable here, but not known to pack
    assert not packing_supported(loaded.model)
    masks = []
    loaded.model.get_decoder().register_forward_pre_hook(
        lambda m, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    with torch.no_grad():
        ours = candidate_scores(loaded.model, batch, "causal")
        ref = plain_scores(loaded.model, loaded.tokenizer, EXAMPLES_MULTI)
    assert masks[0].dim() == 2  # a plain padding mask: the rows layout
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_a_sliding_window_shorter_than_the_rows_turns_packing_off():
    loaded = tiny()
    loaded.model.config.model_type = "mistral"
    loaded.model.config.sliding_window = 16
    assert packing_supported(loaded.model, max_position=8)
    assert not packing_supported(loaded.model, max_position=16)


def test_evaluation_loss_and_accuracy_equal_the_plain_computation():
    loaded = tiny()
    tok = loaded.tokenizer
    examples = (EXAMPLES_MULTI + EXAMPLES_SINGLE) * 2
    with torch.no_grad():
        ref = plain_scores(loaded.model, tok, examples)
    gold = torch.tensor([e.gold for e in examples])
    enc = encode(examples, tok, "causal", 256)
    for layout in LAYOUTS:
        batches = [collate(enc[i : i + 4], "causal", tok.pad_token_id, layout=layout) for i in range(0, len(enc), 4)]
        result = evaluate(Scorer.of(loaded.model, tok), batches)
        assert result.loss == pytest.approx(F.cross_entropy(ref, gold).item(), abs=1e-5)
        assert result.score == (ref.argmax(1) == gold).float().mean().item()
        assert result.n == len(examples)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replica_losses_repeat_the_batch_loss(layout):
    loaded = tiny()
    enc = encode(EXAMPLES_MULTI + EXAMPLES_SINGLE, loaded.tokenizer, "causal", 256)
    batch = collate(enc, "causal", loaded.tokenizer.pad_token_id, layout=layout)
    with torch.no_grad():
        one = batch_loss(loaded.model, batch, "causal")
        three = replica_losses(loaded.model, batch, "causal", 3)
    assert three.shape == (3,)
    torch.testing.assert_close(three, one.expand(3), atol=1e-6, rtol=1e-6)


def test_the_backbone_of_a_model_whose_get_decoder_returns_itself_is_its_base_model(monkeypatch):
    """transformers 4.x's get_decoder() returns the LM itself for GPT-2 and GPT-NeoX (their decoder is not
    `.model`); scoring then needs the base model's hidden states, not the LM's logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from adazeta.scoring import lm_parts

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    monkeypatch.setattr(GPT2LMHeadModel, "get_decoder", lambda self: self)
    backbone, head = lm_parts(model, "causal")
    assert backbone is model.transformer and head is model.lm_head
    out = backbone(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    assert out.last_hidden_state.shape == (1, 3, 16)
