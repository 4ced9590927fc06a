"""ZO-Muon (OPTML-Group, 2026, github.com/OPTML-Group/ZO-Muon): zeroth-order estimates in a random low-dimensional
subspace of each weight matrix, orthogonalised as Muon does (Newton-Schulz), with several queries a step.

For a parameter of two or more dimensions viewed as an m x n matrix (``own_directions.matrix_shape``), P (m x r,
r = min(rank, m)) has orthonormal columns, Haar-distributed (QR of a Gaussian matrix with the signs of R's
diagonal moved onto Q), and is redrawn every ``step_interval`` steps (k = step // step_interval). Query q
perturbs along P u_q, u_q (r x n) standard normal; a vector parameter (bias, norm) along a Gaussian z_q. With the
default one-sided estimator and a shared baseline, a step of Q queries takes Q + 1 forwards:

    L0 = L(w),  g_q = (L(w + eps d_q) - L0) / eps,    d_q = P u_q (matrices), z_q (vectors)
    matrices:  R = (1/Q) sum_q g_q u_q  (r x n),   w <- w - lr (P NS5(R) + wd w)
    vectors:   w <- w - vector_lr ((1/Q) sum_q g_q z_q + wd w)

NS5 is Muon's quintic Newton-Schulz iteration towards the orthogonal polar factor of R (``newton_schulz5``:
a, b, c = 3.4445, -4.7750, 2.0315; X = R / (||R||_F + 1e-7); transposed when R has more rows than columns;
``ns_steps`` iterations X <- a X + (b A + c A^2) X, A = X X^T). ``estimator=central`` takes the reference's
single-sample branch instead, g_q = (L(w + eps d_q) - L(w - eps d_q)) / (2 eps), 2Q forwards.

With one query a step (Q = 1), R = g_1 u_1 and NS5 starts from R / ||R|| = sign(g_1) u_1 / ||u_1||: the matrices'
step keeps only the sign of the projected gradient, as ZO-SGD-Sign does, and ``lr`` sets its length alone. The
method is meant for several queries a step (the reference's README runs 4); the vectors' ZO-SGD step keeps g.

Source: the public code (``LowDimOptimizer`` in ``vit/zo_optimizer.py``: ``_sample_orthogonal_P``,
``lowdim_zo_perturb_parameters``, the multiple-sample branch of ``zo_step``, ``zo_update`` with opt ``muon``,
``zeropower_via_newtonschulz5``; the same in ``llm/LowDimTrainer.py``); rank 64, step_interval 100 and 4 queries
(``NUM_SAMPLES``, the schedule's Q here) are the README's ZO-Muon command.
Where this implementation differs, and why:

- P is drawn once per window from its own generator, seeded from ``subspace_seed(seed, k)``, and u_q, z_q from one
  seeded from ``query_seed(seed, step, q)``, not from the global RNG reseeded with ``base_seed + i`` per query.
  The reference resamples P inside each perturbation call on a resampling step, so on that step every query
  perturbs with a P of its own while the update uses the last query's P for all of them; here one P serves all
  queries of a window, as the method intends. P is redrawn each step from (seed, k), so nothing is checkpointed.
- NS5 and P run in at least float32: the vision code casts R to bfloat16 for the iteration and P to the weights'
  dtype; the LLM trainer runs NS5 in the weights' dtype (float32 there). Float32 keeps the orthogonalisation from
  bfloat16's 3 significant digits; float64 weights (tests) stay float64.
- Vector parameters step with ``vector_lr`` (default 1e-4), a key of its own: the reference hard-codes their step
  size (1e-4 in the vision code, 1e-7 in the LLM trainer) whatever the learning rate, and rightly keeps it apart
  from ``lr``: the orthogonalised matrix step has singular values ~1 whatever the loss's scale, while a vector's
  ZO-SGD step scales with the loss, so the matrices' lr (1e-2 in the reference) makes the vectors diverge.
- The weights are restored exactly after each perturbation (``own_directions``) instead of by the opposite one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Sequence

import torch

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.engine import Queries, Step, UpdateRule, decay_
from adazeta.optim.memory import TrainedSet
from adazeta.optim.lozo import check_positive
from adazeta.optim.own_directions import OwnDirections, OwnDirectionsConfig, matrix_shape, summed_factors, work_dtype
from adazeta.optim.spsa import Streams, decay_groups, projected_gradient, subspace_seed
from adazeta.optim.zo_sgd import ZOSGD

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic (Keller Jordan's modded-nanogpt), as the reference


def newton_schulz5(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration X <- a X + (b X X^T + c (X X^T)^2) X from X = G / (||G||_F + eps),
    on the wide orientation: about the orthogonal polar factor U V^T of G = U S V^T (singular values in ~[0.7, 1.2])."""
    a, b, c = NS_COEFFICIENTS
    x = g / (g.norm() + eps)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def orthonormal_basis(m: int, r: int, generator: torch.Generator, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """P (m x r) with orthonormal columns, Haar-distributed: Q of the QR of a standard normal m x r matrix, each
    column's sign set by R's diagonal (Mezzadri 2007), as the reference's ``_sample_orthogonal_P``."""
    q, r_factor = torch.linalg.qr(torch.randn(m, r, generator=generator, dtype=dtype, device=device), mode="reduced")
    signs = torch.sign(torch.diagonal(r_factor))
    signs[signs == 0] = 1.0
    return q * signs


def subspace_ranks(params: Sequence[torch.Tensor], rank: int) -> list[int | None]:
    """r = min(rank, m) for each matrix parameter (P cannot have more orthonormal columns than rows), None else."""
    return [None if (shape := matrix_shape(p)) is None else min(rank, shape[0]) for p in params]


class Subspace:
    """ZO-Muon's directions: P of rank ``rank`` (at most a matrix's rows) per window of ``step_interval`` steps, u_q
    (and a vector's z_q) per query."""

    def __init__(self, rank: int, step_interval: int):
        self.rank, self.step_interval = rank, step_interval

    def basis(self, params: Sequence[torch.Tensor], seed: int, step: int) -> list[torch.Tensor | None]:
        """P of step ``step``'s window, redrawn from (seed, step // step_interval), one per matrix parameter."""
        streams = Streams(subspace_seed(seed, step // self.step_interval))
        return [None if r is None else orthonormal_basis(p.shape[0], r, streams.on(p.device), work_dtype(p), p.device)
                for p, r in zip(params, subspace_ranks(params, self.rank))]

    def factors(self, params: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
        """u_q (r x n) for each matrix parameter, z_q shaped like a vector parameter, standard normal from ``seed``."""
        streams = Streams(seed)
        out = []
        for p, r in zip(params, subspace_ranks(params, self.rank)):
            size = tuple(p.shape) if r is None else (r, p.numel() // p.shape[0])
            out.append(torch.randn(size, generator=streams.on(p.device), dtype=work_dtype(p), device=p.device))
        return out


class MuonRule(UpdateRule):
    """Matrices: w <- w - lr (P NS5((1/Q) sum_q g_q u_q) + wd w); vectors: ZO-SGD's step from the same g_q, of size
    ``vector_lr``."""

    name = "zo_muon"

    def __init__(self, subspace: Subspace, ns_steps: int, vector_lr: float):
        super().__init__()
        self.subspace, self.ns_steps, self.vector_lr = subspace, ns_steps, vector_lr

    @torch.no_grad()
    def update_(self, opt: Any, step: Step) -> int:
        params = step.params
        basis = self.subspace.basis(params, opt.seed, opt.state_step)
        total = summed_factors(self.subspace, params, step.seeds, step.grads, step.reduction)
        lrs = [lr if P is not None else self.vector_lr for lr, P in zip(step.lrs, basis)]
        decay_(params, lrs, step.wds)  # w (1 - lr wd) - lr G: the same as w - lr (G + wd w)
        for p, t, P, lr in zip(params, total, basis, lrs):
            move = t if P is None else (P @ newton_schulz5(t, self.ns_steps)).view(p.shape)
            p.add_(move, alpha=-lr)
        return 0


class SubspaceEstimator(OwnDirections):
    """ZO-Muon's estimate along P u_q (matrices) and z_q (vectors): one-sided with a shared L(w) (Q + 1 forwards),
    or ``central`` (2Q)."""

    name = "zo_muon"

    def __init__(self, subspace: Subspace, central: bool):
        self.subspace, self.central = subspace, central

    def forwards(self, queries: int) -> int:
        return 2 * queries if self.central else queries + 1

    def along(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        params, subspace, central = queries.params, self.subspace, self.central
        basis = subspace.basis(params, opt.seed, opt.state_step)

        def move_(factors: list[torch.Tensor], scale: float) -> None:
            for p, f, P in zip(params, factors, basis):
                p.add_(f if P is None else (P @ f).view(p.shape), alpha=scale)

        losses = self.evaluate(opt, queries, lambda seed: subspace.factors(params, seed), move_,
                               baseline=not central, central=central)
        if central:
            return losses, projected_gradient(losses[0::2], losses[1::2], opt.eps)
        return losses, (losses[1:] - losses[0]) / opt.eps


@dataclasses.dataclass
class ZOMuonConfig(OwnDirectionsConfig):
    """ZO-Muon: one-sided subspace estimates with a shared baseline, a Newton-Schulz-orthogonalised step."""

    kind: ClassVar[str] = "zo_muon"
    estimators: ClassVar[tuple[str, ...]] = ("one_sided", "central")
    noises: ClassVar[tuple[str, ...]] = ("per_tensor",)

    lr: float = 1e-2  # the README's ZO-Muon command: the orthogonalised step has a fixed size, so lr is its length
    estimator: str = "one_sided"  # one_sided: Q + 1 forwards, shared L(w) (the reference's multiple-sample branch)
    rank: int = 64  # columns of P (at most the matrix's rows)
    step_interval: int = 100  # steps that share one P
    ns_steps: int = 5  # Newton-Schulz iterations
    # step size of the vector parameters' (biases', norms') plain ZO-SGD step, which scales with the loss while the
    # matrices' orthogonalised step does not: one lr cannot fit both (the reference hard-codes 1e-4 here)
    vector_lr: float = 1e-4

    def state_bytes(self, entries: int, width: int) -> float:
        return 0.0  # P is redrawn from (seed, window) each step: nothing is kept between steps

    def kept_directions(self, trained: TrainedSet, queries: int) -> int:
        return 0  # u_q and z_q are redrawn from the seeds for the update

    def factor_bytes(self, trained: TrainedSet) -> tuple[int, int, int]:
        """(every P, one query's u_q and z_q, the largest (r x n) matrix), in at least float32."""
        width = max(trained.width, 4)
        ranked = [(m, n, min(self.rank, m)) for m, n in trained.matrices()]
        basis = sum(m * r for m, _, r in ranked) * width
        factors = (sum(r * n for _, n, r in ranked) + trained.vector_entries()) * width
        return basis, factors, max((r * n for _, n, r in ranked), default=0) * width

    def subspace_bytes(self, trained: TrainedSet) -> int:
        """Every P, beside the QR of the last one drawn (its Gaussian, Q and Q with R's signs)."""
        basis, _, _ = self.factor_bytes(trained)
        widest = max((m * min(self.rank, m) for m, _ in trained.matrices()), default=0)
        return basis + 3 * widest * max(trained.width, 4)

    def estimate_bytes(self, trained: TrainedSet, queries: int) -> float:
        # P (and its QR) beside the copy of w, then a query's u_q and a matrix's P u_q
        basis, factors, _ = self.factor_bytes(trained)
        perturbing = basis + factors + trained.largest_work
        return self.restore_copy_bytes(trained) + max(self.subspace_bytes(trained), perturbing)

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        # P (and its QR), then the summed u beside a query's u_q and the last query's (``summed_factors``), then
        # beside a matrix's Newton-Schulz iterates (X, its two products and their sum: four r x n) and P NS5(R)
        basis, factors, widest = self.factor_bytes(trained)
        summing = max(2 * factors, 4 * widest + trained.largest_work)
        return max(self.subspace_bytes(trained), basis + factors + summing)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("rank", self.rank)
        check_positive("step_interval", self.step_interval)
        check_positive("ns_steps", self.ns_steps)
        if not self.vector_lr >= 0:
            raise ConfigError(f"method.optimizer.vector_lr={self.vector_lr!r} must be >= 0")


@OPTIMIZERS.register("zo_muon", ZOMuonConfig)
def build_zo_muon(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ZOMuonConfig, seed: int) -> ZOSGD:
    subspace = Subspace(cfg.rank, cfg.step_interval)
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed,
                 estimator=SubspaceEstimator(subspace, central=cfg.estimator == "central"),
                 rule=MuonRule(subspace, cfg.ns_steps, cfg.vector_lr))
