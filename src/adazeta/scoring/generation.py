"""Greedy generation for the generation tasks (SQuAD, DROP), as in the MeZO protocol: up to 50 new tokens,
stopping at a newline, scored by F1 and exact match against every gold answer. Also the non-differentiable ZO
loss: minus that F1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from adazeta.errors import ConfigError
from adazeta.tasks.metrics import best_exact_match, best_f1

MAX_NEW_TOKENS = 50  # MeZO's generation budget for SQuAD and DROP


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Every token whose text holds a newline, and EOS: generation ends at the first of them.

    A BPE vocabulary has many (".\\n", "\\n\\n", ...), so stopping on the "\\n" token alone would run past them.
    """
    ids = list(range(len(tokenizer)))
    texts = tokenizer.batch_decode([[i] for i in ids])
    stops = [i for i, text in zip(ids, texts) if "\n" in text]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    return stops


def fit_prompt(prompt: Sequence[int], limit: int, bos_id: int | None) -> list[int]:
    """Cut a prompt from the left to ``limit`` tokens (the question stays whole), keeping a leading BOS."""
    prompt = list(prompt)
    if len(prompt) <= limit:
        return prompt
    if bos_id is not None and prompt[:1] == [bos_id]:
        return prompt[:1] + prompt[len(prompt) - limit + 1 :]
    return prompt[len(prompt) - limit :]


def answer_text(generated: str) -> str:
    """The answer in a generation: the text before the first newline, stripped (leading blank lines skipped)."""
    return generated.strip().split("\n")[0].strip()


@dataclass
class GenerationSet:
    """One split's prompts (token ids, cut to leave room for the answer) and their gold answers."""

    prompts: list[list[int]]
    answers: list[list[str]]
    tokenizer: Any
    stop_ids: list[int]
    max_new_tokens: int = MAX_NEW_TOKENS
    batch_size: int = 32

    @classmethod
    def build(
        cls,
        prompts: Sequence[Sequence[int]],
        answers: Sequence[Sequence[str]],
        tokenizer: Any,
        max_length: int,
        stop_ids: list[int] | None = None,
        max_new_tokens: int = MAX_NEW_TOKENS,
        batch_size: int = 32,
    ) -> "GenerationSet":
        limit = max_length - max_new_tokens
        if limit < 1:
            raise ConfigError(
                f"model.max_length={max_length} leaves no room for a prompt before {max_new_tokens} generated tokens"
            )
        bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
        return cls(
            [fit_prompt(p, limit, bos) for p in prompts],
            [list(a) for a in answers],
            tokenizer,
            stop_token_ids(tokenizer) if stop_ids is None else stop_ids,
            max_new_tokens,
            batch_size,
        )


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    tokenizer: Any,
    stop_ids: Sequence[int],
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = 32,
) -> list[str]:
    """Greedy continuations of token-id prompts, left-padded in batches; each cut at its first newline."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=list(stop_ids), pad_token_id=pad_id
    )
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(chunk):  # left padding: every row's next token is predicted at the same column
            ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[r, width - len(p) :] = 1
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        texts = tokenizer.batch_decode(generated[:, width:].tolist(), skip_special_tokens=True)
        out.extend(answer_text(t) for t in texts)
    return out


def generation_rows(model: nn.Module, gen: GenerationSet) -> tuple[list[str], list[float], list[float]]:
    """Each prompt's greedy answer, its F1 and its exact match (SQuAD normalisation, best over the gold answers)."""
    if not gen.prompts:
        return [], [], []
    preds = greedy_generate(model, gen.prompts, gen.tokenizer, gen.stop_ids, gen.max_new_tokens, gen.batch_size)
    f1 = [float(best_f1(p, a)) for p, a in zip(preds, gen.answers)]
    em = [float(best_exact_match(p, a)) for p, a in zip(preds, gen.answers)]
    return preds, f1, em


def generation_metrics(model: nn.Module, gen: GenerationSet) -> dict[str, float]:
    """Mean F1 and exact match (SQuAD normalisation, best over the gold answers) of greedy generations."""
    preds, f1, em = generation_rows(model, gen)
    if not preds:
        return {"f1": float("nan"), "em": float("nan")}
    return {"f1": sum(f1) / len(f1), "em": sum(em) / len(em)}


class F1Loss:
    """The non-differentiable ZO objective (MeZO §3.3): minus the mean F1 of greedy answers to a minibatch.

    Called on the training loop's encoded items: each item's gold candidate is its answer (plus the newline).
    Only zeroth-order methods can minimise it: it has no gradient.
    """

    def __init__(self, tokenizer: Any, max_length: int, stop_ids: list[int] | None = None,
                 max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 32):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.stop_ids = stop_token_ids(tokenizer) if stop_ids is None else stop_ids
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    def __call__(self, model: nn.Module, items: Sequence[Any]) -> torch.Tensor:
        golds = [[answer_text(self.tokenizer.decode(it.candidates[it.gold]))] for it in items]
        gen = GenerationSet.build([it.prompt for it in items], golds, self.tokenizer, self.max_length,
                                  self.stop_ids, self.max_new_tokens, self.batch_size)
        f1 = generation_metrics(model, gen)["f1"]
        return torch.tensor(-f1, device=next(model.parameters()).device)
