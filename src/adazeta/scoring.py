"""Candidate scoring: tokenise examples, pack them into batches, and score every candidate in one forward.

Causal LMs (MeZO protocol, SPEC §6): a candidate's score is the mean log-probability of its tokens given the
prompt. The training loss is the cross-entropy over the candidates' scores. Masked LMs (LM-BFF): the score of a
label word is its logit at the mask position; the loss is the cross-entropy over the label words.

Two savings over scoring one full sequence per candidate, without changing any number:
- candidates that are one token long share their prompt: one sequence per example, and every candidate is read
  from the logits at the prompt's last position;
- the vocabulary projection (and its log-softmax) runs only at the positions that are scored, not at every
  position of every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from adazeta.errors import ConfigError
from adazeta.tasks.spec import Example


@dataclass
class Encoded:
    """One example as token ids: the prompt, each candidate's continuation, the gold index."""

    prompt: list[int]
    candidates: list[list[int]]
    gold: int

    @property
    def shared_prompt(self) -> bool:
        return all(len(c) == 1 for c in self.candidates)

    def num_tokens(self) -> int:
        if self.shared_prompt:
            return len(self.prompt)
        return sum(len(self.prompt) + len(c) for c in self.candidates)


@dataclass
class Batch:
    """Packed rows plus the flat index of every scored token. Lives on one device."""

    input_ids: torch.Tensor  # (rows, T)
    attention_mask: torch.Tensor  # (rows, T)
    positions: torch.Tensor  # (N,) flat index row * T + t of the hidden state that predicts a scored token
    targets: torch.Tensor  # (N,) the scored token ids
    token_candidate: torch.Tensor  # (N,) flat candidate index of each scored token
    candidate_length: torch.Tensor  # (C,) tokens per candidate (float, for the mean)
    candidate_slot: torch.Tensor  # (C,) example * max_candidates + j
    gold: torch.Tensor  # (B,)
    max_candidates: int

    @property
    def num_examples(self) -> int:
        return int(self.gold.shape[0])

    def to(self, device: torch.device) -> "Batch":
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return Batch(**moved)


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode(examples: Sequence[Example], tokenizer: Any, family: str, max_length: int) -> list[Encoded]:
    """Tokenise prompts and candidates separately (so the candidate tokens are exactly the scored ones).

    Prompts too long for ``max_length`` are cut from the left, which keeps the question and the candidate whole.
    """
    out = []
    bos = [tokenizer.bos_token_id] if family == "causal" and getattr(tokenizer, "add_bos_token", False) else []
    for ex in examples:
        if family == "masked":
            prompt = tokenizer(ex.prompt, add_special_tokens=True, truncation=False)["input_ids"]
            cands = []
            for word in ex.candidates:
                ids = _encode_text(tokenizer, " " + word.strip())
                if len(ids) != 1:
                    raise ConfigError(f"label word {word!r} is {len(ids)} tokens for this tokenizer; masked scoring needs one")
                cands.append(ids)
            if len(prompt) > max_length:
                mask_at = prompt.index(tokenizer.mask_token_id)
                cut = len(prompt) - max_length
                if cut >= mask_at:
                    raise ConfigError(f"prompt longer than model.max_length={max_length} even after truncation")
                prompt = prompt[:1] + prompt[1 + cut :]
        else:
            prompt = bos + _encode_text(tokenizer, ex.prompt)
            cands = [_encode_text(tokenizer, c) for c in ex.candidates]
            longest = max(len(c) for c in cands)
            if longest >= max_length:
                raise ConfigError(f"a candidate of {longest} tokens does not fit model.max_length={max_length}")
            if len(prompt) + longest > max_length:
                prompt = prompt[len(prompt) + longest - max_length :]
        out.append(Encoded(prompt, cands, ex.gold))
    return out


def collate(items: Sequence[Encoded], family: str, pad_id: int, mask_id: int | None = None) -> Batch:
    """Pack examples into right-padded rows and record which hidden state scores which candidate token."""
    rows: list[list[int]] = []
    scored: list[tuple[int, int, int, int]] = []  # (row, t, target token, flat candidate)
    cand_len: list[int] = []
    cand_slot: list[int] = []
    max_c = max(len(e.candidates) for e in items)

    def add_candidate(i: int, j: int, tokens: list[tuple[int, int, int]]) -> None:
        c = len(cand_len)
        scored.extend((r, t, tok, c) for r, t, tok in tokens)
        cand_len.append(len(tokens))
        cand_slot.append(i * max_c + j)

    for i, ex in enumerate(items):
        if family == "masked" or ex.shared_prompt:
            r = len(rows)
            rows.append(ex.prompt)
            at = ex.prompt.index(mask_id) if family == "masked" else len(ex.prompt) - 1
            for j, cand in enumerate(ex.candidates):
                add_candidate(i, j, [(r, at, cand[0])])
        else:
            for j, cand in enumerate(ex.candidates):
                r = len(rows)
                rows.append(ex.prompt + cand)
                add_candidate(i, j, [(r, len(ex.prompt) + k - 1, tok) for k, tok in enumerate(cand)])
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention_mask[r, : len(ids)] = 1
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        positions=torch.tensor([r * width + t for r, t, _, _ in scored], dtype=torch.long),
        targets=torch.tensor([tok for _, _, tok, _ in scored], dtype=torch.long),
        token_candidate=torch.tensor([c for _, _, _, c in scored], dtype=torch.long),
        candidate_length=torch.tensor(cand_len, dtype=torch.float32),
        candidate_slot=torch.tensor(cand_slot, dtype=torch.long),
        gold=torch.tensor([e.gold for e in items], dtype=torch.long),
        max_candidates=max_c,
    )


def batches(
    encoded: Sequence[Encoded], batch_size: int, family: str, tokenizer: Any, sort: bool = False
) -> Iterator[Batch]:
    """Consecutive batches of ``batch_size`` examples; ``sort`` groups similar lengths (less padding, eval only)."""
    order = sorted(range(len(encoded)), key=lambda i: encoded[i].num_tokens()) if sort else range(len(encoded))
    order = list(order)
    for start in range(0, len(order), batch_size):
        chunk = [encoded[i] for i in order[start : start + batch_size]]
        yield collate(chunk, family, tokenizer.pad_token_id, getattr(tokenizer, "mask_token_id", None))


def lm_parts(model: nn.Module, family: str) -> tuple[nn.Module, nn.Module]:
    """(backbone, head): hidden states from the backbone, vocabulary logits from the head at chosen positions."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
    if family == "causal":
        return base.get_decoder(), base.get_output_embeddings()
    head = getattr(base, "lm_head", None) or getattr(base, "cls", None)
    if head is None:
        raise ConfigError(f"{type(base).__name__} has no MLM head (lm_head or cls); use a *ForMaskedLM model")
    return base.base_model, head


def candidate_scores(model: nn.Module, batch: Batch, family: str) -> torch.Tensor:
    """(B, max_candidates) scores: mean token log-likelihood (causal) or label-word logit (masked); -inf pads."""
    backbone, head = lm_parts(model, family)
    hidden = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.positions)
    logits = head(picked).float()  # the vocabulary projection, at scored positions only
    if family == "masked":
        token_scores = logits.gather(1, batch.targets[:, None]).squeeze(1)
    else:
        token_scores = torch.log_softmax(logits, dim=-1).gather(1, batch.targets[:, None]).squeeze(1)
    num_c = batch.candidate_length.shape[0]
    sums = torch.zeros(num_c, device=logits.device).index_add_(0, batch.token_candidate, token_scores)
    means = sums / batch.candidate_length
    flat = torch.full((batch.num_examples * batch.max_candidates,), float("-inf"), device=logits.device)
    flat = flat.scatter(0, batch.candidate_slot, means)
    return flat.view(batch.num_examples, batch.max_candidates)


def classification_loss(scores: torch.Tensor, gold: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over candidates (SPEC §6), the training objective of every method."""
    return F.cross_entropy(scores, gold, reduction=reduction)


def batch_loss(model: nn.Module, batch: Batch, family: str) -> torch.Tensor:
    return classification_loss(candidate_scores(model, batch, family), batch.gold)
