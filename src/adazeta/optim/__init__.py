"""Optimizers: zeroth-order (ZO-SGD) and first-order, behind one registry.

A builder registered in ``OPTIMIZERS`` takes ``(named_params, cfg, seed)`` where ``named_params`` is a list of
``(name, parameter)`` pairs to train, and returns a ``torch.optim.Optimizer``. Zeroth-order optimizers set the
class attribute ``zeroth_order = True`` and take a closure that returns the loss without calling backward.
"""

from adazeta.registry import Registry

OPTIMIZERS: Registry = Registry("optimizer")

# Importing the built-in optimizers registers them.
from adazeta.optim import first_order, zo_sgd  # noqa: E402,F401
from adazeta.optim import sparse_mezo  # noqa: E402,F401
