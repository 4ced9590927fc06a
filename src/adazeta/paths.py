"""Where the project's config tree is. Light on purpose: the CLI reads it before importing anything heavy."""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_ENV = "ADAZETA_CONFIG_DIR"


def config_dir() -> str:
    """The ``conf/`` tree: $ADAZETA_CONFIG_DIR, else the one beside ``src/`` in a checkout (edited in place), else
    the copy an installed package ships as ``adazeta/conf`` (setup.py)."""
    if os.environ.get(CONFIG_ENV):
        return str(Path(os.environ[CONFIG_ENV]).resolve())
    here = Path(__file__).resolve().parent
    checkout = here.parents[1] / "conf"
    if (checkout / "config.yaml").is_file():
        return str(checkout)
    return str(here / "conf")
