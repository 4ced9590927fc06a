"""An experiment's one schema: its arms, the grid every arm runs over, its seeds and where each arm's lr is chosen.

``conf/experiment/NAME.yaml`` declares, besides the settings it fixes::

    arms:                                   # arm -> what it runs
      mezo_lora:
        overrides: [method=mezo_lora]       # adazeta-run overrides: the method, and whatever else the arm changes
        lr: [1.0e-3, 1.0e-4]                # its learning-rate grid, chosen on dev at the selection seed
                                            # (absent: one run at the lr the config composes to)
        seeds: [0]                          # absent: every design seed (give it for an arm the seed does not change)
        first_order: true                   # left out of the stress phase
        only: {task: [sst2, copa]}          # the grid points it runs at (absent: every point)
        budgeted: true                      # its forward-pass budget comes from design.budget (ZO arms)
    design:
      grid: {task: [sst2, rte]}             # axes every arm runs over (absent: the config's task, one point)
      seeds: [0, 1, 2]                      # absent: the config's seed
      select_seed: 0                        # the seed whose runs choose each arm's lr (absent: the first seed)
      stress: [2, 4]                        # lr multipliers of the stress phase
      order: [mezo_lora, ...]               # run order (arms not named run after)
      arms: [adazeta]                       # the arms that run (absent: all): an experiment that inherits
                                            # another narrows its arms here
      select_at: {task: [sst2, wic]}        # lr grids run at these points only; each arm's lr is chosen on its
                                            # mean dev accuracy over them and carried to every other point
                                            # (absent: a grid and a choice at every point)
      budget:                               # a forward budget per point, by a declared rule on pilot runs
        axis: task                          # (``Budget``; its B goes to every budgeted arm at that point)
        pilots: {rte: "pilot/mezo_lora/task=rte,lr=0.001,seed=*"}   # run folders under results/runs
        share: 0.9                          # B = the first evaluation where the best dev loss so far has made
        floor: 400                          # this share of the pilot's whole drop, rounded up to `round_to`,
        cap: 1000                           # within [floor, cap]; a pilot that did not move (its lowest dev
        min_drop: 0.01                      # loss not min_drop below its first) or diverged: cap
        round_to: 200
        evals: 5                            # dev evaluations a budgeted run makes (every B / evals forwards)

Two readers, one schema. ``python -m adazeta.tools.experiment NAME`` plans every run from it (each arm's lr grid on
dev, then seeds, then stress). ``adazeta-run -m experiment=NAME`` sweeps the arms over the grid and seeds at the
settings the config composes to, through any Hydra launcher: the experiment's ``hydra.sweeper.params`` is
``${experiment_sweep:}``, which this module resolves from ``arms`` and ``design`` (method innermost, so that an
interrupted sweep has every method at each point it reached). An arm that changes more than its method has no
such sweep; its experiment runs through the driver only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from adazeta.errors import ConfigError
from adazeta.runs.record import ENDED


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    lrs: tuple[float | None, ...] = (None,)  # (None,): one run at the composed lr (or an arm that trains nothing)
    seeds: tuple[int, ...] | None = None  # None: every design seed
    first_order: bool = False
    only: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # {axis: values}: the points it runs at
    budgeted: bool = False  # its forward budget at a point comes from the design's Budget

    def runs_at(self, seed: int) -> bool:
        return self.seeds is None or seed in self.seeds

    def runs_at_point(self, point: dict[str, Any]) -> bool:
        return all(str(point.get(axis)) in {str(v) for v in values} for axis, values in self.only.items())

    @property
    def method(self) -> str | None:
        """The method, when the arm's overrides are that alone (what a Hydra sweep over methods can express)."""
        if len(self.overrides) == 1 and self.overrides[0].startswith("method="):
            return self.overrides[0].split("=", 1)[1]
        return None


@dataclass(frozen=True)
class Budget:
    """A forward-pass budget per grid point, fixed by a declared rule on committed pilot runs (never chosen by
    hand after seeing them): ``budget_at`` applies it."""

    axis: str
    pilots: dict[str, str]  # axis value -> run folders under results/runs (a glob: several seeds are averaged)
    share: float = 0.9
    floor: int = 400
    cap: int = 1000
    min_drop: float = 0.01
    round_to: int = 200
    evals: int = 5


@dataclass(frozen=True)
class Design:
    arms: dict[str, Arm]  # the arms that run, as declared
    order: tuple[str, ...] = ()  # the same arms in run order
    grid: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    seeds: tuple[int, ...] = (0,)  # declared, else the config's seed
    select_seed: int = 0  # declared, else the first seed
    seeds_declared: bool = False  # a Hydra sweep sweeps the seed only when the design names its seeds
    stress: tuple[float, ...] = ()
    select_at: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # empty: every point selects its own lr
    budget: Budget | None = None

    def selects_at(self, point: dict[str, Any]) -> bool:
        """Whether lr grids run at this point (every point, unless ``select_at`` names some)."""
        return all(str(point.get(axis)) in {str(v) for v in values} for axis, values in self.select_at.items())

    def points(self) -> list[dict[str, Any]]:
        """Every point of the grid (``{}`` alone without one), the first axis outermost."""
        out: list[dict[str, Any]] = [{}]
        for key, values in self.grid.items():
            out = [{**p, key: v} for p in out for v in values]
        return out


KEYS = {"arms", "grid", "seeds", "select_seed", "stress", "order", "select_at", "budget"}
ARM_KEYS = {"overrides", "lr", "seeds", "first_order", "only", "budgeted"}
BUDGET_KEYS = {"axis", "pilots", "share", "floor", "cap", "min_drop", "round_to", "evals"}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _numbers(value: Any, where: str, kind: type) -> tuple:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be a non-empty list, not {value!r}")
    try:
        return tuple(kind(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must list {kind.__name__}s, not {value!r}") from None


def _arm(name: str, spec: Any, where: str) -> Arm:
    where = f"{where}.{name}"
    if not isinstance(spec, dict) or not isinstance(spec.get("overrides"), list):
        raise ConfigError(f"{where} needs `overrides:`, a list of adazeta-run overrides (e.g. [method=mezo])")
    unknown = sorted(set(spec) - ARM_KEYS)
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}; an arm has {', '.join(sorted(ARM_KEYS))}")
    lrs = _numbers(spec["lr"], f"{where}.lr", float) if spec.get("lr") is not None else (None,)
    seeds = _numbers(spec["seeds"], f"{where}.seeds", int) if spec.get("seeds") is not None else None
    only = _axes(spec.get("only"), f"{where}.only")
    return Arm(name, tuple(str(o) for o in spec["overrides"]), lrs, seeds, bool(spec.get("first_order", False)),
               only, bool(spec.get("budgeted", False)))


def _axes(spec: Any, where: str) -> dict[str, tuple[Any, ...]]:
    """``{axis: [values]}`` (absent: {}), one-line errors."""
    if spec is None:
        return {}
    if not isinstance(spec, dict) or not all(isinstance(v, list) and v for v in spec.values()):
        raise ConfigError(f"{where} must map a grid axis to a non-empty list of its values, e.g. {{task: [sst2]}}")
    return {str(k): tuple(v) for k, v in spec.items()}


def _budget(spec: Any, where: str, grid: dict[str, Any]) -> Budget | None:
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("pilots"), dict) or not spec["pilots"]:
        raise ConfigError(f"{where}.budget needs `pilots:`, a map of {spec.get('axis', 'task') if isinstance(spec, dict) else 'task'} "
                          "value -> pilot run folders under results/runs")
    unknown = sorted(set(spec) - BUDGET_KEYS)
    if unknown:
        raise ConfigError(f"{where}.budget has unknown key(s) {', '.join(unknown)}; it has {', '.join(sorted(BUDGET_KEYS))}")
    budget = Budget(axis=str(spec.get("axis", "task")), pilots={str(k): str(v) for k, v in spec["pilots"].items()},
                    **{k: type(getattr(Budget, k))(spec[k]) for k in BUDGET_KEYS - {"axis", "pilots"} if k in spec})
    if budget.axis not in grid:
        raise ConfigError(f"{where}.budget.axis is {budget.axis!r}, which design.grid does not have")
    if not 0 < budget.share <= 1 or not 0 < budget.floor <= budget.cap or budget.round_to < 1 or budget.evals < 1:
        raise ConfigError(f"{where}.budget needs 0 < share <= 1, 0 < floor <= cap, round_to >= 1 and evals >= 1")
    return budget


def design_of(cfg: DictConfig | dict, name: str = "the experiment") -> Design | None:
    """The experiment's design from its config, composed or a plain dict (None when it declares no ``arms``);
    one-line errors."""
    arms_spec, design = _plain(cfg.get("arms")), _plain(cfg.get("design")) or {}
    if not arms_spec:
        return None
    where = f"experiment {name}"
    if not isinstance(arms_spec, dict) or not isinstance(design, dict):
        raise ConfigError(f"{where}: `arms:` and `design:` must be mappings")
    unknown = sorted(set(design) - KEYS)
    if unknown:
        raise ConfigError(f"{where}: design has unknown key(s) {', '.join(unknown)}; it has {', '.join(sorted(KEYS))}")
    arms = {a: _arm(a, s, "arms") for a, s in arms_spec.items()}
    chosen = [str(a) for a in design.get("arms") or arms]
    missing = sorted(set(chosen) - set(arms))
    if missing:
        raise ConfigError(f"{where}: design.arms names {', '.join(missing)}, which arms does not declare")
    order = [a for a in design.get("order") or [] if a in chosen]
    order += [a for a in chosen if a not in order]
    grid = design.get("grid") or {}
    if not isinstance(grid, dict):
        raise ConfigError(f"{where}: design.grid must map an override key to its values, e.g. {{task: [sst2, rte]}}")
    declared = design.get("seeds") is not None
    # the config's seed (a config still being merged may not have it yet: only a declared seed is swept then)
    seeds = _numbers(design["seeds"], "design.seeds", int) if declared else (int(cfg.get("seed") or 0),)
    return Design(
        arms={a: arms[a] for a in arms if a in chosen},
        order=tuple(order),
        grid={str(k): tuple(v if isinstance(v, list) else [v]) for k, v in grid.items()},
        seeds=seeds,
        select_seed=int(design["select_seed"]) if design.get("select_seed") is not None else seeds[0],
        stress=tuple(float(f) for f in design.get("stress") or ()),
        seeds_declared=declared,
        select_at=_axes(design.get("select_at"), f"{where}: design.select_at"),
        budget=_budget(design.get("budget"), f"{where}: design", grid),
    )


def sweep_params(root: DictConfig) -> dict[str, str]:
    """``hydra.sweeper.params`` for ``adazeta-run -m experiment=NAME``: the grid's axes, the seeds, the methods.

    Hydra also resolves it while it merges the config files, on a config still partial: nothing here may need a
    key that only another file sets."""
    design = design_of(root, str(root.get("experiment_name")))
    if design is None:
        return {}
    methods = [arm.method for arm in design.arms.values()]
    if None in methods:
        arm = next(a for a in design.arms.values() if a.method is None)
        raise ConfigError(f"experiment {root.get('experiment_name')}: arm {arm.name!r} changes more than its method "
                          f"({' '.join(arm.overrides)}), which a Hydra sweep cannot express; run the experiment with "
                          f"python -m adazeta.tools.experiment {root.get('experiment_name')}")
    params = {key: ",".join(str(v) for v in values) for key, values in design.grid.items()}
    if design.seeds_declared:  # swept, even a single seed
        params["seed"] = ",".join(str(s) for s in design.seeds)
    params["method"] = ",".join(dict.fromkeys(methods))
    return params




def compose_experiment(name: str) -> dict[str, Any]:
    """``conf/experiment/NAME.yaml`` composed as ``adazeta-run experiment=NAME`` composes it (its defaults, the
    experiments it inherits), as a plain dict: the one way the drivers and reports read an experiment."""
    from hydra import compose, initialize_config_dir

    from adazeta.paths import config_dir

    path = Path(config_dir()) / "experiment" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ConfigError(f"no experiment config {path}; known experiments: {known}")
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={name}"])
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


@dataclass(frozen=True)
class PilotBudget:
    """``Budget``'s rule applied at one point: ``forwards`` is None until every pilot run there has ended."""

    forwards: int | None
    why: str
    curve: tuple[tuple[int, float], ...] = ()  # (forward passes, mean pilot dev loss), up to the cap
    # A run that diverged after the cap counts by its curve up to the cap (cpu_zo_claims ran 3,000 forwards).


def _dev_curve(run: Path) -> list[tuple[int, float]] | None:
    """A run's dev losses by forward passes spent (eval.csv's steps, metrics.csv's forwards at them)."""
    import csv

    try:
        with open(run / "eval.csv") as f:
            evals = [r for r in csv.DictReader(f) if r.get("split", "dev") == "dev"]
        with open(run / "metrics.csv") as f:
            forwards = {int(r["step"]): int(float(r["forward_passes"])) for r in csv.DictReader(f)}
    except (OSError, KeyError, ValueError):
        return None
    forwards[0] = 0
    curve = [(forwards[int(r["step"])], float(r["loss"])) for r in evals if int(r["step"]) in forwards]
    return curve or None


def budget_at(budget: Budget, value: Any, runs: Path) -> PilotBudget:
    """The forward budget at the point where ``budget.axis`` is ``value``, by the declared rule (``Budget``), from
    the pilot runs under ``runs`` (results/runs): their dev-loss curves averaged at shared evaluation points."""
    import json

    pattern = budget.pilots.get(str(value))
    if pattern is None:
        return PilotBudget(budget.cap, f"no pilot declared for {budget.axis}={value}: the cap")
    dirs = sorted(p.parent for p in runs.glob(f"{pattern}/result.json"))
    if not dirs:
        return PilotBudget(None, f"its pilot ({pattern}) has not run")
    statuses = [json.loads((d / "result.json").read_text()).get("status") for d in dirs]
    if any(s not in ENDED for s in statuses):
        return PilotBudget(None, f"its pilot ({pattern}) has not ended")
    curves = [_dev_curve(d) for d in dirs]
    if any(c is None for c in curves):
        return PilotBudget(None, f"a pilot run of {pattern} has no dev curve")
    shared = sorted(set.intersection(*[{f for f, _ in c if f <= budget.cap} for c in curves]))  # type: ignore[union-attr]
    mean = tuple((f, sum(dict(c)[f] for c in curves) / len(curves)) for f in shared)  # type: ignore[arg-type]
    if any(s == "diverged" and max(f for f, _ in c) <= budget.cap for s, c in zip(statuses, curves)):  # type: ignore[union-attr]
        return PilotBudget(budget.cap, "a pilot run diverged within the cap: the cap", mean)
    if len(mean) < 2 or mean[0][0] != 0:
        return PilotBudget(budget.cap, "the pilot has no evaluation at 0 and after: the cap", mean)
    first, lowest = mean[0][1], min(loss for _, loss in mean)
    if lowest > first * (1 - budget.min_drop):
        return PilotBudget(budget.cap, f"the pilot did not move (dev loss {first:.4f} -> lowest {lowest:.4f}): "
                                       "the cap", mean)
    target = first - budget.share * (first - lowest)
    reached = next(f for f, loss in mean if loss <= target + 1e-12)
    rounded = -(-reached // budget.round_to) * budget.round_to
    forwards = min(budget.cap, max(budget.floor, rounded))
    return PilotBudget(forwards, f"{budget.share:.0%} of the pilot's drop ({first:.4f} -> {lowest:.4f}) made at "
                                 f"{reached} forwards", mean)
