"""The zeroth-order engine in two registered pieces: a perturbation estimator and an update rule.

A ZO step (``ZOSGD.step``) is

    losses, g = estimator(closure, directions z_1 .. z_Q)      # which forwards, how losses become g_q
    w <- rule(w, g_hat),  g_hat = (1/Q or 1) sum_q g_q z_q      # how the step moves, what it keeps

- An **estimator** (``Estimator``, the shared ones registered in ``ESTIMATORS``) decides how many forwards a query
  costs, how they run (one after another, in batched forwards over weight replicas, or this rank's share of a
  step spread over processes) and how its losses combine into one coefficient g_q per direction z_q: central
  differences (MeZO), one-sided differences, ES's fitness shaping (``adazeta.optim.differences``), or a
  forward-mode directional derivative (``adazeta.optim.forward_grad``). The directions are the seeded Gaussian
  stream of ``adazeta.optim.spsa``, so every such estimator works with every trainable set, mask, noise stream and
  schedule.
- An **update rule** (``UpdateRule``) turns the estimate into a move: plain SGD (ZO-SGD: applied straight from
  the seeds, g_hat never materialised), sign, momentum, Adam, the conservative candidate search, ... A rule other
  than SGD gets g_hat as tensors (``Step.dense``) and keeps its state per parameter (checkpointed with the run).

An optimizer is ``ZOSGD`` composed of the two and built from its typed config: ``zo_adam`` is ZO-SGD's estimator
with the Adam rule. A new one is one Python file in this package (its config dataclass, declaring its
capabilities, its rule or estimator, and a builder registered in ``OPTIMIZERS``) and one YAML in
``conf/optimizer/``. Optimizers whose directions are not the seeded Gaussian stream (HiZOO, LOZO, ZO-Muon) bring
an estimator and a rule of their own (their common pieces: ``adazeta.optim.own_directions``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch

from adazeta.registry import ESTIMATORS
from adazeta.optim.memory import TrainedSet, draw_bytes, piece_bytes
from adazeta.optim.spsa import DirectionCache, Masks, NoiseLayout, each_draw, perturb_, zo_update_

if TYPE_CHECKING:
    from adazeta.distributed import StepPlan

Closure = Callable[[], Any]


@dataclasses.dataclass
class Step:
    """What one step's update needs: the parameters, the estimate, and the closure (a rule may evaluate more)."""

    params: list[torch.Tensor]
    seeds: list[int]
    grads: torch.Tensor  # (Q,) g_q, one per direction, on the device
    lrs: list[float]
    wds: list[float]
    masks: Masks
    layout: NoiseLayout
    cache: DirectionCache
    restore: tuple[int, float] | None  # an estimate's last perturbation, still to undo (``zo_update_``)
    reduction: str
    noise: str
    closure: Closure | None = None
    losses: torch.Tensor | None = None  # every loss the estimate evaluated, in its order (HiZOO's curvature reads them)

    def settle(self) -> None:
        """Undo the estimate's pending perturbation (if any): the weights are w again."""
        if self.restore is not None:
            seed, scale = self.restore
            perturb_(self.params, seed, scale, self.masks, self.noise, self.cache.peek(seed), self.layout)
            self.restore = None

    @torch.no_grad()
    def dense(self) -> list[torch.Tensor]:
        """g_hat = (1/Q or 1) sum_q g_q z_q for every parameter, shaped like it, in at least float32; each z_q
        drawn as the estimate drew it (the same seeds, masks and noise stream), a chunk at a time."""
        self.settle()
        layout = self.layout
        out = [torch.zeros(f.shape, dtype=torch.promote_types(f.dtype, torch.float32), device=f.device)
               for f in layout.flat]
        scale = 1.0 / len(self.seeds) if self.reduction == "mean" else 1.0
        for seed, coef in zip(self.seeds, self.grads.reshape(-1) * scale):
            kept = self.cache.peek(seed)
            if kept is not None:
                for i, z in enumerate(kept):
                    out[i].add_(z.to(out[i].dtype) * coef.to(out[i].device, out[i].dtype))
                continue

            def gather(index: list[int], views: list[torch.Tensor], zs: list[torch.Tensor], coef=coef) -> None:
                for i, view, z in zip(index, views, zs):
                    start = (view.data_ptr() - layout.flat[i].data_ptr()) // view.element_size()
                    out[i][start : start + z.numel()].add_(z.reshape(-1).to(out[i].dtype) * coef.to(out[i].dtype))

            each_draw(layout, seed, self.masks, gather)
        return [g.view(p.shape) for g, p in zip(out, self.params)]


def dense_bytes(t: TrainedSet, kept: bool, then: int = 0) -> int:
    """The peak of a rule on ``Step.dense``: g_hat in at least float32, beside one piece of z scaled into it
    while it is summed (a drawn z: beside the pass's noise), then beside the rule's own ``then`` bytes."""
    return t.work + max(piece_bytes(t, kept) + (0 if kept else draw_bytes(t)), then)


class UpdateRule:
    """How a ZO step moves the weights from its estimate, and what it keeps between steps.

    ``update_(opt, step)`` moves ``step.params`` in place and returns the forwards it evaluated itself (0 for
    most rules). ``state``: one dict of tensors per parameter (index order), saved with the optimizer's
    state_dict so that a resumed run continues bit for bit. ``buffers``: tensors of the parameter's size it
    keeps per parameter (the dry run's memory estimate reads it through the config's ``state_bytes``).
    ``exact``: the guard's intended update (``ZOSGD.intended_update``) describes this rule (plain SGD only).
    """

    name: ClassVar[str] = "sgd"
    buffers: ClassVar[int] = 0
    exact: ClassVar[bool] = False

    def __init__(self) -> None:
        self.state: list[dict[str, torch.Tensor]] = []

    def update_(self, opt: Any, step: Step) -> int:
        raise NotImplementedError

    def slots(self, params: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The per-parameter state, created empty on the first step."""
        if len(self.state) != len(params):
            self.state = [{} for _ in params]
        return self.state

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": [{k: v.detach().cpu().clone() for k, v in s.items()} for s in self.state]}

    def load_state_dict(self, saved: dict[str, Any], params: Sequence[torch.Tensor]) -> None:
        from adazeta.errors import ConfigError

        if saved.get("name") != self.name:
            raise ConfigError(f"the checkpoint's ZO update rule is {saved.get('name')!r}, this run's is {self.name!r}: "
                              "resume with the optimizer that wrote it")
        self.state = [{k: v.to(p.device) for k, v in s.items()} for s, p in zip(saved["state"], params)]


class SGDRule(UpdateRule):
    """ZO-SGD's update, w <- w - lr (g_hat + wd w), applied straight from the seeds (``spsa.zo_update_``): g_hat is
    never materialised and a full model's z is redrawn a chunk at a time (MeZO's memory)."""

    name = "sgd"
    exact = True

    def update_(self, opt: Any, step: Step) -> int:
        zo_update_(step.params, step.seeds, step.grads, step.lrs, step.wds, step.reduction, step.masks, step.noise,
                   step.cache, step.layout, step.restore)
        step.restore = None
        return 0


def decay_(params: Sequence[torch.Tensor], lrs: Sequence[float], wds: Sequence[float]) -> None:
    """w <- w (1 - lr wd): decoupled weight decay, on the parameters whose group decays."""
    for p, lr, wd in zip(params, lrs, wds):
        if wd > 0:
            p.mul_(1.0 - lr * wd)


@dataclasses.dataclass
class Queries:
    """One step's queries as an estimator sees them: the closure, the parameters, the query seeds, the masks, the
    step's ``DirectionCache`` and, when the run spans several processes, this rank's ``plan``. ``restore``: set by an
    estimator that leaves its last restoring perturbation to the update's pass (``Step.restore``)."""

    closure: Closure
    params: Sequence[torch.Tensor]
    seeds: Sequence[int]
    masks: Masks
    cache: DirectionCache
    plan: "StepPlan | None" = None
    restore: tuple[int, float] | None = None


class Estimator:
    """How a step's queries are evaluated and their losses combined into one g_q per direction: a strategy object
    that a ZO optimizer composes with an ``UpdateRule`` (``ZOSGD(params, config, estimator=..., rule=...)``).

    ``estimate(opt, queries)`` -> (every loss evaluated, g of each query), on the device; ``opt`` is the optimizer,
    whose public settings it reads (``eps``, ``noise``, ``config``, ``seed``, ``state_step``, ``rule``) and whose
    records it fills (``last_chunk``, ``last_evaluated_seeds``, ``comm_s``). ``forwards(q)``: forward passes of a
    step of q queries; ``batched``: whether ``batched_queries`` (weight replicas) applies; ``parallel``: the
    ``distributed.mode``s that can spread its queries or data; ``forward_mode``: its evaluations are jvps, not
    perturbed forwards (what its memory is: ``ZOSGDConfig``). The shared ones are registered by name in
    ``ESTIMATORS`` (``method.optimizer.estimator`` picks one); an optimizer with directions of its own builds its
    estimator in its builder.
    """

    name: str = ""
    batched: bool = True
    parallel: tuple[str, ...] = ("auto", "query", "data")
    forward_mode: bool = False

    def forwards(self, queries: int) -> int:
        raise NotImplementedError

    def estimate(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def register_estimator(estimator: Estimator) -> Estimator:
    """``estimator`` registered under its name in ``ESTIMATORS`` (``method.optimizer.estimator`` picks it)."""
    return ESTIMATORS.register(estimator.name)(estimator)


def estimator(name: str) -> Estimator:
    """The registered estimator ``name`` (a ConfigError naming the known ones otherwise)."""
    return ESTIMATORS.get(name).builder


def as_loss(value: torch.Tensor | float) -> torch.Tensor:
    """The closure's loss as a detached scalar tensor of at least fp32, left on its device (no host sync)."""
    loss = torch.as_tensor(value).detach()
    if loss.numel() != 1:
        raise ValueError(f"the ZOSGD closure must return a scalar loss, got shape {tuple(loss.shape)}")
    return loss.to(torch.promote_types(loss.dtype, torch.float32)).reshape(())
