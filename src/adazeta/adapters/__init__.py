"""Parameter-efficient modules and the registry that attaches them to a model.

A builder registered in ``ADAPTERS`` takes ``(model, cfg)``, changes the model in place (or wraps it, as peft
does) and returns the model to train. Afterwards exactly the parameters the method trains have
``requires_grad=True``; everything else is frozen.
"""

from adazeta.registry import Registry

ADAPTERS: Registry = Registry("adapter")

# Importing the built-in adapters registers them.
from adazeta.adapters import basic, lora, tt  # noqa: E402,F401
from adazeta.adapters import bottleneck  # noqa: E402,F401
