"""The Hydra config tree: every option of every group composes and parses into valid typed settings."""

from __future__ import annotations

import pytest

from adazeta.errors import ConfigError
from adazeta.settings import parse
from helpers import CONF, compose_cfg

GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in ("model", "task", "method", "schedule")}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_parses(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if (group, option) == ("model", "hf"):  # the generic model config needs a model: a folder with its config.json
        from transformers import LlamaConfig

        LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2).save_pretrained(tmp_path)
        overrides.append(f"model.path={tmp_path}")
    settings = parse(compose_cfg(overrides))
    assert getattr(settings, group if group != "schedule" else "schedule") is not None
    if group == "method":
        assert settings.method == option
    if group == "schedule":
        assert settings.schedule.kind == option


def test_method_brings_its_default_schedule_and_the_command_line_wins():
    assert parse(compose_cfg(["method=adazeta"])).schedule.kind == "adaptive"
    assert parse(compose_cfg(["method=mezo"])).schedule.kind == "constant"
    assert parse(compose_cfg(["method=mezo_lora"])).schedule.config.q == 1
    assert parse(compose_cfg(["method=adazeta", "schedule=constant"])).schedule.kind == "constant"
    assert parse(compose_cfg(["method=mezo_lora", "schedule=adaptive"])).schedule.kind == "adaptive"


def test_method_defaults_follow_the_spec():
    s = parse(compose_cfg(["method=adazeta"]))
    assert (s.adapter.kind, s.adapter.config.bottleneck, s.adapter.config.rank) == ("tt", 64, 5)
    assert (s.optimizer.kind, s.optimizer.config.lr, s.optimizer.config.eps) == ("zo_sgd", 1e-4, 1e-3)
    assert parse(compose_cfg(["method=mezo"])).optimizer.config.lr == 5e-7
    assert parse(compose_cfg(["method=ft"])).optimizer.kind == "adamw"
    assert s.train.batch_size == 16


def test_model_reference_shapes_fill_the_tt_adapter():
    s = parse(compose_cfg(["model=roberta-large", "method=adazeta"]))
    assert s.adapter.config.shape_down == [8, 8, 16, 8, 8]


@pytest.mark.parametrize(
    "override,field",
    [
        ("method.optimizer.eps=0", "optimizer.eps"),
        ("schedule.q_max=0", "schedule.q_max"),
        ("train.batch_size=0", "train.batch_size"),
        ("data.num_train=0", "data.num_train"),
        ("model.dtype=fp8", "model.dtype"),
        ("divergence.patience=0", "divergence.patience"),
        ("wandb.mode=sometimes", "wandb.mode"),
    ],
)
def test_bad_values_name_the_field(override, field):
    overrides = [override] + (["method=adazeta"] if "q_max" in override else [])
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse(compose_cfg(overrides))


def test_unknown_method_key_is_rejected():
    with pytest.raises(ConfigError, match="unknown key"):
        parse(compose_cfg(["+method.optimizer.momentum=0.9"]))


@pytest.mark.parametrize("group,path", [(g, p) for g in ("optimizer", "adapter")
                                        for p in sorted((CONF / g).glob("*.yaml"))], ids=lambda x: getattr(x, "stem", x))
def test_every_option_lists_every_key_of_its_config_with_its_default(group, path):
    """CONTRIBUTING: an adapter or optimizer option lists every key of its dataclass, with the dataclass's default,
    so that each key is overridden without ``+`` (``method.optimizer.batched_queries=true`` on any ZO optimizer)
    and recorded with the run; a key with no field would be refused at start-up."""
    import dataclasses

    from omegaconf import OmegaConf

    import adazeta.adapters  # noqa: F401 (registers)
    import adazeta.optim  # noqa: F401 (registers)
    from adazeta.registry import ADAPTERS, OPTIMIZERS

    method = {"optimizer": "ft" if path.stem == "adamw" else "mezo", "adapter": "adazeta"}[group]
    cfg = compose_cfg([f"method={method}", f"{group}@method.{group}={path.stem}"])
    composed = OmegaConf.to_container(cfg.method[group])
    if composed.get("kind") in (None, "none", "saved"):  # no adapter, or one read from a saved run
        return
    registry = OPTIMIZERS if group == "optimizer" else ADAPTERS
    fields = {f.name: f for f in dataclasses.fields(registry.get(composed["kind"]).config_cls)}
    assert set(composed) - {"kind"} == set(fields), (sorted(set(fields) - set(composed)),
                                                     sorted(set(composed) - set(fields) - {"kind"}))
    instance = registry.get(composed["kind"]).config_cls()
    defaults = {name: getattr(instance, name) for name in fields}
    listed = {k: tuple(v) if isinstance(v, list) and isinstance(defaults[k], tuple) else v
              for k, v in composed.items() if k != "kind"}
    # A value other than the dataclass's is chosen in the option's own file (zo_sign's lr) or by the method.
    method_sets = OmegaConf.to_container(OmegaConf.load(CONF / "method" / f"{method}.yaml")).get(group) or {}
    differing = {k: (v, defaults[k]) for k, v in listed.items() if v != defaults[k] and k not in method_sets}
    assert all(k in OmegaConf.to_container(OmegaConf.load(path)) for k in differing), differing
