"""The trained set as an optimizer's memory declaration sees it, and the temporaries every ZO pass shares.

An optimizer's config declares what it holds beyond the weights and a forward's activations
(``OptimizerCapabilities``): ``state_bytes``, kept between steps, and ``step_bytes``, the peak of the
temporaries one step holds at once (freed by its end). The dry run's estimate adds both
(``adazeta.dryrun.memory_parts``); ``tests/test_memory_estimates.py`` holds every registered optimizer's
declaration to the measured peak of its real step. Each size below names the code that allocates it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch

from adazeta.optim import spsa


@dataclasses.dataclass(frozen=True)
class TrainedSet:
    """The trained tensors' shapes and bytes per entry, the device type the step runs on, and the size of the
    model's largest weight (trained or frozen: a jvp copies it)."""

    shapes: tuple[tuple[int, ...], ...]
    width: int  # bytes per trained entry: 4 for fp32 adapters, the backbone's dtype when the backbone trains
    device: str = "cuda"  # "cpu": large tensors' noise drawn a slice at a time; anything else: a tensor at once
    largest_weight_bytes: int = 0

    @classmethod
    def of(cls, params: Iterable[torch.Tensor], model: torch.nn.Module | None = None) -> "TrainedSet":
        """The set of ``params`` (and ``model``'s largest weight), as built."""
        params = list(params)
        weights = list(model.parameters()) if model is not None else params
        return cls(tuple(tuple(p.shape) for p in params), params[0].element_size() if params else 4,
                   params[0].device.type if params else "cpu",
                   max((p.numel() * p.element_size() for p in weights), default=0))

    @property
    def entries(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def largest(self) -> int:
        """Entries of the largest trained tensor."""
        return max((math.prod(s) for s in self.shapes), default=0)

    @property
    def nbytes(self) -> int:
        """The trained weights in their own dtype: a copy of them, or one z drawn for all of them."""
        return self.entries * self.width

    @property
    def work(self) -> int:
        """One tensor per trained weight in at least float32 (a dense estimate g_hat, a rule's buffer)."""
        return self.entries * max(self.width, 4)

    @property
    def largest_work(self) -> int:
        """The largest trained tensor in at least float32: a rule's per-tensor temporary."""
        return self.largest * max(self.width, 4)

    @property
    def cast(self) -> int:
        """A float32 step cast back to 16-bit weights, a tensor at a time (nothing for float32 weights)."""
        return self.largest * self.width if self.width < 4 else 0

    def matrices(self) -> list[tuple[int, int]]:
        """(m, n) of each tensor of two or more dimensions, as ``own_directions.matrix_shape`` views it."""
        return [(s[0], math.prod(s) // s[0]) for s in self.shapes if len(s) >= 2]

    def vector_entries(self) -> int:
        """Entries of the one-dimensional tensors (biases, norms): perturbed along a full z by the structured
        optimizers."""
        return sum(math.prod(s) for s in self.shapes if len(s) < 2)


def draw_bytes(t: TrainedSet) -> int:
    """One pass's noise (``spsa.each_draw``): on a CPU, the small tensors' z a ``CHUNK_BYTES`` chunk at a time
    and a ``DRAW_SLICE`` buffer for the large ones; elsewhere a chunk, or a larger tensor's z whole."""
    if t.device == "cpu":
        sizes = [math.prod(s) for s in t.shapes]
        small = sum(n for n in sizes if n <= 2 * spsa.DRAW_SLICE) * t.width
        sliced = len([n for n in sizes if n > 2 * spsa.DRAW_SLICE]) > 0
        return min(small, spsa.CHUNK_BYTES) + ((spsa.DRAW_SLICE + 16) * t.width if sliced else 0)
    return max(min(t.nbytes, spsa.CHUNK_BYTES), t.largest * t.width)


def piece_bytes(t: TrainedSet, kept: bool) -> int:
    """The largest piece of z a pass hands on, in at least float32: a whole tensor's when z is kept or not on a
    CPU, else at most a slice or a small tensor (``spsa._sliced``)."""
    entries = t.largest if kept or t.device != "cpu" else min(t.largest, 2 * spsa.DRAW_SLICE)
    return entries * max(t.width, 4)


def kept_count(t: TrainedSet, queries: int, limit: int) -> int:
    """How many of a step's z a ``DirectionCache`` of ``limit`` bytes keeps (none when one z exceeds it)."""
    if not t.nbytes or t.nbytes > limit:
        return 0
    return min(queries, limit // t.nbytes)
