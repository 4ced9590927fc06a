"""Result records with provenance: every number in a table traces back to a config and a commit (STYLE §8)."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from adazeta.errors import ConfigError
from adazeta.runs.record import ENDED, main_score
from adazeta.runs.rundir import atomic_write_text

PACKAGES = ("adazeta", "torch", "transformers", "peft", "datasets", "hydra-core", "wandb", "tensorly", "gguf")
STATUSES = ("finished", "diverged", "stalled", "failed", "interrupted")


# What decides a run's numbers: a change here (committed or not) makes a run's code "dirty"; results, docs and tests
# do not (an experiment driver appends to a committed results/.../launches.csv as it launches runs).
CODE_PATHS = (":/src", ":/conf", ":/pyproject.toml", ":/setup.py")


def git_state(where: Path | None = None) -> dict[str, Any]:
    """The commit and dirty flag of the source tree this package runs from (None outside a checkout): dirty when a
    tracked file of its code or configuration (``CODE_PATHS``) differs from the commit."""
    where = where or Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = None if commit is None else bool(git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS))
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
        info["cpu_features"] = cpu_features()
    return info


# The instruction sets a CPU forward's speed turns on (bf16 and int8 matrix units, wide vectors); two CPUs with one
# model name ("Intel(R) Xeon(R) Processor") can differ in them, so a run records which it had.
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_features() -> list[str]:
    """Which of ``CPU_FEATURES`` this CPU has (/proc/cpuinfo's flags; empty where it cannot be read)."""
    flags = set((_cpuinfo("flags") or "").split())
    return [feature for feature in CPU_FEATURES if feature in flags]


def cpu_label(device: dict[str, Any] | None) -> str:
    """A run's CPU as reports name it: its model name, and whether it had AMX where the record says."""
    device = device or {}
    name = str(device.get("name") or "unknown CPU")
    features = device.get("cpu_features")
    if features is None or device.get("type", "cpu") != "cpu":
        return name
    return f"{name} ({'AMX' if 'amx_bf16' in features else 'no AMX'})"


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line of /proc/cpuinfo (Linux), None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what ``platform`` knows: timings depend on it."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def write_result(path: Path, record: dict[str, Any]) -> None:
    """Write atomically (temp file, fsync, rename): a reader never sees half a record, and a failed write (a full
    disk) leaves the previous file as it was."""
    if record.get("status") not in STATUSES:
        raise ValueError(f"result status {record.get('status')!r} is not one of {STATUSES}")
    atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")


def record_problem(record: Any) -> str | None:
    """What makes ``record`` (a parsed result.json) unusable to skip, compare or resume its run, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record (a JSON object)"
    missing = [key for key in ("status", "config") if key not in record]
    if missing:
        return f"no {' or '.join(repr(k) for k in missing)}"
    if record["status"] not in STATUSES:
        return f"status {record['status']!r} is not one of {', '.join(STATUSES)}"
    if not isinstance(record["config"], dict):
        return "its 'config' is not a mapping"
    if record["status"] in ENDED:  # a result: its numbers must be there
        missing = [k for k in ("steps", f"test_{record.get('metric') or 'accuracy'}") if k not in record]
        if missing or main_score(record, "test") is None:
            return f"a {record['status']} record without {' or '.join(repr(k) for k in missing) or 'a test score'}"
    return None


def read_record(path: Path) -> dict[str, Any]:
    """The record a run directory holds, checked: a damaged one (cut short, not JSON, not a record, keys missing)
    is never taken for an absent one, which the next run would overwrite. ConfigError names the file and the
    way out."""
    problem = None
    try:
        text = Path(path).read_bytes().decode("utf-8")
        record = json.loads(text)
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    except json.JSONDecodeError as err:
        problem = "empty" if not text.strip() else f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
    except OSError as err:
        problem = f"unreadable: {err.strerror or err}"
    else:
        problem = record_problem(record)
    if problem is not None:
        raise ConfigError(f"{path} is damaged ({problem}), so its run cannot be skipped or resumed; move it away to "
                          "keep it, or rerun with force=true to replace the run")
    return record
