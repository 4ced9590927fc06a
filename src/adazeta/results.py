"""Result records with provenance: every number in a table traces back to a config and a commit (STYLE §8)."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from adazeta.rundir import atomic_write_text

PACKAGES = ("adazeta", "torch", "transformers", "peft", "datasets", "hydra-core", "wandb", "tensorly", "gguf")
STATUSES = ("finished", "diverged", "stalled", "failed", "interrupted")


def git_state(where: Path | None = None) -> dict[str, Any]:
    """The commit and dirty flag of the source tree this package runs from (None outside a checkout)."""
    where = where or Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = None if commit is None else bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": dirty}


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"type": device.type, "host": platform.node(), "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["name"] = cpu_name()
    return info


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what ``platform`` knows: timings depend on it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_result(path: Path, record: dict[str, Any]) -> None:
    """Write atomically (temp file, fsync, rename): a reader never sees half a record, and a failed write (a full
    disk) leaves the previous file as it was."""
    if record.get("status") not in STATUSES:
        raise ValueError(f"result status {record.get('status')!r} is not one of {STATUSES}")
    atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")


def read_result(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
