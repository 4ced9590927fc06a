"""Query-count schedules: how many random directions Q the ZO estimator averages at a given epoch.

Each schedule is a pure function of the epoch index (counted from 0; Q changes only at epoch starts), one module
of this package: its function, its config dataclass (a ``ScheduleConfig``) and one register call. The registry
``SCHEDULES`` maps a name to a typed config and a builder ``(cfg, num_epochs) -> (epoch -> Q)`` so that every
method can run with every schedule. ``base`` holds what they share: the config base class and the functions of
a run's length (``run_epochs``, ``epoch_of``, ``mean_queries``, ``budget_steps``).
"""

from adazeta.registry import SCHEDULES
from adazeta.schedules.adaptive import AdaptiveConfig, adaptive_q, build_adaptive
from adazeta.schedules.adaptive_official import (
    AdaptiveOfficialConfig,
    adaptive_official_q,
    build_adaptive_official,
    official_beta,
)
from adazeta.schedules.base import Schedule, ScheduleConfig, budget_steps, epoch_of, mean_queries, run_epochs
from adazeta.schedules.constant import ConstantConfig, build_constant, constant_q

__all__ = [
    "SCHEDULES", "Schedule", "ScheduleConfig", "budget_steps", "epoch_of", "mean_queries", "run_epochs",
    "ConstantConfig", "build_constant", "constant_q", "AdaptiveConfig", "adaptive_q", "build_adaptive",
    "AdaptiveOfficialConfig", "adaptive_official_q", "build_adaptive_official", "official_beta",
]

# Importing every module of this package registers the built-in schedules: a new schedule is one new file here.
import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
