"""Parameter-efficient modules and the registry that attaches them to a model.

A builder registered in ``ADAPTERS`` takes ``(model, cfg)``, changes the model in place (or wraps it, as peft
does) and returns the model to train. Afterwards exactly the parameters the method trains have
``requires_grad=True``; everything else is frozen.
"""

from typing import TYPE_CHECKING, ClassVar

from adazeta.registry import ADAPTERS  # noqa: F401  (the package's registry: adazeta.adapters.ADAPTERS)

if TYPE_CHECKING:
    from torch import nn


class AdapterCapabilities:
    """What the wiring may ask of an adapter, declared on its config class (the one contract; never its kind).

    ``trains``: the method trains some parameters (False: a training-free method); ``trains_backbone``: the model's
    own weights are the trainable set (full fine-tuning, MeZO), so they keep the backbone's dtype and a batched-query
    forward cannot give each replica its own copy; ``replicable``: the adapter runs weight replicas in one forward
    (batched queries); ``takes_model_shapes``: the model YAML's reference TT shapes apply to it (its config has
    ``shape_down`` and ``shape_up``); ``takes_sites``: it is placed on sites, so the model YAML's placement table
    applies to it when its own ``targets`` are None (its config has ``targets`` and ``placement``).
    The dry run counts through two declarations: ``count_trainable(backbone)``, the parameters it trains, from
    the bare backbone's shapes alone (the meta device's model will do), and ``count_modules(model)``, the adapter
    modules it added to the model it was attached to.
    """

    trains: ClassVar[bool] = True
    trains_backbone: ClassVar[bool] = False
    replicable: ClassVar[bool] = True
    takes_model_shapes: ClassVar[bool] = False
    takes_sites: ClassVar[bool] = False

    def check_hidden(self, hidden_size: int) -> None:
        """Raise ConfigError when the config cannot fit a model of ``hidden_size`` (checked from the model YAML,
        before any model loads); the default has nothing to check."""

    def count_trainable(self, backbone: "nn.Module") -> int:
        """Parameters that train once this adapter is attached to ``backbone`` (not yet attached; tied weights
        once), from its shapes alone: nothing is drawn or allocated. The default serves a set that trains nothing;
        an adapter that trains declares its own count."""
        if self.trains:
            raise NotImplementedError(f"{type(self).__name__} trains parameters: declare count_trainable on it")
        return 0

    def count_modules(self, model: "nn.Module") -> int:
        """Adapter modules this adapter added to ``model`` (attached): none by default (a set of the model's own
        weights)."""
        return 0

    def check_ready(self) -> None:
        """Raise ConfigError when a run cannot use this config as it stands (checked before any model loads; a
        config may be valid as a group option and still need a value a run supplies, as a saved adapter's source)."""

# Importing every module of this package registers the built-in adapters: a new adapter is one new file here.
import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
