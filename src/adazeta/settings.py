"""A run's settings: the composed Hydra config parsed into typed, validated dataclasses.

``parse`` turns the config into :class:`Settings` and raises a one-line ConfigError on any bad value, before
anything is loaded (``adazeta.build.compose_settings`` does the same from ``adazeta-run`` overrides, for the tools).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

import adazeta.adapters  # noqa: F401  (registers the built-in adapters)
import adazeta.optim  # noqa: F401  (registers the built-in optimizers)
from adazeta.adapters import ADAPTERS
from adazeta.scoring.calibration import CALIBRATIONS
from adazeta.distributed import DistributedConfig
from adazeta.errors import ConfigError
from adazeta.tasks.demonstrations import DemonstrationConfig
from adazeta.models import ModelConfig, complete_config
from adazeta.optim import OPTIMIZERS
from adazeta.probe import ProbeConfig
from adazeta.registry import check_type, make_config, show
from adazeta.schedules import SCHEDULES
from adazeta.tasks.loaders import DataConfig
from adazeta.tasks.spec import BoundTask, TaskSpec
from adazeta.guards import GuardConfig
from adazeta.tracking import DivergenceConfig, WandbConfig
from adazeta.train import TrainConfig


@dataclass
class Component:
    """A registered piece chosen by name, with its typed config."""

    kind: str
    config: Any


@dataclass
class Settings:
    """The whole run, typed and validated."""

    seed: int
    dry_run: bool
    force: bool  # rerun even when the run directory already holds a finished result
    verbose: bool  # third-party progress bars and logs too
    method: str
    model: ModelConfig
    task: TaskSpec
    adapter: Component
    optimizer: Component | None
    schedule: Component
    train: TrainConfig
    data: DataConfig
    divergence: DivergenceConfig
    wandb: WandbConfig
    experiment: str | None
    raw: dict[str, Any]  # the composed config, for provenance
    demonstrations: DemonstrationConfig | None = None  # ICL: solved train examples before each prompt
    probe: ProbeConfig | None = None  # LP: a logistic regression on frozen features instead of training
    calibration: str = "none"  # training-free scoring: none | contextual | prior (adazeta.scoring.calibration)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)  # several processes
    guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)  # numerical guards (adazeta.guards)

    def bound_task(self) -> BoundTask:
        """The task as the run's model family sees it (``TaskSpec.for_family``): what the checks before loading
        read. It refuses a task without the family's prompt format; ``build`` adds the tokenizer's mask token."""
        return self.task.for_family(self.model.family)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _component(registry: Any, node: dict[str, Any] | None, where: str) -> Component | None:
    if node is None:
        return None
    values = dict(node)
    kind = values.pop("kind", None)
    if kind is None:
        raise ConfigError(f"{where} needs a `kind` (one of {', '.join(registry.names())})")
    entry = registry.get(kind)
    return Component(kind, make_config(entry.config_cls, values, where=f"{where} {kind!r}"))


def _learning_rate(optimizer: Component | None) -> Component | None:
    """Every optimizer's ``lr`` is > 0: at 0 no weight ever moves, and the run would only stall at its end."""
    lr = optimizer.config.lr if optimizer is not None else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr <= 0:
        raise ConfigError(f"method.optimizer.lr={lr!r} must be > 0: a learning rate of {lr!r} never moves a weight; "
                          "set a positive rate (method.optimizer.lr=1e-4), or evaluate without training with "
                          "method=zero_shot")
    return optimizer


# The blocks every composed config holds (conf/config.yaml and its groups); a missing one is a config's mistake.
REQUIRED = ("seed", "model", "task", "schedule", "method", "train", "data", "divergence", "wandb")


def _required(raw: dict[str, Any]) -> None:
    for key in REQUIRED:
        if key not in raw:
            raise ConfigError(f"the config has no {key!r}: every run needs it (was it deleted with ~{key}, or left "
                              "out of a primary config given with --config-name?)")
    for key in ("method", "schedule"):
        if not isinstance(raw[key], dict) or "name" not in raw[key]:
            raise ConfigError(f"{key}={show(raw[key])} must be a {key} option with a name; choose one with {key}=NAME")


def parse_once(cfg: DictConfig, prechecked: Settings | None) -> Settings:
    """The run's settings: ``prechecked`` (the command's pre-check parsed them, ``adazeta.overrides.check``) when
    its config is this one, value for value; else ``cfg`` parsed now (a caller without a pre-check, a config adopted
    from a saved run, a resolver whose value moved between the two compositions)."""
    if prechecked is not None and prechecked.raw == _plain(cfg):
        return prechecked
    return parse(cfg)


def parse(cfg: DictConfig) -> Settings:
    """Hydra config -> typed settings. Raises ConfigError with a one-line message on any bad value."""
    raw = _plain(cfg)
    _required(raw)
    seed = raw.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        # numpy's global seed is 32 bits; every other generator derives from this one.
        raise ConfigError(f"seed={show(seed)} must be an integer in [0, 2**32 - 1]")
    for key, hint in (("dry_run", bool), ("force", bool), ("verbose", bool), ("experiment_name", str | None)):
        check_type(raw.get(key), hint, key)
    method = raw["method"]
    schedule = dict(raw["schedule"])
    schedule_name = schedule.pop("name")
    settings = Settings(
        seed=seed,
        dry_run=raw.get("dry_run", False),
        force=raw.get("force", False),
        verbose=raw.get("verbose", False),
        method=method["name"],
        model=make_config(ModelConfig, raw["model"], where="model"),
        task=make_config(TaskSpec, raw["task"], where="task"),
        adapter=_component(ADAPTERS, method.get("adapter") or {"kind": "none"}, "method.adapter"),
        optimizer=_learning_rate(_component(OPTIMIZERS, method.get("optimizer"), "method.optimizer")),
        schedule=Component(schedule_name, SCHEDULES.config(schedule_name, schedule)),
        train=make_config(TrainConfig, raw["train"], where="train"),
        data=make_config(DataConfig, raw["data"], where="data"),
        divergence=make_config(DivergenceConfig, raw["divergence"], where="divergence"),
        wandb=make_config(WandbConfig, raw["wandb"], where="wandb"),
        experiment=raw.get("experiment_name"),
        raw=raw,
        distributed=make_config(DistributedConfig, raw.get("distributed") or {}, where="distributed"),
        guard=make_config(GuardConfig, raw.get("guard") or {}, where="guard"),
    )
    settings.model = complete_config(settings.model)  # a model given by hub_id or path: its own config's sizes
    shapes = settings.model.tt_shapes
    adapter = settings.adapter.config
    table = (settings.model.placements or {}).get(settings.model.architecture["model_type"])
    if table and adapter.takes_sites and adapter.targets is None:
        # The reference sites for this model type (conf/model/*.yaml) unless the method names its own; without
        # an entry the adapter finds the MLP's projections from the module structure (adapters/sites.py).
        settings.adapter.config = adapter = dataclasses.replace(adapter, targets=table[adapter.placement])
    if adapter.takes_model_shapes and shapes and adapter.shape_down is None and adapter.shape_up is None:
        # The model's reference shapes (e.g. [8,8,16,8,8] for RoBERTa-Large) unless the method names its own.
        settings.adapter.config = dataclasses.replace(adapter, shape_down=shapes["down"], shape_up=shapes["up"])
    unknown = sorted(set(method) - {"name", "adapter", "optimizer", "description", "demonstrations", "probe",
                                    "calibration"})
    if unknown:
        raise ConfigError(f"method {method['name']!r}: unknown key(s) {', '.join(unknown)}")
    if method.get("demonstrations") is not None:
        settings.demonstrations = make_config(
            DemonstrationConfig, method["demonstrations"], where="method.demonstrations"
        )
    if method.get("probe") is not None:
        settings.probe = make_config(ProbeConfig, method["probe"], where="method.probe")
    for key in ("demonstrations", "probe"):
        if getattr(settings, key) is not None and settings.optimizer is not None:
            raise ConfigError(f"method {method['name']!r}: method.{key} is training-free; set method.optimizer=null")
    if settings.demonstrations is not None and settings.probe is not None:
        raise ConfigError(f"method {method['name']!r}: choose method.demonstrations or method.probe, not both")
    calibration = method.get("calibration") or "none"
    if calibration not in CALIBRATIONS:
        raise ConfigError(f"method.calibration={show(calibration)} is not one of {', '.join(CALIBRATIONS)}")
    if calibration != "none":
        if settings.optimizer is not None or settings.probe is not None:
            raise ConfigError(f"method.calibration={calibration} calibrates a training-free prompt (zero_shot, icl); "
                              f"method {method['name']!r} trains or probes: set method.calibration=none")
        if settings.task.objective != "classification":
            raise ConfigError(f"method.calibration={calibration} needs a classification task; task "
                              f"{settings.task.name!r} is scored by its {settings.task.objective} objective")
    if calibration == "contextual" and settings.demonstrations is not None and \
            settings.demonstrations.protocol == "per_example":
        raise ConfigError("method.calibration=contextual needs one set of demonstrations for every prompt; with "
                          "method.demonstrations.protocol=per_example use calibration=prior or none")
    settings.calibration = calibration
    if settings.probe is not None and settings.task.objective == "generation":
        raise ConfigError(
            f"method {method['name']!r}: a linear probe classifies; task {settings.task.name!r} generates text"
        )
    return settings


def unused_keys(s: Settings) -> dict[str, str]:
    """Keys that this run's other settings leave unused, each with the reason and the way to use it.

    A command line that sets one of them is refused (``adazeta.overrides``): the value would be silently ignored.
    A key's prefix covers its children (``schedule`` covers ``schedule.q``).
    """
    unused: dict[str, str] = {}
    zo = s.optimizer is not None and s.optimizer.config.zeroth_order
    first_order = s.optimizer is not None and not zo
    if s.train.eval_every_forwards is not None:
        unused["train.eval_every"] = (
            f"train.eval_every_forwards={s.train.eval_every_forwards} evaluates dev by forward passes instead; "
            "set train.eval_every_forwards=null to evaluate every train.eval_every steps"
        )
    if not zo:
        unused["schedule"] = (f"method {s.method!r} makes no zeroth-order queries, so no query schedule applies; "
                              "leave the schedule out, or choose a ZO method")
    if not first_order and s.train.grad_accum > 1:
        unused["train.grad_accum"] = (f"method {s.method!r} takes no backward pass, and train.grad_accum splits a "
                                      "first-order step into micro-batches; leave it at 1")
    if not first_order and s.train.gradient_checkpointing:
        unused["train.gradient_checkpointing"] = (f"method {s.method!r} takes no backward pass, so it keeps no "
                                                  "activations for checkpointing to recompute; leave it false")
    if s.divergence.rule == "none":
        for key in ("factor", "patience"):
            unused[f"divergence.{key}"] = ("divergence.rule=none has no dev-loss rule; set divergence.rule=best (or "
                                           "initial) to use it")
    if not s.divergence.collapse:
        unused["divergence.collapse_fraction"] = "divergence.collapse=false; set divergence.collapse=true to use it"
    if s.divergence.independent == "off":
        for key in ("answer_share", "gap_ratio", "min_examples"):
            unused[f"divergence.independent_{key}"] = ("divergence.independent=off; set divergence.independent=warn "
                                                       "(or stop) to use it")
    return unused
