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


def test_every_capability_the_wiring_reads_is_declared_with_its_default_on_the_base_classes():
    """The wiring calls a config's capability directly (adazeta.build, adazeta.settings): each base class declares
    it with a default, and each registered config that overrides it holds the fields the capability promises."""
    import dataclasses

    from adazeta.adapters import ADAPTERS, AdapterCapabilities
    from adazeta.optim import OPTIMIZERS, OptimizerCapabilities
    from adazeta.schedules import SCHEDULES, ScheduleConfig

    AdapterCapabilities().check_hidden(4096)  # the default has nothing to check
    assert not AdapterCapabilities.takes_sites and not ScheduleConfig.uses_run_epochs
    for name in ADAPTERS.names():
        cls = ADAPTERS.get(name).config_cls
        fields = {f.name for f in dataclasses.fields(cls)}
        if cls.takes_sites:
            assert {"targets", "placement"} <= fields, name
        if cls.takes_model_shapes:
            assert {"shape_down", "shape_up"} <= fields, name
    assert ADAPTERS.get("tt").config_cls.takes_sites and not ADAPTERS.get("lora").config_cls.takes_sites
    for name in OPTIMIZERS.names():
        cfg = OPTIMIZERS.get(name).config_cls()
        assert "lr" in {f.name for f in dataclasses.fields(cfg)}, name
        assert isinstance(cfg.derivative_free, bool) and (cfg.derivative_free <= cfg.zeroth_order), name
    assert not OptimizerCapabilities().derivative_free  # first-order by default
    assert OPTIMIZERS.get("zo_sgd").config_cls().derivative_free
    assert not OPTIMIZERS.get("forward_grad").config_cls().derivative_free  # a jvp differentiates the loss
    for name in SCHEDULES.names():
        cfg = SCHEDULES.get(name).config_cls()
        assert isinstance(cfg, ScheduleConfig) and cfg.max_queries >= 1, name
    assert [n for n in SCHEDULES.names() if SCHEDULES.get(n).config_cls.uses_run_epochs] == ["adaptive_official"]
