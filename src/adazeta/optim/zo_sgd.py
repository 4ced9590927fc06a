"""ZO-SGD: MeZO's zeroth-order SGD (Malladi et al. 2023) with Q queries a step, a drop-in ``torch.optim.Optimizer``,
composed of an estimator and an update rule (``adazeta.optim.engine``) and built from its config, ``ZOSGDConfig``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable, Sequence

import torch

from adazeta.distributed import StepPlan
from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS, OptimizerCapabilities
from adazeta.registry import ESTIMATORS
from adazeta.optim.engine import Estimator, Queries, SGDRule, Step, UpdateRule, estimator as estimator_of
from adazeta.optim.memory import TrainedSet, draw_bytes, kept_count
from adazeta.optim.spsa import (
    NOISE_STREAMS, DirectionCache, Masks, NoiseLayout, decay_groups, each_draw, noise_layout, query_seed,
)

Closure = Callable[[], torch.Tensor | float]

REDUCTIONS = ("mean", "sum")


def check_queries(n_queries: Any) -> int:
    """A step's query count (the schedule's, each step): an int >= 1."""
    if isinstance(n_queries, bool) or not isinstance(n_queries, int) or n_queries < 1:
        raise ConfigError(f"ZOSGD n_queries={n_queries!r} must be an int >= 1")
    return n_queries


class ZOSGD(torch.optim.Optimizer):
    """Zeroth-order SGD (MeZO, Malladi et al. 2023, Algorithm 1) with Q directions per step (AdaZeta, Eq. 2).

    ``step(closure, n_queries=Q)`` takes a closure that returns the minibatch loss *without* calling backward;
    it is called 2Q times (central) or Q + 1 times (one_sided) under ``torch.no_grad``, on the same minibatch.
    The training loop passes each step's Q from the query schedule; without it, the step uses ``n_queries``
    (the constructor's, or the last step's).

    The directions are never stored across steps: query q of step k draws z from ``query_seed(seed, k, q)``
    through the noise stream ``noise`` (``adazeta.optim.spsa.NOISE_STREAMS``); within a step, a trainable set
    whose z takes at most ``KEEP_DIRECTION_BYTES`` draws each z once and keeps it for the update.

    An optimizer is this class composed of an estimator and an update rule and built from its typed config
    (``ZOSGD(params, config, seed=..., estimator=..., rule=...)``; the config was validated when it was made). The
    estimator (``adazeta.optim.engine.Estimator``: by default the config's ``estimator``, registered in
    ``ESTIMATORS``) evaluates the perturbed losses and returns the projected gradients: one forward per loss, in
    batched forwards over weight replicas (``batched_queries`` and a ``ReplicaClosure``), or this rank's share of
    a step spread over processes (``adazeta.optim.differences``); ``forward_passes`` counts loss evaluations
    either way. The rule (``UpdateRule``: by default ZO-SGD's, ``zo_update_`` from the seeds) applies them.
    """

    zeroth_order = True
    # A step draws each query's z once, for its +eps, -eps and restoring passes, when one z takes at most this
    # much, and keeps the z for the update while all of them fit: adapters (TT: 0.7 MB per z on SmolLM2) draw
    # each z once instead of four times. A full model's z is regenerated on every pass, MeZO's saving.
    KEEP_DIRECTION_BYTES = 32 * 2**20
    # With one query and z drawn on every pass, undo the last perturbation in the update's pass (same numbers).
    FUSE_RESTORE = True
    # A trainable set of at most this much is copied before a step's in-place perturbations and copied back after
    # each query: w + eps z - 2 eps z + eps z rounds back to w only up to an ulp, a copy restores it exactly. A
    # larger set (a full model) is restored by the opposite perturbation, MeZO's way: no second copy of the weights,
    # at most ~1.5 ulp of drift per entry and step (tests/test_guards.py bounds it in bfloat16).
    KEEP_WEIGHTS_BYTES = 32 * 2**20

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        config: "ZOSGDConfig | None" = None,
        *,
        seed: int = 0,
        n_queries: int = 1,
        estimator: Estimator | None = None,
        rule: UpdateRule | None = None,
    ):
        # The config was validated when it was made (``ZOSGDConfig.__post_init__``; a run's lr > 0 by its settings):
        # nothing here checks it again.
        self.config = config if config is not None else ZOSGDConfig()
        cfg = self.config
        # how the step's losses are evaluated and become g_q: the config's registered estimator unless the optimizer
        # brings its own (HiZOO, LOZO, ZO-Muon); how the step moves: plain SGD unless it brings a rule
        self.estimator = estimator if estimator is not None else estimator_of(cfg.estimator)
        self.rule = rule if rule is not None else SGDRule()
        super().__init__(params, dict(lr=cfg.lr, weight_decay=cfg.weight_decay))
        # eps is one value for all parameters: one perturbation moves every parameter along the same z.
        self.eps, self.noise, self.reduction = cfg.eps, cfg.noise, cfg.reduction
        self.seed = seed
        self.n_queries = n_queries  # the step's Q when the loop passes none (checked by ``step``)
        self._layout: NoiseLayout | None = None
        self.last_chunk: int | None = None  # batched: the replicas per forward of the last step
        self.warned_sequential = False  # batched_queries with a closure that has no replicas: warned once
        self.state_step = 0
        self.forward_passes = 0
        self.last_losses: torch.Tensor | None = None
        self.last_projected_grads: torch.Tensor | None = None
        self.last_evaluated_seeds: list[int] | None = None  # several processes: the queries this rank evaluated
        self.comm_s: list[float] = []  # several processes: seconds of each step's all-reduce (for the benches)
        self._last_update: tuple | None = None  # what the last step applied, for ``intended_update``

    @property
    def layout(self) -> NoiseLayout | None:
        """How the last step laid the trainable set out for drawing z (None before the first step)."""
        return self._layout

    def masks(self, params: Sequence[torch.Tensor]) -> Masks:
        """Which entries of each parameter to perturb and update; None means all (Sparse-MeZO overrides this)."""
        return None

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Closure | None = None, n_queries: int | None = None, plan: StepPlan | None = None
    ) -> torch.Tensor:
        """One ZO-SGD step; returns the mean of every loss it evaluated (a device tensor), the loss to log.

        ``plan``: this rank's share of the step when the run spans several processes (``adazeta.distributed``):
        ``closure`` then scores this rank's shard of the minibatch, and the step evaluates only this rank's
        queries; one all-reduce gives every rank all losses and projected gradients, and every rank applies
        the whole update from the step's seeds.
        """
        if closure is None:
            raise ValueError("ZOSGD.step needs a closure that returns the loss (no backward)")
        q = self.n_queries = check_queries(self.n_queries if n_queries is None else n_queries)
        params, lrs, wds = [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                params.append(p)
                lrs.append(group["lr"])
                wds.append(group["weight_decay"])
        seeds = [query_seed(self.seed, self.state_step, i) for i in range(q)]
        masks = self.masks(params)
        layout = self._layout = noise_layout(params, self.noise, self._layout)
        cache = DirectionCache(layout, masks, self.KEEP_DIRECTION_BYTES)

        queries = Queries(closure, params, seeds, masks, cache, plan)
        losses, grads = self.estimator.estimate(self, queries)
        # an estimate may leave its last restoring perturbation to the update's pass (``queries.restore``)
        update = Step(params, seeds, grads, lrs, wds, masks, layout, cache, queries.restore, self.reduction,
                      self.noise, closure, losses)
        extra = self.rule.update_(self, update)  # the rule's own forwards (a candidate search), else 0
        self._last_update = (seeds, grads, lrs, wds, masks, layout)
        del cache, update, queries

        self.state_step += 1
        self.forward_passes += len(losses) + extra
        self.last_losses, self.last_projected_grads = losses, grads
        return losses.mean()

    @torch.no_grad()
    def intended_update(self, index: Sequence[torch.Tensor | None],
                        before: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The last step's update in exact arithmetic (float64) at entries ``index[i]`` of parameter i (None: all):
        -lr (g + wd w), g = (1/Q or 1) sum_q grad_q z_q with each z_q as drawn; ``before``: those entries (float64)
        before the step. The update applied differs from it by the rounding of the weights' dtype
        (``adazeta.guards``). Draws each z once more, a chunk at a time: no copy of the weights."""
        if self._last_update is None:
            raise RuntimeError("intended_update() before any step")
        if not self.rule.exact:  # another rule's move is not this sum (its cosine is left blank)
            return None
        seeds, grads, lrs, wds, masks, layout = self._last_update
        scale = 1.0 / len(seeds) if self.reduction == "mean" else 1.0
        out = [-(lr * wd) * b for b, lr, wd in zip(before, lrs, wds)]
        for seed, grad in zip(seeds, grads.double().cpu().tolist()):
            coefs = [-lr * grad * scale for lr in lrs]

            def gather(at: list[int], views: list[torch.Tensor], zs: list[torch.Tensor]) -> None:
                for view, z, i in zip(views, zs, at):
                    start = (view.data_ptr() - layout.flat[i].data_ptr()) // view.element_size()
                    z, picked = z.reshape(-1), index[i]
                    if picked is None:
                        out[i][start : start + z.numel()] += coefs[i] * z.double()
                    else:
                        lo = int(torch.searchsorted(picked, start))
                        hi = int(torch.searchsorted(picked, start + z.numel()))
                        out[i][lo:hi] += coefs[i] * z[picked[lo:hi] - start].double()

            each_draw(layout, seed, masks, gather)
        return out

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # The step count is part of every query's seed: resuming without it would replay old directions.
        state["zo"] = {
            "step": self.state_step,
            "seed": self.seed,
            "forward_passes": self.forward_passes,
            "n_queries": self.n_queries,
            "noise": self.noise,
        }
        if not isinstance(self.rule, SGDRule):  # plain SGD keeps nothing; checkpoints before rules hold no entry
            state["rule"] = self.rule.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        zo = state_dict.pop("zo", None)
        rule = state_dict.pop("rule", None)
        super().load_state_dict(state_dict)
        if rule is not None or not isinstance(self.rule, SGDRule):
            self.rule.load_state_dict(rule or {"name": "sgd"}, [p for g in self.param_groups for p in g["params"]])
        if zo is not None:
            saved = zo.get("noise", "per_tensor")  # checkpoints from before the choice used per_tensor
            if saved != self.noise:
                raise ConfigError(
                    f"the checkpoint's ZO directions come from noise={saved!r}, this run has noise={self.noise!r}: "
                    f"resume with method.optimizer.noise={saved}"
                )
            self.state_step = int(zo["step"])
            self.seed = int(zo["seed"])
            self.forward_passes = int(zo.get("forward_passes", 0))
            self.n_queries = int(zo.get("n_queries", self.n_queries))


@dataclasses.dataclass
class ZOSGDConfig(OptimizerCapabilities):
    """ZO-SGD hyper-parameters; the query count comes from the schedule, not from here."""

    zeroth_order: ClassVar[bool] = True

    lr: float = 1e-4  # constant step size; MeZO on all weights needs ~1e-6, adapters ~1e-4
    eps: float = 1e-3  # perturbation scale; much smaller loses the loss difference to rounding in bf16
    weight_decay: float = 0.0  # applied to weights only, never to biases or norms
    reduction: str = "mean"  # mean: reference code's 1/Q; sum: paper slides' plain sum (step grows with Q)
    estimator: str = "central"  # central: 2Q forwards; one_sided: Q + 1 forwards, biased by O(eps)
    # true: a step's perturbed losses come from batched forwards over a replicated minibatch, each copy with its
    # own perturbed adapter weights (adapter methods only: TT, LoRA, dense adapters); same gradients, fewer
    # and larger forwards. false: one forward per loss, as the reference code.
    batched_queries: bool = False
    # batched: at most this many loss evaluations per forward (memory grows with it); auto: as many as fit in
    # query_memory x the memory of an inference forward (weights and activations), estimated from each minibatch
    query_chunk: int | str = 4
    query_memory: float = 0.05
    # How a seed becomes z: per_tensor (one generator call per parameter: the stream of earlier releases, so the
    # same seeds give the same run), flat (one call per 4 M entries: fewer kernels, other directions) or blocks
    # (1 M entries per call, each with a generator of its own: drawn on every CPU thread; other directions).
    noise: str = "per_tensor"

    @property
    def forwards_per_query(self) -> int:
        forwards = estimator_of(self.estimator).forwards
        return forwards(1) - forwards(0)  # what one more query costs (one_sided: 1, plus one unperturbed a step)

    def forwards(self, queries: int) -> int:
        return estimator_of(self.estimator).forwards(queries)

    @property
    def batches_queries(self) -> bool:
        return bool(self.batched_queries)

    @property
    def parallel_modes(self) -> tuple[str, ...]:
        return estimator_of(self.estimator).parallel

    @property
    def derivative_free(self) -> bool:  # a forward-mode estimator (forward_grad) differentiates the loss
        return not estimator_of(self.estimator).forward_mode

    def activation_copies(self, width: int) -> float:
        # A jvp: a tangent beside every activation, the terms of an op with two dual inputs (a trained weight's),
        # the attention's math kernel, and with a 16-bit backbone the float32 copies its norms make. Measured on the
        # tiny model: 2.1x a forward's activations with adapters trained, 2.4x with every weight; 16-bit: 2.6x, 3.5x.
        if not estimator_of(self.estimator).forward_mode:
            return 1
        return 2.5 if width >= 4 else 3.5

    def step_bytes(self, trained: TrainedSet, queries: int) -> float:
        """The larger of what the estimate holds (``estimate_bytes``) and what the update does: the z kept for
        it and the rule's own temporaries (``update_bytes``)."""
        kept = self.kept_directions(trained, queries)
        return max(self.estimate_bytes(trained, queries), kept * trained.nbytes + self.update_bytes(trained, kept > 0))

    def kept_directions(self, trained: TrainedSet, queries: int) -> int:
        """How many of the step's z its ``DirectionCache`` keeps for the update (a jvp draws its own: none)."""
        if estimator_of(self.estimator).forward_mode:
            return 0
        return kept_count(trained, queries, ZOSGD.KEEP_DIRECTION_BYTES)

    def estimate_bytes(self, trained: TrainedSet, queries: int) -> float:
        """What the estimate holds beside a forward's activations. A jvp: its query's z whole (the tangents)
        and a copy of the largest weight, which the forward-mode matmul makes (SmolLM2's tied LM head: 113 MB).
        Perturbed forwards: the z alive (the kept ones and the query's own, or one pass's noise), and either a
        copy of a trained set of at most ``ZOSGD.KEEP_WEIGHTS_BYTES`` to restore it exactly, or with batched
        queries ``query_chunk`` replicas of it (``auto`` chooses them within ``query_memory``, which the dry run
        counts with the activations)."""
        n = trained.nbytes
        if estimator_of(self.estimator).forward_mode:
            return n + trained.largest_weight_bytes
        kept = self.kept_directions(trained, queries)
        if self.batched_queries:
            replicas = 0 if self.query_chunk == "auto" else min(int(self.query_chunk), self.forwards(queries))
            return replicas * n + min(queries, kept + 1) * n  # ``directions`` draws a z whole when none is kept
        z = min(queries, kept + 1) * n if kept else draw_bytes(trained)
        return (n if n <= ZOSGD.KEEP_WEIGHTS_BYTES else 0) + z

    def update_bytes(self, trained: TrainedSet, kept: bool) -> float:
        """The update's temporaries beside the kept z: ZO-SGD's from the seeds, a scaled copy of a kept z
        (``spsa._move``) or one pass's noise, scaled where it lies."""
        return trained.nbytes if kept else draw_bytes(trained)

    def __post_init__(self) -> None:
        # lr > 0 is a run's rule, checked once with the settings (``adazeta.settings``); a tool may estimate at 0.
        where = "method.optimizer."
        if self.eps <= 0:
            raise ConfigError(f"{where}eps={self.eps!r} must be > 0")
        if self.weight_decay < 0:
            raise ConfigError(f"{where}weight_decay={self.weight_decay!r} must be >= 0")
        if self.reduction not in REDUCTIONS:
            raise ConfigError(f"{where}reduction={self.reduction!r} must be one of {', '.join(REDUCTIONS)}")
        if self.estimator not in ESTIMATORS:
            raise ConfigError(f"{where}estimator={self.estimator!r} must be one of {', '.join(ESTIMATORS.names())}")
        if self.noise not in NOISE_STREAMS:
            raise ConfigError(f"{where}noise={self.noise!r} must be one of {', '.join(NOISE_STREAMS)}")
        chunk = self.query_chunk
        if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ConfigError(f"{where}query_chunk={chunk!r} must be an int >= 1 (loss evaluations per forward) "
                              "or auto (as many as query_memory allows)")
        memory = self.query_memory
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0:
            raise ConfigError(f"{where}query_memory={memory!r} must be a number > 0 (a fraction of the inference "
                              "forward's memory, e.g. 0.05)")
        if self.batched_queries and not estimator_of(self.estimator).batched:
            raise ConfigError(f"{where}estimator={self.estimator} evaluates no weight replicas; set "
                              f"{where}batched_queries=false")


@OPTIMIZERS.register("zo_sgd", ZOSGDConfig)
def build_zo_sgd(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ZOSGDConfig, seed: int) -> ZOSGD:
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed)
