"""ZO-SGD: MeZO's zeroth-order SGD (Malladi et al. 2023) with Q queries a step, a drop-in ``torch.optim.Optimizer``.

Over 400 lines: one optimizer class (sequential, batched and distributed steps, guard hooks) and its config.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, ClassVar, Iterable, Sequence

import torch

from adazeta.distributed import StepPlan, all_sum_
from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS, OptimizerCapabilities
from adazeta.optim.batched import auto_chunk, estimate_batched
from adazeta.optim.engine import ESTIMATORS, SGDRule, Step, UpdateRule, estimator as estimator_of
from adazeta.optim.memory import TrainedSet, draw_bytes, kept_count
from adazeta.optim.spsa import (
    NOISE_STREAMS,
    DirectionCache,
    Masks,
    NoiseLayout,
    decay_groups,
    noise_layout,
    perturb_,
    projected_gradient,
    query_seed,
    each_draw,
)

log = logging.getLogger("adazeta")

Closure = Callable[[], torch.Tensor | float]

REDUCTIONS = ("mean", "sum")


def _validate(
    where: str, lr: float, eps: float, weight_decay: float, reduction: str, estimator: str, noise: str = "per_tensor"
) -> None:
    """Fail at start-up, naming the field, its value and what is allowed."""
    if lr < 0:
        raise ConfigError(f"{where}lr={lr!r} must be >= 0")
    if eps <= 0:
        raise ConfigError(f"{where}eps={eps!r} must be > 0")
    if weight_decay < 0:
        raise ConfigError(f"{where}weight_decay={weight_decay!r} must be >= 0")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"{where}reduction={reduction!r} must be one of {', '.join(REDUCTIONS)}")
    if estimator not in ESTIMATORS:
        raise ConfigError(f"{where}estimator={estimator!r} must be one of {', '.join(ESTIMATORS.names())}")
    if noise not in NOISE_STREAMS:
        raise ConfigError(f"{where}noise={noise!r} must be one of {', '.join(NOISE_STREAMS)}")


AUTO_CHUNK_LIMIT = 64  # query_chunk=auto never replicates a minibatch more than this many times


def _check_chunk(where: str, query_chunk: Any) -> int | str:
    if query_chunk == "auto":
        return query_chunk
    if isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1:
        raise ConfigError(f"{where}query_chunk={query_chunk!r} must be an int >= 1 (loss evaluations per forward) "
                          "or auto (as many as query_memory allows)")
    return query_chunk


def _check_memory(where: str, query_memory: Any) -> float:
    if isinstance(query_memory, bool) or not isinstance(query_memory, (int, float)) or not query_memory > 0:
        raise ConfigError(f"{where}query_memory={query_memory!r} must be a number > 0 (a fraction of the inference "
                          "forward's memory, e.g. 0.05)")
    return float(query_memory)


def _check_queries(n_queries: Any) -> int:
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
    whose z takes at most ``KEEP_DIRECTION_BYTES`` draws each z once and keeps it for the update. The step is
    split in two: ``estimate`` evaluates the perturbed losses and returns the projected gradients, and
    ``zo_update_`` applies them. With ``batched_queries`` (adapter methods) and a closure that can evaluate
    weight replicas (``adazeta.optim.batched.ReplicaClosure``), the losses come from batched forwards of at most
    ``query_chunk`` perturbed copies each, with the same z and the same projected gradients; a plain closure
    falls back to one forward per loss. ``forward_passes`` counts loss evaluations either way. A distributed
    estimator (queries spread over ranks, projected gradients all-gathered) overrides ``estimate`` only.
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
        lr: float = 1e-4,
        eps: float = 1e-3,
        weight_decay: float = 0.0,
        seed: int = 0,
        n_queries: int = 1,
        reduction: str = "mean",
        estimator: str = "central",
        batched_queries: bool = False,
        query_chunk: int | str = 4,
        noise: str = "per_tensor",
        query_memory: float = 0.05,
        rule: UpdateRule | None = None,
    ):
        _validate("ZOSGD ", lr, eps, weight_decay, reduction, estimator, noise)
        self.rule = rule if rule is not None else SGDRule()  # how the step moves (adazeta.optim.engine)
        self.noise = noise
        self._layout: NoiseLayout | None = None
        self.batched_queries = bool(batched_queries)
        self.query_chunk = _check_chunk("ZOSGD ", query_chunk)
        self.query_memory = _check_memory("ZOSGD ", query_memory)
        self.last_chunk: int | None = None  # batched: the replicas per forward of the last step
        self._warned_sequential = False
        if seed < 0:
            raise ConfigError(f"ZOSGD seed={seed!r} must be >= 0")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        for group in self.param_groups:  # per-group overrides get the same checks as the defaults
            _validate("ZOSGD param group ", group["lr"], eps, group["weight_decay"], reduction, estimator)
        # eps is one value for all parameters: one perturbation moves every parameter along the same z.
        self.eps = eps
        self.seed = seed
        self.n_queries = _check_queries(n_queries)
        self.reduction = reduction
        self.estimator = estimator
        self.differences = estimator_of(estimator).differences  # the finite differences ``estimate`` takes
        self.state_step = 0
        self.forward_passes = 0
        self.last_losses: torch.Tensor | None = None
        self.last_projected_grads: torch.Tensor | None = None
        self.last_evaluated_seeds: list[int] | None = None  # several processes: the queries this rank evaluated
        self.comm_s: list[float] = []  # several processes: seconds of each step's all-reduce (for the benches)
        self._restore: tuple[int, float] | None = None
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
        q = self.n_queries = _check_queries(self.n_queries if n_queries is None else n_queries)
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

        self._restore = None  # an estimate may leave its last restoring perturbation to the update's pass
        losses, grads = estimator_of(self.estimator).estimate(self, closure, params, seeds, masks, cache, plan)
        update = Step(params, seeds, grads, lrs, wds, masks, layout, cache, self._restore, self.reduction, self.noise,
                      closure, losses)
        extra = self.rule.update_(self, update)  # the rule's own forwards (a candidate search), else 0
        self._restore = None
        self._last_update = (seeds, grads, lrs, wds, masks, layout)
        del cache, update

        self.state_step += 1
        self.forward_passes += len(losses) + extra
        self.last_losses, self.last_projected_grads = losses, grads
        return losses.mean()

    def estimate(
        self,
        closure: Closure,
        params: Sequence[torch.Tensor],
        seeds: Sequence[int],
        masks: Masks = None,
        cache: DirectionCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluate the perturbed losses; return (all losses evaluated, projected gradient per query) on device.

        Leaves the parameters as it found them (up to rounding). Queries run one after another here; override
        this method to batch them or to spread them over ranks. ``cache`` hands out z drawn once per query.
        """
        if cache is None:
            cache = DirectionCache(noise_layout(params, self.noise, self._layout), masks)  # keeps nothing
        if self._replicas(closure):
            return estimate_batched(closure, params, seeds, self.eps, self.differences, self._chunk(closure, params),
                                    masks, cache)
        return self._estimate_sequential(closure, params, seeds, masks, cache)

    def _replicas(self, closure: Closure) -> bool:
        """Whether the losses come from batched forwards over weight replicas (``batched_queries``)."""
        if self.batched_queries:
            if callable(getattr(closure, "replicated", None)):
                return True
            if not self._warned_sequential:  # e.g. a generation objective: nothing to replicate
                log.warning("batched_queries=true, but this closure cannot evaluate weight replicas: sequential")
                self._warned_sequential = True
        return False

    def _chunk(self, closure: Closure, params: Sequence[torch.Tensor]) -> int:
        """Replicas per batched forward: ``query_chunk``, or with ``auto`` the most that ``query_memory`` allows."""
        chunk = self.query_chunk
        if chunk == "auto":
            chunk = auto_chunk(closure, params, self.query_memory, AUTO_CHUNK_LIMIT)
        self.last_chunk = chunk
        return chunk

    def _estimate_sequential(
        self,
        closure: Closure,
        params: Sequence[torch.Tensor],
        seeds: Sequence[int],
        masks: Masks,
        cache: DirectionCache,
        evaluated: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward per loss, perturbing the parameters in place; ``evaluated``: the indices of the queries to
        evaluate (None: all). The others are perturbed and restored without a forward, so that the parameters
        end with the rounding of the whole step's perturbations, as on a single process."""
        layout, eps = cache.layout, self.eps
        wanted = set(range(len(seeds)) if evaluated is None else evaluated)
        saved = [f.clone() for f in layout.flat] if layout.nbytes <= self.KEEP_WEIGHTS_BYTES else None

        def restore(seed: int, scale: float, z: Any) -> None:
            if saved is not None:
                torch._foreach_copy_(layout.flat, saved)  # exact, whatever the rounding of the perturbations
            else:
                perturb_(params, seed, scale, masks, self.noise, z, layout)

        # One query with a z drawn on every pass (a full model): its restoring pass is left to the update, which
        # undoes it with the z it draws anyway (``zo_update_(restore=...)``): a quarter of the step's draws.
        defer = self.FUSE_RESTORE and len(seeds) == 1 and cache.peek(seeds[0]) is None and saved is None
        losses: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if self.differences == "central":
            for i, seed in enumerate(seeds):
                z = cache.get(seed)  # None: regenerated on every pass
                perturb_(params, seed, eps, masks, self.noise, z, layout)
                loss_plus = as_loss(closure()) if i in wanted else None
                perturb_(params, seed, -2 * eps, masks, self.noise, z, layout)
                loss_minus = as_loss(closure()) if i in wanted else None
                if defer and z is None:
                    self._restore = (seed, eps)
                else:
                    restore(seed, eps, z)
                del z
                if i in wanted:
                    losses += [loss_plus, loss_minus]
                    grads.append(projected_gradient(loss_plus, loss_minus, eps))
        elif self.differences == "members":
            # One forward at each w + eps z_q, no difference taken: the estimator shapes the Q losses (ES).
            for i, seed in enumerate(seeds):
                z = cache.get(seed)
                perturb_(params, seed, eps, masks, self.noise, z, layout)
                if i in wanted:
                    losses.append(as_loss(closure()))
                restore(seed, -eps, z)
                del z
            grads = list(losses)
        else:
            # One-sided (L(w + eps z) - L(w)) / eps: Q + 1 forwards instead of 2Q, at the price of O(eps) bias.
            loss_zero = as_loss(closure()) if wanted else None
            if wanted:
                losses.append(loss_zero)
            for i, seed in enumerate(seeds):
                z = cache.get(seed)
                perturb_(params, seed, eps, masks, self.noise, z, layout)
                loss_plus = as_loss(closure()) if i in wanted else None
                if defer and z is None:
                    self._restore = (seed, -eps)
                else:
                    restore(seed, -eps, z)
                del z
                if i in wanted:
                    losses.append(loss_plus)
                    grads.append((loss_plus - loss_zero) / eps)
        if not losses:
            empty = torch.zeros(0, device=params[0].device)
            return empty, empty
        return torch.stack(losses), torch.stack(grads)

    def estimate_share(
        self,
        closure: Closure,
        params: Sequence[torch.Tensor],
        seeds: Sequence[int],
        masks: Masks,
        cache: DirectionCache,
        plan: StepPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's queries on this rank's shard, summed over the ranks into the whole step's estimate.

        Each rank fills the slots of its queries with its losses and projected gradients times its shard's share
        of the minibatch (zeros elsewhere); one all-reduce of the 3Q floats completes them on every rank.
        """
        q, central = len(seeds), self.differences == "central"
        mine = plan.queries(q)
        n_losses = 2 * q if central else q + 1
        dtype = torch.promote_types(params[0].dtype, torch.float32)
        buffer = torch.zeros(n_losses + q, dtype=dtype, device=params[0].device)
        losses, grads = buffer[:n_losses], buffer[n_losses:]
        weight = plan.weight
        evaluates = bool(mine) and weight > 0  # a rank without a query this step, or with an empty shard: zeros
        if not evaluates:
            mine = []
        self.last_evaluated_seeds = [seeds[i] for i in mine]
        if self._replicas(closure):  # the parameters stay untouched; keep the z a single process keeps
            cache.keep(seeds)
            local_losses, local_grads = (
                estimate_batched(closure, params, [seeds[i] for i in mine], self.eps, self.differences,
                                 self._chunk(closure, params), masks, cache) if evaluates else (None, None))
        else:  # the other ranks' queries are perturbed and restored too: the same rounding on every rank
            local_losses, local_grads = self._estimate_sequential(closure, params, seeds, masks, cache, mine)
        if evaluates:
            at = torch.tensor(mine, device=buffer.device)
            grads[at] = local_grads.to(dtype) * weight
            local_losses = local_losses.to(dtype) * weight
            if central:
                losses[2 * at], losses[2 * at + 1] = local_losses[0::2], local_losses[1::2]
            else:
                if plan.group == 0:  # the unperturbed loss: every group computes it, one group reports it
                    losses[0] = local_losses[0]
                losses[1 + at] = local_losses[1:]
        start = time.perf_counter()
        all_sum_(buffer)
        self.comm_s.append(time.perf_counter() - start)  # the step's one all-reduce, timed where it runs
        return losses, grads

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
            self.n_queries = _check_queries(int(zo.get("n_queries", self.n_queries)))


def as_loss(value: torch.Tensor | float) -> torch.Tensor:
    """The closure's loss as a detached scalar tensor of at least fp32, left on its device (no host sync)."""
    loss = torch.as_tensor(value).detach()
    if loss.numel() != 1:
        raise ValueError(f"the ZOSGD closure must return a scalar loss, got shape {tuple(loss.shape)}")
    return loss.to(torch.promote_types(loss.dtype, torch.float32)).reshape(())


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
        if self.lr <= 0:  # a run's rate (the class takes 0: a tool may estimate without moving the weights)
            raise ConfigError(f"method.optimizer.lr={self.lr!r} must be > 0: a learning rate of {self.lr!r} never "
                              "moves a weight")
        _validate("method.optimizer.", self.lr, self.eps, self.weight_decay, self.reduction, self.estimator, self.noise)
        _check_chunk("method.optimizer.", self.query_chunk)
        _check_memory("method.optimizer.", self.query_memory)
        if self.batched_queries and not estimator_of(self.estimator).batched:
            raise ConfigError(f"method.optimizer.estimator={self.estimator} evaluates no weight replicas; set "
                              "method.optimizer.batched_queries=false")


def zo_settings(cfg: ZOSGDConfig) -> dict[str, Any]:
    """The ZOSGD constructor's keyword arguments from a config (every ZO-SGD field, under its own name): an
    optimizer built on the engine passes them through, so new ZO-SGD options reach it too."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ZOSGDConfig)}


@OPTIMIZERS.register("zo_sgd", ZOSGDConfig)
def build_zo_sgd(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ZOSGDConfig, seed: int) -> ZOSGD:
    return ZOSGD(
        decay_groups(named_params, cfg.weight_decay),
        lr=cfg.lr,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        seed=seed,
        reduction=cfg.reduction,
        estimator=cfg.estimator,
        batched_queries=cfg.batched_queries,
        query_chunk=cfg.query_chunk,
        query_memory=cfg.query_memory,
        noise=cfg.noise,
    )
