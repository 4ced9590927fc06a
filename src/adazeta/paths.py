"""Where the project's config tree is. Light on purpose: the CLI reads it before importing anything heavy."""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_ENV = "ADAZETA_CONFIG_DIR"


def config_dir() -> str:
    """The ``conf/`` tree: $ADAZETA_CONFIG_DIR, else the one beside ``src/`` in this checkout."""
    if os.environ.get(CONFIG_ENV):
        return str(Path(os.environ[CONFIG_ENV]).resolve())
    return str(Path(__file__).resolve().parents[2] / "conf")
