"""adazeta: memory-efficient zeroth-order fine-tuning of language models (AdaZeta and its baselines)."""

__version__ = "0.1.0"

import os as _os
import signal as _signal
import sys as _sys

STARTUP_INTERRUPTED = ("adazeta-run: interrupted (SIGINT) during start-up, before the run began: nothing was recorded; "
                       "run the command again")


def interrupted_while_importing(signum, frame):  # noqa: ANN001, ANN202
    """Ctrl-C while the command's modules import: one line, not the traceback of whatever was importing."""
    print(STARTUP_INTERRUPTED, file=_sys.stderr, flush=True)
    _os._exit(128 + signum)  # nothing is written yet: nothing to clean up


def _is_the_command() -> bool:
    """``adazeta-run`` or ``python -m adazeta.cli`` (whose package is imported while ``sys.argv[0]`` is still
    ``-m``), not a library import (tests, tools, a user's script)."""
    if _os.path.basename(_sys.argv[0]) == "adazeta-run":
        return True
    argv = list(getattr(_sys, "orig_argv", []))
    return "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["adazeta.cli"]


# First thing, before this package imports omegaconf: a Ctrl-C at the command's very start is one line too
# (``adazeta.cli.main`` takes Ctrl-C over once the imports are done).
if _is_the_command() and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, interrupted_while_importing)


def _experiment_sweep(*, _root_):  # noqa: ANN001, ANN202
    """``${experiment_sweep:}``: an experiment's Hydra sweep, derived from its arms and design (adazeta.experiments)."""
    from adazeta.experiments import sweep_params

    return sweep_params(_root_)


def _register_resolvers() -> None:
    # Here, so that every way in (adazeta-run, the tools, the tests) composes experiment configs with it.
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("experiment_sweep"):
        OmegaConf.register_new_resolver("experiment_sweep", _experiment_sweep)


_register_resolvers()


def load_adapters(model, folder):  # noqa: ANN001, ANN201 (light: the package imports nothing heavy on its own)
    """Attach the adapters a run saved (``<run dir>/adapter``) to a plain ``transformers`` model; see
    ``adazeta.runs.saving.load_adapters``."""
    from adazeta.runs.saving import load_adapters as load

    return load(model, folder)


def save_adapters(model, folder, kind, config, base, card=""):  # noqa: ANN001, ANN201
    """Write a model's trained adapters to ``folder``; see ``adazeta.runs.saving.save_adapters``."""
    from adazeta.runs.saving import save_adapters as save

    return save(model, folder, kind, config, base, card)
