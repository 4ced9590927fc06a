"""Adapters a run saved, loaded onto the model to evaluate them (``method=eval eval.from=<run dir>``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

from omegaconf import DictConfig, OmegaConf
from torch import nn

from adazeta.adapters import ADAPTERS, AdapterCapabilities
from adazeta.errors import ConfigError

log = logging.getLogger("adazeta")

# What ``method=eval`` takes from the run that saved the adapters unless the command line sets it: what was
# evaluated there (task, data selection, seed) and on what (the model), so that it scores the same examples.
ADOPTED = ("task", "model", "seed", "data.num_train", "data.num_dev", "data.num_eval", "data.seed", "data.k",
           "data.kshot_seed")
# Where this machine reads and runs the model: never taken from the saved run.
LOCAL_KEYS = ("model.model_dir", "model.device", "model.device_map")


def saved_folder(source: str) -> Path:
    """The folder of saved adapters ``source`` names: an ``adapter/`` folder itself, or the run directory that holds
    one."""
    from adazeta.runs.saving import ADAPTER_CONFIG

    path = Path(source).expanduser()
    for folder in (path, path / "adapter"):
        if (folder / ADAPTER_CONFIG).is_file() or (folder / "adapter_config.json").is_file():
            return folder
    if not path.exists():
        raise ConfigError(f"eval.from={source}: no such folder; point it at a run directory or its adapter/ folder")
    unfinished = _unfinished(path)
    if unfinished:
        raise ConfigError(f"eval.from={source} holds no saved adapters: {unfinished}")
    raise ConfigError(f"eval.from={source} holds no saved adapters (neither it nor {path / 'adapter'} has "
                      f"{ADAPTER_CONFIG} or peft's adapter_config.json); the run may have had train.save=none, or "
                      "trained the whole model (train.save_model=true writes model/: use it as model.path)")


def _unfinished(run_dir: Path) -> str | None:
    """Why a run directory without adapters has none because it did not end (interrupted, failed, still running),
    and how to finish it; None for a run that ended, or a folder that holds no run."""
    from adazeta.runs.record import read_record, resume_hint
    from adazeta.runs.rundir import holder

    who = holder(run_dir)
    if who is not None:
        return f"its run is still going ({who}); evaluate it once it has finished"
    try:
        record = read_record(run_dir)
    except ConfigError:
        record = None
    status = (record or {}).get("status")
    if status in ("interrupted", "failed"):
        return (f"its run was {status} before it saved them ({record.get('reason') or 'no reason recorded'}); "
                f"{resume_hint(record)} (its .hydra/overrides.yaml), then evaluate it")
    if record is None and (run_dir / "checkpoint.pt").is_file():
        return ("its run was stopped before it saved them (a checkpoint and no record: it was killed); run the same "
                "command again (its .hydra/overrides.yaml) to resume it, then evaluate it")
    return None


@dataclass
class SavedConfig(AdapterCapabilities):
    """The adapters saved in ``source`` (a run directory or its ``adapter/`` folder); nothing trains."""

    trains: ClassVar[bool] = False
    replicable: ClassVar[bool] = False

    source: str | None = None

    def check_ready(self) -> None:
        if not self.source:
            raise ConfigError("method=eval needs eval.from=<run directory or its adapter/ folder>")
        from adazeta.runs.saving import check_saved

        check_saved(saved_folder(self.source))  # checked before any model loads: there, and whole

    def count_modules(self, model: nn.Module) -> int:
        """The adapter modules of the kind saved in ``source`` (peft's folder: LoRA), as that kind counts them."""
        from adazeta.runs.saving import ADAPTER_CONFIG

        folder = saved_folder(str(self.source))
        kind = "lora" if (folder / "adapter_config.json").is_file() else \
            json.loads((folder / ADAPTER_CONFIG).read_text())["kind"]
        return ADAPTERS.get(kind).config_cls().count_modules(model)


@ADAPTERS.register("saved", SavedConfig)
def load_saved(model: nn.Module, cfg: SavedConfig) -> nn.Module:
    from adazeta.runs.saving import load_adapters

    cfg.check_ready()

    model = load_adapters(model, saved_folder(cfg.source))
    model.requires_grad_(False)
    return model


def saved_run_config(source: str) -> tuple[Path, dict[str, Any]] | None:
    """(run directory, its composed config) of the run that saved the adapters ``source`` names: its result.json's
    ``config``, else its ``.hydra/config.yaml``; None for an adapter folder copied without its run."""
    folder = saved_folder(source)
    for run_dir in (folder, folder.parent):
        record, provenance = run_dir / "result.json", run_dir / ".hydra" / "config.yaml"
        try:
            if record.is_file():
                config = json.loads(record.read_text()).get("config")
            elif provenance.is_file():
                config = OmegaConf.to_container(OmegaConf.load(provenance))
            else:
                continue
        except (OSError, ValueError) as err:
            raise ConfigError(f"eval.from={source}: cannot read the run's config in {run_dir} ({err}); repair it, or "
                              "point eval.from at the adapter/ folder alone and give task, data and model") from None
        if isinstance(config, dict):
            return run_dir, config
    return None


def _set_on_command_line(key: str, overrides: Sequence[str]) -> list[str]:
    """The command-line overrides that set ``key`` or a key below it."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    return [k for k in keys if k == key or k.startswith(key + ".")]


def adopt_saved_run(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``method=eval``: the config with the task, data selection, seed and model of the run that saved the adapters
    (``ADOPTED``), except what the command line sets; says in the log what it evaluates and where each came from.

    A group chosen on the command line (``task=rte``) is taken whole from the command; a key below it
    (``model.dtype=bf16``) is set on the saved run's choice."""
    source = OmegaConf.select(cfg, "eval.from")
    if OmegaConf.select(cfg, "method.name") != "eval" or not source:
        return cfg
    found = saved_run_config(str(source))
    if found is None:
        log.warning("eval.from=%s: no run config beside the adapters (result.json or .hydra/config.yaml): task, data "
                    "and model are the command's", source)
        return cfg
    run_dir, saved = found
    cfg = cfg.copy()
    taken, kept, absent, recorded = [], [], object(), OmegaConf.create(saved)
    for key in ADOPTED:
        mine = _set_on_command_line(key, overrides)
        value = OmegaConf.select(recorded, key, default=absent)
        if key in mine or value is absent:
            kept.append(key)
            continue
        below = {k: OmegaConf.select(cfg, k) for k in mine + [k for k in LOCAL_KEYS if k.startswith(key + ".")]}
        OmegaConf.update(cfg, key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value,
                         merge=False, force_add=True)
        for k, v in below.items():  # the command's keys below the saved choice, and this machine's paths
            OmegaConf.update(cfg, k, v, merge=False, force_add=True)
        taken.append(key)
    data = cfg.data
    log.info("method=eval: scoring the adapters of %s (%s on %s, seed %s) on task %s with model %s, seed %s, "
             "data.num_train=%s, num_dev=%s, num_eval=%s, data.seed=%s; from that run: %s; from the command: %s",
             run_dir, (saved.get("method") or {}).get("name"), (saved.get("task") or {}).get("name"),
             saved.get("seed"), cfg.task.name, cfg.model.name, cfg.seed, data.num_train, data.num_dev,
             data.num_eval, data.seed, ", ".join(taken) or "nothing", ", ".join(kept) or "nothing")
    return cfg
