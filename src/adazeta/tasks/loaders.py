"""Load task splits from the Hub (through ``datasets``) or from local files, and sample them (SPEC §6)."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adazeta.errors import ConfigError
from adazeta.tasks.spec import Example, TaskSpec, render

DATA_DIR_ENV = "ADAZETA_DATA_DIR"
FORMATS = ("jsonl", "tsv")


@dataclass
class DataConfig:
    """How many examples to sample, with which seed, from where. ``dir`` (or $ADAZETA_DATA_DIR) = offline."""

    num_train: int = 1000
    num_dev: int = 500
    num_eval: int = 1000
    seed: int | None = None  # data sampling seed; defaults to the run seed
    dir: str | None = None  # local data directory; unset = download from the Hub

    def __post_init__(self) -> None:
        for name in ("num_train", "num_dev", "num_eval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name}={getattr(self, name)} must be >= 1")

    @property
    def data_dir(self) -> str | None:
        return self.dir or os.environ.get(DATA_DIR_ENV) or None


@dataclass
class TaskData:
    train: list[Example]
    dev: list[Example]
    eval: list[Example]
    source: str  # "hub:<id>" or "local:<folder>"


def local_files(spec: TaskSpec, data_dir: str) -> dict[str, list[Path]]:
    """The local files of each split, checked to exist (one line naming the missing path and the fix)."""
    if spec.local is None:
        raise ConfigError(
            f"task {spec.name!r} has no local data layout; unset {DATA_DIR_ENV} (and data.dir) to load it from the Hub"
        )
    if spec.local.format not in FORMATS:
        raise ConfigError(f"task {spec.name!r}: local.format={spec.local.format!r} is not one of {', '.join(FORMATS)}")
    folder = Path(data_dir).expanduser() / spec.local.dir
    files = {"train": [folder / f for f in spec.local.train], "eval": [folder / f for f in spec.local.eval]}
    for paths in files.values():
        for path in paths:
            if not path.is_file():
                raise ConfigError(
                    f"data file not found: {path}; point {DATA_DIR_ENV} (or data.dir) at the folder that holds "
                    f"{spec.local.dir}/, or unset it to download {spec.name} from the Hub"
                )
    return files


def read_jsonl(path: Path, required: list[str]) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected one JSON object per line") from None
            missing = [k for k in required if k not in row]
            if missing:
                raise ConfigError(f"{path}:{lineno}: missing field {missing[0]!r}; expected fields {', '.join(required)}")
            rows.append(row)
    return rows


def read_tsv(path: Path, required: list[str]) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None or any(k not in header for k in required):
            raise ConfigError(f"{path}:1: header {header} lacks one of {', '.join(required)}; expected a TSV header row")
        for lineno, values in enumerate(reader, 2):
            if not values:
                continue
            if len(values) != len(header):
                raise ConfigError(f"{path}:{lineno}: {len(values)} columns, expected {len(header)} ({', '.join(header)})")
            rows.append(dict(zip(header, values)))
    return rows


def _coerce_label(value: Any) -> Any:
    """TSV labels arrive as strings: turn '0'/'1' into ints so they match numeric label lists."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def load_rows(spec: TaskSpec, split: str, data_dir: str | None) -> tuple[list[dict[str, Any]], str]:
    """Rows of ``split`` (train or eval) with labels normalised to indices under the key ``label``."""
    required = list(spec.text_fields) + [spec.label_field]
    if data_dir:
        rows: list[dict[str, Any]] = []
        reader = read_jsonl if spec.local.format == "jsonl" else read_tsv  # type: ignore[union-attr]
        paths = local_files(spec, data_dir)[split]
        for path in paths:
            rows.extend(reader(path, required))
        where = ", ".join(str(p) for p in paths)
        source = f"local:{Path(data_dir).expanduser() / spec.local.dir}"  # type: ignore[union-attr]
    else:
        if spec.hub is None:
            raise ConfigError(f"task {spec.name!r} has no Hub source; set {DATA_DIR_ENV} to a local data folder")
        import datasets

        hub_split = spec.hub.train_split if split == "train" else spec.hub.eval_split
        ds = datasets.load_dataset(spec.hub.path, spec.hub.name, split=hub_split)
        rows = [dict(r) for r in ds]
        where = f"{spec.hub.path}/{spec.hub.name or ''}:{hub_split}"
        source = f"hub:{spec.hub.path}/{spec.hub.name or ''}"
    for i, row in enumerate(rows):
        row["label"] = spec.label_index(_coerce_label(row[spec.label_field]), f"{where} row {i}")
    return rows, source


def sample_indices(n: int, k: int, rng: np.random.RandomState) -> np.ndarray:
    """k indices out of n without replacement (all of them, shuffled, when k >= n)."""
    return rng.permutation(n)[: min(k, n)]


def load_task(spec: TaskSpec, data: DataConfig, family: str, seed: int, mask_token: str | None = None) -> TaskData:
    """MeZO protocol (SPEC §6): num_train + num_dev sampled from train, num_eval from validation, seeded."""
    data_seed = seed if data.seed is None else data.seed
    num_dev = spec.num_dev or data.num_dev
    train_rows, source = load_rows(spec, "train", data.data_dir)
    eval_rows, _ = load_rows(spec, "eval", data.data_dir)
    rng = np.random.RandomState(data_seed)
    order = rng.permutation(len(train_rows))
    if len(order) < 2:
        raise ConfigError(f"task {spec.name!r}: the train split has {len(order)} rows; at least 2 are needed")
    # Keep at least one dev example even when the train split is small (e.g. 32-example FewGLUE files).
    n_dev = min(num_dev, max(1, len(order) - data.num_train))
    train_idx, dev_idx = order[: len(order) - n_dev][: data.num_train], order[len(order) - n_dev :]
    if len(order) >= data.num_train + num_dev:
        train_idx, dev_idx = order[: data.num_train], order[data.num_train : data.num_train + num_dev]
    eval_idx = sample_indices(len(eval_rows), data.num_eval, rng)

    def make(rows: list[dict[str, Any]], idx: np.ndarray) -> list[Example]:
        return [render(spec, family, rows[i], rows[i]["label"], mask_token) for i in idx]

    return TaskData(make(train_rows, train_idx), make(train_rows, dev_idx), make(eval_rows, eval_idx), source)
