"""adazeta: memory-efficient zeroth-order fine-tuning of language models (AdaZeta and its baselines)."""

__version__ = "0.1.0"


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
