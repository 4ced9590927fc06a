"""LOZO (Chen et al., "Enhancing Zeroth-order Fine-tuning for Language Models with Low-rank Structures", ICLR
2025): ZO-SGD whose directions on a weight matrix are low-rank, z = U V^T, with V kept for a window of steps.

For a parameter of two or more dimensions viewed as an m x n matrix (``own_directions.matrix_shape``), query q of
step k perturbs along U_q V_k^T with U_q (m x r) fresh each query and V_k (n x r) redrawn every ``step_interval``
steps (lazy sampling, k = step // step_interval); a vector parameter (bias, norm) along a Gaussian z_q. All
entries standard normal. A step of Q queries takes 2Q forwards:

    g_q = (L(w + eps d_q) - L(w - eps d_q)) / (2 eps r),    d_q = U_q V_k^T (matrices), z_q (vectors)
    w <- w - lr ((1/Q) sum_q g_q d_q + wd w)

Source: the paper's Algorithm 1 (LOZO) and its authors' code (optsuite/LOZO ``large_models/LOZOtrainer.py``
699-718 ``lowrank_zo_perturb_parameters``, 763-797 ``lowrank_zo_step``, 800-821 ``lowrank_zo_update``); rank 4 and
step_interval 100 are the LOZO command of OPTML-Group/ZO-Muon's README (the authors' ``run_lozo.py`` defaults are
rank 2, interval 50; their ``lozo.sh`` runs rank 1, interval 100). The 1/r (``divide_by_rank``, on by default) is
ZO-Muon's copy of the trainer (``llm/LOZOTrainer.py``: ``projected_grad = (loss1 - loss2) / (2 * zo_eps *
rank_r)``, one scalar for the whole step, so the vector parameters' z_q step is divided by r as well). The authors'
code divides by 2 eps only (``LOZOtrainer.py`` 790): at rank r their step is r times this one at equal lr;
``divide_by_rank: false`` runs their scale.
Where this implementation differs, and why:

- Q > 1 (the reference takes one query a step): the g_q d_q are averaged (``reduction=sum``: summed), every
  query with the same V_k; the update of a matrix is (sum_q g_q U_q) V_k^T, one product.
- V_k is drawn from its own generator seeded from ``subspace_seed(seed, k)`` and U_q, z_q from one seeded from
  ``query_seed(seed, step, q)`` (local generators, in the parameters' order), not from the global RNG reseeded
  each step: V needs no checkpoint (it is redrawn from (seed, k) each step, so nothing is kept between steps)
  and a resumed run continues exactly.
- The reference views only 2-D weights (``v`` has ``size(1)`` rows), so a tensor of more dimensions would fail
  there; here it is (size(0), numel / size(0)): a tensor-train core (r_{k-1}, n_k, r_k) as r_{k-1} x n_k r_k.
- On a step that redraws V (step % interval == 0) the authors' code draws V before each U in the perturbations but
  not in the update, which replays the seed: the update moves along other U than the ones measured. Here the
  update moves along the measured U_q V_k^T.
- Directions are drawn in at least float32 (the reference draws in the weights' dtype) and the weights are
  restored exactly after each perturbation (``own_directions``) instead of by the +1, -2, +1 sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Sequence

import torch

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.engine import Queries, Step, UpdateRule, decay_
from adazeta.optim.memory import TrainedSet
from adazeta.optim.own_directions import OwnDirections, OwnDirectionsConfig, matrix_shape, summed_factors, work_dtype
from adazeta.optim.spsa import Streams, decay_groups, projected_gradient, subspace_seed
from adazeta.optim.zo_sgd import ZOSGD


def lowrank_basis(params: Sequence[torch.Tensor], seed: int, rank: int) -> list[torch.Tensor | None]:
    """V (n x r) for each matrix parameter, None for a vector, standard normal from ``seed`` in the parameters'
    order (LOZO's lazily sampled factor)."""
    streams = Streams(seed)
    out: list[torch.Tensor | None] = []
    for p in params:
        shape = matrix_shape(p)
        out.append(None if shape is None else torch.randn(
            shape[1], rank, generator=streams.on(p.device), dtype=work_dtype(p), device=p.device))
    return out


def lowrank_factors(params: Sequence[torch.Tensor], seed: int, rank: int) -> list[torch.Tensor]:
    """U (m x r) for each matrix parameter, z shaped like a vector parameter, standard normal from ``seed``."""
    streams = Streams(seed)
    out = []
    for p in params:
        shape = matrix_shape(p)
        size = (shape[0], rank) if shape is not None else tuple(p.shape)
        out.append(torch.randn(size, generator=streams.on(p.device), dtype=work_dtype(p), device=p.device))
    return out


def lowrank_direction(p: torch.Tensor, factor: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """d = U V^T shaped like ``p`` (a matrix parameter), or z itself (a vector)."""
    return factor if basis is None else (factor @ basis.T).view(p.shape)


class LowRank:
    """LOZO's directions: V of rank ``rank`` per window of ``step_interval`` steps, U_q (and a vector's z_q) per
    query; ``scale`` divides the projected gradients (r with ``divide_by_rank``, else 1)."""

    def __init__(self, rank: int, step_interval: int, divide_by_rank: bool):
        self.rank, self.step_interval = rank, step_interval
        self.scale = rank if divide_by_rank else 1

    def basis(self, params: Sequence[torch.Tensor], seed: int, step: int) -> list[torch.Tensor | None]:
        """V of step ``step``'s window, redrawn from (seed, step // step_interval)."""
        return lowrank_basis(params, subspace_seed(seed, step // self.step_interval), self.rank)

    def factors(self, params: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
        return lowrank_factors(params, seed, self.rank)


class LowRankRule(UpdateRule):
    """w <- w - lr ((1/Q) sum_q g_q U_q V^T + wd w), the U_q and z_q redrawn from the step's seeds."""

    name = "lozo"

    def __init__(self, directions: LowRank):
        super().__init__()
        self.directions = directions

    @torch.no_grad()
    def update_(self, opt: Any, step: Step) -> int:
        params = step.params
        basis = self.directions.basis(params, opt.seed, opt.state_step)
        total = summed_factors(self.directions, params, step.seeds, step.grads, step.reduction)
        decay_(params, step.lrs, step.wds)  # w (1 - lr wd) - lr g: the same as w - lr (g + wd w)
        for p, t, v, lr in zip(params, total, basis, step.lrs):
            p.add_(lowrank_direction(p, t, v), alpha=-lr)
        return 0


class LowRankEstimator(OwnDirections):
    """LOZO's 2Q forwards: central differences along U_q V^T (matrices) and z_q (vectors), divided by ``scale``."""

    name = "lozo"

    def __init__(self, directions: LowRank):
        self.directions = directions

    def forwards(self, queries: int) -> int:
        return 2 * queries

    def along(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        params, directions = queries.params, self.directions
        basis = directions.basis(params, opt.seed, opt.state_step)

        def move_(factors: list[torch.Tensor], scale: float) -> None:
            for p, f, v in zip(params, factors, basis):
                p.add_(lowrank_direction(p, f, v), alpha=scale)

        losses = self.evaluate(opt, queries, lambda seed: directions.factors(params, seed), move_, baseline=False,
                               central=True)
        return losses, projected_gradient(losses[0::2], losses[1::2], opt.eps) / directions.scale


@dataclasses.dataclass
class LOZOConfig(OwnDirectionsConfig):
    """LOZO: central differences along U V^T (matrices) and z (vectors), lazily resampled V, an SGD step."""

    kind: ClassVar[str] = "lozo"
    noises: ClassVar[tuple[str, ...]] = ("per_tensor",)

    rank: int = 4  # r of U (m x r) and V (n x r); the README's LOZO command (its script's default: 2)
    step_interval: int = 100  # steps that share one V (lazy sampling); 1 redraws V every step
    divide_by_rank: bool = True  # g_q / r as ZO-Muon's copy of the trainer; false: the LOZO authors' g_q (r x the step)

    def state_bytes(self, entries: int, width: int) -> float:
        return 0.0  # V is redrawn from (seed, window) each step: nothing is kept between steps

    def kept_directions(self, trained: TrainedSet, queries: int) -> int:
        return 0  # U_q and z_q are redrawn from the seeds for the update

    def factor_bytes(self, trained: TrainedSet) -> tuple[int, int]:
        """(every V, one query's U_q and z_q), in at least float32."""
        width = max(trained.width, 4)
        matrices = trained.matrices()
        basis = sum(n * self.rank for _, n in matrices) * width
        return basis, (sum(m * self.rank for m, _ in matrices) + trained.vector_entries()) * width

    def estimate_bytes(self, trained: TrainedSet, queries: int) -> float:
        # every V and a query's U_q beside the copy of w, and a matrix's U_q V^T
        basis, factors = self.factor_bytes(trained)
        return self.restore_copy_bytes(trained) + basis + factors + trained.largest_work

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        # every V and the summed U, beside a query's U_q and the last query's (``summed_factors``), then beside a
        # matrix's (sum U) V^T
        basis, factors = self.factor_bytes(trained)
        return basis + factors + max(2 * factors, trained.largest_work)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("rank", self.rank)
        check_positive("step_interval", self.step_interval)


def check_positive(key: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"method.optimizer.{key}={value!r} must be an int >= 1")


@OPTIMIZERS.register("lozo", LOZOConfig)
def build_lozo(named_params: Iterable[tuple[str, torch.Tensor]], cfg: LOZOConfig, seed: int) -> ZOSGD:
    directions = LowRank(cfg.rank, cfg.step_interval, cfg.divide_by_rank)
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed,
                 estimator=LowRankEstimator(directions), rule=LowRankRule(directions))
