"""Optimizers: zeroth-order (ZO-SGD) and first-order, behind one registry.

A builder registered in ``OPTIMIZERS`` takes ``(named_params, cfg, seed)`` where ``named_params`` is a list of
``(name, parameter)`` pairs to train, and returns a ``torch.optim.Optimizer``. The training loop's contract:

- zeroth-order: the class attribute ``zeroth_order = True`` and ``step(closure, n_queries=Q)``, where ``closure()``
  returns the minibatch loss without calling backward and Q is the step's query count from the schedule (several
  processes: also ``plan=``, a ``distributed.StepPlan``); it returns the loss to log and counts
  ``forward_passes``;
- first-order: ``zeroth_order`` False or absent; the loop runs backward, then ``step()`` (which clips, if the
  optimizer clips: ``first_order.AdamW``).
"""

from adazeta.registry import Registry

OPTIMIZERS: Registry = Registry("optimizer")

# Importing every module of this package registers the built-in optimizers: a new optimizer is one new file here.
import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
