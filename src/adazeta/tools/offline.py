"""``../shared`` (beside the current directory, as in a development checkout) as the offline model and data folders.

``make`` points $ADAZETA_MODEL_DIR and $ADAZETA_DATA_DIR at ``../shared/models`` and ``../shared/data`` when
they exist; the benchmark and experiment modules do the same when run directly (``python -m adazeta.tools.bench``).
A variable that is already set is left alone.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

# What adazeta.models and adazeta.tasks.loaders read (named here so that a driver process need not import torch).
FOLDERS = (("ADAZETA_MODEL_DIR", "models"), ("ADAZETA_DATA_DIR", "data"))


def use_shared(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set the model and data folder variables of ``env`` (default: this process's) to ``../shared/models`` and
    ``../shared/data`` where they are unset and the folders exist; returns ``env``."""
    env = os.environ if env is None else env
    shared = Path.cwd().parent / "shared"
    for var, sub in FOLDERS:
        if not env.get(var) and (shared / sub).is_dir():
            env[var] = str(shared / sub)
    return env
