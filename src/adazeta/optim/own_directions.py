"""The common base of ZO optimizers that perturb along directions of their own (HiZOO, LOZO, ZO-Muon).

ZO-SGD's estimators perturb along the seeded Gaussian stream and its rules rebuild the estimate from it
(``adazeta.optim.engine``). These optimizers shape their directions (HiZOO scales z by a diagonal Hessian, LOZO
and ZO-Muon perturb a matrix in a low-rank subspace), so each brings an estimator of its own (an
``OwnDirections``, whose ``evaluate`` runs the forwards one after another) and an ``UpdateRule`` that rebuilds its
directions from the same seeds, both composed into a ``ZOSGD`` by its builder. What they share, here:

- queries run one after another on one process: no weight replicas (``batched_queries`` is refused) and no
  query- or data-parallel spread (``parallel_modes`` is empty; a step with a ``plan`` is refused);
- after each perturbation the weights are restored exactly, by copying them back (a trainable set of at most
  ``ZOSGD.KEEP_WEIGHTS_BYTES``), or, for a larger set, by the opposite perturbation (MeZO's way: no copy of the
  weights, up to an ulp of drift per entry and pass);
- a parameter of two or more dimensions is a matrix viewed as (size(0), numel / size(0)) (``matrix_shape``):
  a Linear or LoRA weight as it is, a tensor-train core (r_{k-1}, n_k, r_k) as (r_{k-1}, n_k r_k), the first core
  (r_0 = 1) as one row; 1-D parameters (biases, norms) are plain vectors;
- every random draw comes from local generators seeded from ``query_seed(seed, step, q)`` (per query) or
  ``subspace_seed(seed, step // step_interval)`` (a subspace kept for a window of steps), one generator per device
  in the parameters' order (``spsa.Streams``), never the global RNG: a resumed run draws the same directions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import torch

from adazeta.errors import ConfigError
from adazeta.optim.engine import Estimator, Queries, as_loss
from adazeta.optim.memory import TrainedSet
from adazeta.optim.spsa import NOISE_STREAMS
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig

Closure = Callable[[], Any]


def matrix_shape(p: torch.Tensor) -> tuple[int, int] | None:
    """(m, n) = (size(0), numel / size(0)) for a parameter of two or more dimensions, None for a vector."""
    if p.dim() < 2:
        return None
    m = p.shape[0]
    return m, p.numel() // m


def work_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype directions and estimates of ``p`` are computed in: at least float32 (float64 stays)."""
    return torch.promote_types(p.dtype, torch.float32)


class OwnDirections(Estimator):
    """An estimator along directions its optimizer draws (``draw``) and moves (``move_``), on one process: ``name``
    is the optimizer's registered name (for messages); a subclass computes the step's losses and g_q in ``along``."""

    batched = False
    parallel = ()

    def estimate(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        if queries.plan is not None:
            raise ConfigError(f"{self.name} runs on one process (its queries are sequential and its directions its "
                              "own): launch a single process")
        return self.along(opt, queries)

    def along(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def evaluate(self, opt: Any, queries: Queries, draw: Callable[[int], Any], move_: Callable[[Any, float], None],
                 *, baseline: bool, central: bool) -> torch.Tensor:
        """Every loss of the step, one forward each: L(w) first when ``baseline``, then per query q
        L(w + eps d_q) and, when ``central``, L(w - eps d_q). ``draw(seed)`` gives query q's direction d_q (held for
        its passes), ``move_(d, s)`` does w <- w + s d. The weights are w again after each perturbed forward."""
        closure, params, eps = queries.closure, queries.params, opt.eps
        saved = None
        if sum(p.numel() * p.element_size() for p in params) <= opt.KEEP_WEIGHTS_BYTES:
            saved = [p.detach().clone() for p in params]
        losses: list[torch.Tensor] = []
        if baseline:
            losses.append(as_loss(closure()))
        for seed in queries.seeds:
            d = draw(seed)
            for sign in ((1.0, -1.0) if central else (1.0,)):
                move_(d, sign * eps)
                losses.append(as_loss(closure()))
                if saved is not None:
                    torch._foreach_copy_(list(params), saved)  # exact, whatever the perturbation's rounding
                else:
                    move_(d, -sign * eps)
            del d
        return torch.stack(losses)


def summed_factors(directions: Any, params: Sequence[torch.Tensor], seeds: Sequence[int], grads: torch.Tensor,
                   reduction: str) -> list[torch.Tensor]:
    """(1/Q or 1) sum_q g_q f_q for each parameter, f_q = ``directions.factors(params, seed_q)`` (LOZO's U_q,
    ZO-Muon's u_q, a vector's z_q), redrawn from the step's seeds."""
    total: list[torch.Tensor] = []
    for seed, g in zip(seeds, grads):
        factors = directions.factors(params, seed)
        if not total:
            total = [torch.zeros_like(f) for f in factors]
        for t, f in zip(total, factors):
            t.add_(f * g.to(f.device, f.dtype))
    if reduction == "mean":
        for t in total:
            t.div_(len(seeds))
    return total


@dataclasses.dataclass
class OwnDirectionsConfig(ZOSGDConfig):
    """ZO-SGD's keys, with what an optimizer of its own directions cannot do refused at start-up."""

    kind: ClassVar[str] = "own_directions"
    estimators: ClassVar[tuple[str, ...]] = ("central",)  # the finite differences it can take
    noises: ClassVar[tuple[str, ...]] = NOISE_STREAMS  # the noise streams it draws from (others: no effect)

    @property
    def batches_queries(self) -> bool:
        return False

    @property
    def parallel_modes(self) -> tuple[str, ...]:
        return ()

    def restore_copy_bytes(self, trained: TrainedSet) -> int:
        """The copy of the weights ``evaluate`` restores them from: a set of at most ``KEEP_WEIGHTS_BYTES``."""
        return trained.nbytes if trained.nbytes <= ZOSGD.KEEP_WEIGHTS_BYTES else 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batched_queries:
            raise ConfigError(f"method.optimizer.batched_queries=true: {self.kind} evaluates its queries one after "
                              "another (no weight replicas); set method.optimizer.batched_queries=false")
        if self.estimator not in self.estimators:
            raise ConfigError(f"method.optimizer.estimator={self.estimator}: {self.kind} takes "
                              f"{' or '.join(self.estimators)} differences")
        if self.noise not in self.noises:
            raise ConfigError(f"method.optimizer.noise={self.noise}: {self.kind} draws its own directions, so the "
                              f"noise stream has no effect; leave method.optimizer.noise={self.noises[0]}")
