"""adazeta: memory-efficient zeroth-order fine-tuning of language models (AdaZeta and its baselines)."""

__version__ = "0.1.0"
