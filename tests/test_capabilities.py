"""The capability contract: adapters and optimizers declare what the wiring may ask of them on their config
classes, and the built optimizer agrees with its config."""

from __future__ import annotations

import pytest


def test_capabilities_are_declared_on_every_registered_config_and_agree_with_the_built_optimizer():
    """The wiring asks configs, never classes or kind names (run, preflight, run length, dry run)."""
    import torch

    from adazeta.adapters import ADAPTERS, AdapterCapabilities
    from adazeta.errors import ConfigError
    from adazeta.optim import OPTIMIZERS, OptimizerCapabilities, check_contract

    for name in ADAPTERS.names():
        assert issubclass(ADAPTERS.get(name).config_cls, AdapterCapabilities), name
    for name in OPTIMIZERS.names():
        cfg = OPTIMIZERS.get(name).config_cls()
        assert isinstance(cfg, OptimizerCapabilities), name
        built = OPTIMIZERS.get(name).builder([("w", torch.nn.Parameter(torch.zeros(3)))], cfg, 0)
        assert check_contract(name, built, cfg) is built and built.zeroth_order == cfg.zeroth_order
    # what each declares, from the methods' own definitions
    assert ADAPTERS.get("full").config_cls.trains_backbone and not ADAPTERS.get("full").config_cls.replicable
    assert not ADAPTERS.get("none").config_cls.trains and ADAPTERS.get("tt").config_cls.takes_model_shapes
    assert OPTIMIZERS.get("adamw").config_cls().state_bytes(10, 4) == 80  # two moments of 10 fp32 entries
    assert OPTIMIZERS.get("sparse_zo_sgd").config_cls().state_bytes(64, 4) == 8  # one bit an entry (magnitude mask)
    assert OPTIMIZERS.get("zo_sgd").config_cls(estimator="one_sided").forwards_per_query == 1

    class Liar:
        zeroth_order = True

    with pytest.raises(ConfigError, match="declares zeroth_order=False but the built Liar says True"):
        check_contract("adamw", Liar(), OPTIMIZERS.get("adamw").config_cls())
