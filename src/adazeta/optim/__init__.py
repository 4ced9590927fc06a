"""Optimizers: zeroth-order (ZO-SGD) and first-order, behind one registry.

A builder registered in ``OPTIMIZERS`` takes ``(named_params, cfg, seed)`` where ``named_params`` is a list of
``(name, parameter)`` pairs to train, and returns a ``torch.optim.Optimizer``. The training loop's contract:

- zeroth-order: the class attribute ``zeroth_order = True`` and ``step(closure, n_queries=Q)``, where ``closure()``
  returns the minibatch loss without calling backward and Q is the step's query count from the schedule (several
  processes: also ``plan=``, a ``distributed.StepPlan``); it returns the loss to log and counts
  ``forward_passes``;
- first-order: ``zeroth_order = False``; the loop runs backward, then ``step()`` (which clips, if the optimizer
  clips: ``first_order.AdamW``).

Every optimizer a builder returns declares ``zeroth_order`` (``check_contract``, called when a run builds it).
"""

from typing import TYPE_CHECKING, Any, ClassVar

from adazeta.errors import ConfigError
from adazeta.registry import OPTIMIZERS  # noqa: F401  (the package's registry: adazeta.optim.OPTIMIZERS)

if TYPE_CHECKING:
    from adazeta.optim.memory import TrainedSet


class OptimizerCapabilities:
    """What the runner, the dry run's memory estimate and the bench may ask of an optimizer, declared on its config
    class: they read these, never the class or its kind.

    ``zeroth_order``: the loop's ZO contract (step(closure, n_queries=Q)) or first-order (backward, then step());
    ``state_bytes(entries, width)``: bytes of optimizer state for ``entries`` trained entries of ``width`` bytes;
    ``step_bytes(trained, queries)``: the peak bytes of the temporaries one step of ``queries`` queries holds at
    once beyond the weights, that state and a forward's activations (a dense estimate, a copy of the weights, kept
    directions, a rule's per-tensor arithmetic; ``adazeta.optim.memory``): the dry run adds it to its estimate;
    ``activation_copies(width)``: how many times a forward's activations (``width`` bytes an entry) one of its
    evaluations holds (a jvp: 2.5 and more);
    ``forwards_per_query``: forward passes a query costs (central differences: 2; one-sided: 1, plus one shared);
    ``batches_queries``: a step's queries run as weight replicas in batched forwards (needs a replicable adapter);
    ``forwards(q)``: forward passes of a step of q queries (the run length from a forward budget reads it);
    ``parallel_modes``: the ``distributed.mode``s that may spread its work over several processes (first-order:
    every one, through DDP);
    ``derivative_free``: its steps read loss values alone, never a derivative of the loss (finite differences), so
    it can train on an objective without one (generated answers' F1); first-order: False;
    ``lr``: its learning rate, a field of every optimizer's config (the runner refuses lr <= 0).
    """

    zeroth_order: ClassVar[bool] = False
    lr: float

    @property
    def derivative_free(self) -> bool:
        return self.zeroth_order

    def state_bytes(self, entries: int, width: int) -> float:
        return 0.0

    def step_bytes(self, trained: "TrainedSet", queries: int) -> float:
        return 0.0

    def activation_copies(self, width: int) -> float:
        return 1

    @property
    def forwards_per_query(self) -> int:
        return 0

    @property
    def batches_queries(self) -> bool:
        return False

    def forwards(self, queries: int) -> int:
        return 0

    @property
    def parallel_modes(self) -> tuple[str, ...]:
        return ("auto", "query", "data")


def check_contract(kind: str, optimizer: Any, cfg: Any = None) -> Any:
    """``optimizer`` (built by ``kind``'s builder) if it declares which side of the loop's contract it takes, the
    same side as its config (``cfg``) declares."""
    if not isinstance(getattr(optimizer, "zeroth_order", None), bool):  # the one place the attribute may lack
        raise ConfigError(
            f"optimizer {kind!r} built a {type(optimizer).__name__} without a bool `zeroth_order` attribute: declare "
            "zeroth_order = True (step(closure, n_queries=Q)) or False (backward, then step()) on its class"
        )
    if cfg is not None and getattr(cfg, "zeroth_order", optimizer.zeroth_order) != optimizer.zeroth_order:
        raise ConfigError(
            f"optimizer {kind!r}: its config {type(cfg).__name__} declares zeroth_order={cfg.zeroth_order} but the "
            f"built {type(optimizer).__name__} says {optimizer.zeroth_order}; make the two declarations agree"
        )
    return optimizer


def zeroth_order(optimizer: Any) -> bool:
    """Whether the training loop treats ``optimizer`` as zeroth-order; None (a method that trains nothing): no."""
    return optimizer is not None and optimizer.zeroth_order

# Importing every module of this package registers the built-in optimizers: a new optimizer is one new file here.
import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
