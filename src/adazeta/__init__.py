"""adazeta: memory-efficient zeroth-order fine-tuning of language models (AdaZeta and its baselines)."""

__version__ = "0.1.0"


def load_adapters(model, folder):  # noqa: ANN001, ANN201 (light: the package imports nothing heavy on its own)
    """Attach the adapters a run saved (``<run dir>/adapter``) to a plain ``transformers`` model; see
    ``adazeta.saving.load_adapters``."""
    from adazeta.saving import load_adapters as load

    return load(model, folder)


def save_adapters(model, folder, kind, config, base, card=""):  # noqa: ANN001, ANN201
    """Write a model's trained adapters to ``folder``; see ``adazeta.saving.save_adapters``."""
    from adazeta.saving import save_adapters as save

    return save(model, folder, kind, config, base, card)
