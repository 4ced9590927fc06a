"""In-context learning (the ICL rows of the AdaZeta paper's tables): k solved train examples prepended to every prompt.

A demonstration is a train example's prompt followed by its gold answer (causal), or its prompt with the gold
label word in place of the mask (masked, as in LM-BFF). Two protocols (``method.demonstrations.protocol``):

- ``shared``: the k demonstrations are drawn once, with a seed, from the sampled train split, so every dev and
  test example sees the same ones; when a prompt would not fit ``model.max_length``, whole demonstrations are
  dropped, oldest first (the test example itself is never cut by them);
- ``per_example``: MeZO's icl.sh (large_models/run.py without --train_set_seed, tasks.py sample_train_sets): each
  evaluated example i gets its own k demonstrations, drawn from the *whole* train split with the seed
  ``RandomState(0).randint(0, 10000, n)[i]`` (``permutation(len(train))[:k]``); each demonstration stripped, joined
  by the separator, the whole prompt left-stripped; a prompt too long is cut on the left, token by token, keeping
  BOS (``Scorer.encode``'s MeZO cut).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from adazeta.errors import ConfigError
from adazeta.tasks.loaders import TaskData
from adazeta.tasks.spec import BoundTask, Example


@dataclass
class DemonstrationConfig:
    """How many demonstrations, joined how, drawn with which seed."""

    k: int = 32  # MeZO's ICL uses 32 demonstrations
    separator: str = "\n\n"  # between demonstrations and before the test prompt
    seed: int | None = None  # None: the run seed (shared protocol)
    protocol: str = "shared"  # shared | per_example (MeZO's icl.sh; see the module docstring)

    def __post_init__(self) -> None:
        if self.protocol not in ("shared", "per_example"):
            raise ConfigError(f"method.demonstrations.protocol={self.protocol!r} is not one of shared, per_example")
        if self.k < 1:
            raise ConfigError(f"method.demonstrations.k={self.k} must be >= 1 (k = 0 is the zero_shot method)")
        if not isinstance(self.separator, str):
            raise ConfigError(f"method.demonstrations.separator={self.separator!r} must be a string, e.g. '\\n\\n'")


def sample_demonstrations(train: Sequence[Example], k: int, seed: int) -> list[Example]:
    """k distinct train examples, drawn with ``seed`` (the same seed gives the same demonstrations)."""
    if k > len(train):
        raise ConfigError(
            f"method.demonstrations.k={k} is more than the {len(train)} train examples; lower it or raise data.num_train"
        )
    order = np.random.RandomState(seed).choice(len(train), size=k, replace=False)
    return [train[i] for i in order]


def demonstration_text(example: Example, task: BoundTask) -> str:
    """A solved example: prompt + gold answer (causal), or the prompt with the gold word at the mask (masked).

    Masked templates put no space before the mask because the label word's token carries it (`` great``, as
    in LM-BFF), so the word goes in with its space: "It was{mask}." becomes "It was great.".
    """
    answer, mask_token = example.candidates[example.gold], task.mask_token
    if task.family.reads_mask:
        if mask_token is None or mask_token not in example.prompt:
            raise ConfigError("masked demonstrations need the tokenizer's mask token in the prompt")
        return example.prompt.replace(mask_token, " " + answer.strip(), 1)
    # A trailing newline ending the answer (generation tasks' stop marker) would double the separator.
    return (example.prompt + answer).rstrip("\n")


def fits_in(tokenizer: Any, task: BoundTask, max_length: int) -> Callable[[str, Sequence[str]], bool]:
    """Whether a prompt and its longest candidate fit ``max_length`` tokens, counted as ``Scorer.encode`` does."""
    masked = task.family.reads_mask
    bos = 1 if not masked and getattr(tokenizer, "add_bos_token", False) else 0

    def fits(prompt: str, candidates: Sequence[str]) -> bool:
        if masked:
            return len(tokenizer(prompt, add_special_tokens=True)["input_ids"]) <= max_length
        # The shared prompt and a candidate's ids together are the joint tokenisation of prompt + candidate.
        texts = [prompt + c for c in candidates] or [prompt]
        return bos + max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts) <= max_length

    return fits


def prepend_demonstrations(
    examples: Sequence[Example],
    demonstrations: Sequence[Example],
    separator: str,
    task: BoundTask,
    fits: Callable[[str, Sequence[str]], bool],
) -> list[Example]:
    """Each example with the demonstrations before its prompt; ``meta["demonstrations"]`` says how many fit."""
    blocks = [demonstration_text(d, task) for d in demonstrations]
    out = []
    for ex in examples:

        def prompt(dropped: int) -> str:
            return separator.join(blocks[dropped:] + [ex.prompt])

        # Fewer demonstrations never make a prompt longer: binary search the fewest to drop.
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(prompt(mid), ex.candidates):
                hi = mid
            else:
                lo = mid + 1
        out.append(
            dataclasses.replace(ex, prompt=prompt(lo), meta={**ex.meta, "demonstrations": len(blocks) - lo})
        )
    return out


def add_demonstrations_(
    data: TaskData, cfg: DemonstrationConfig, tokenizer: Any, task: BoundTask, max_length: int, run_seed: int
) -> float:
    """Prepend demonstrations from ``data.train`` to every dev and test prompt, in place.

    Returns the mean number of demonstrations that fit a test prompt (k unless ``max_length`` dropped some).
    """
    data.dev = with_demonstrations(data.dev, data, cfg, tokenizer, task, max_length, run_seed)
    data.eval = with_demonstrations(data.eval, data, cfg, tokenizer, task, max_length, run_seed)
    return sum(e.meta["demonstrations"] for e in data.eval) / max(len(data.eval), 1)


PER_EXAMPLE_SEED = 0  # MeZO: `with temp_seed(0): seeds = np.random.randint(0, 10000, len_valid_samples)`


def per_example_indices(n_examples: int, n_train: int, k: int) -> list[list[int]]:
    """MeZO's per-example draws: example i's demonstrations are ``permutation(n_train)[:k]`` under seed ``seeds[i]``."""
    if k > n_train:
        raise ConfigError(f"method.demonstrations.k={k} is more than the {n_train} rows of the train split")
    seeds = np.random.RandomState(PER_EXAMPLE_SEED).randint(0, 10000, n_examples)
    return [np.random.RandomState(int(s)).permutation(n_train)[:k].tolist() for s in seeds]


def add_per_example_demonstrations_(
    data: TaskData, cfg: DemonstrationConfig, n_train: int, train_example: Callable[[int], Example], task: BoundTask,
) -> float:
    """Each dev and test example with its own k demonstrations from the whole train split (``train_example(i)``
    renders train row i), in place; returns k (a prompt too long is cut by ``Scorer.encode``, not by dropping)."""
    cache: dict[int, str] = {}

    def text(i: int) -> str:
        if i not in cache:
            cache[i] = demonstration_text(train_example(i), task).strip()
        return cache[i]

    for split in ("dev", "eval"):
        examples = getattr(data, split)
        draws = per_example_indices(len(examples), n_train, cfg.k)
        setattr(data, split, [
            dataclasses.replace(ex, prompt=(cfg.separator.join(text(i) for i in idx) + cfg.separator + ex.prompt).lstrip(),
                                meta={**ex.meta, "demonstrations": cfg.k})
            for ex, idx in zip(examples, draws)])
    return float(cfg.k) if data.eval else 0.0


def with_demonstrations(
    examples: Sequence[Example], data: TaskData, cfg: DemonstrationConfig, tokenizer: Any, task: BoundTask,
    max_length: int, run_seed: int,
) -> list[Example]:
    """``examples`` with the run's demonstrations (drawn from ``data.train`` with the seed) before each prompt."""
    shots = sample_demonstrations(data.train, cfg.k, run_seed if cfg.seed is None else cfg.seed)
    return prepend_demonstrations(examples, shots, cfg.separator, task, fits_in(tokenizer, task, max_length))
