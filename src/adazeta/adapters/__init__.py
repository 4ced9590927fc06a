"""Parameter-efficient modules and the registry that attaches them to a model.

A builder registered in ``ADAPTERS`` takes ``(model, cfg)``, changes the model in place (or wraps it, as peft
does) and returns the model to train. Afterwards exactly the parameters the method trains have
``requires_grad=True``; everything else is frozen.
"""

from adazeta.registry import Registry

ADAPTERS: Registry = Registry("adapter")

# Importing every module of this package registers the built-in adapters: a new adapter is one new file here.
import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
