"""Load task splits from the Hub (through ``datasets``) or from local files; sample them (MeZO, LM-BFF protocols).

Over 400 lines: every source and protocol (Hub, JSONL / TSV / CSV, MeZO and LM-BFF) shares the row checks.

Two protocols, picked by the model's family:

- causal (MeZO): ``num_train`` + ``num_dev`` examples drawn (seeded) from the train split, ``num_eval`` from the
  validation split in a draw of its own with the same seed, so the test set is MeZO's for that seed;
- masked (LM-BFF, Gao et al. 2021): k examples per class for train and k more for dev, with one of the data seeds
  13, 21, 42, 87, 100; the test set is the original dev/test set sub-sampled to ``num_eval`` (1,000). Local data
  is the standard ``k-shot/<TASK>/<k>-<seed>/`` layout, read as is; from the Hub the same sampling is redone.

Local files name their rows ``file:line`` in every error; labels are normalised to indices.
"""

from __future__ import annotations

import csv
import errno
import json
import logging
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from adazeta.errors import ConfigError
from adazeta.tasks.hooks import FLATTENERS
from adazeta.tasks.spec import BoundTask, Example, HubSource, LocalSource, TaskSpec

log = logging.getLogger("adazeta")

DATA_DIR_ENV = "ADAZETA_DATA_DIR"
# No cap on a field's length: a long passage (MultiRC, BoolQ, a user's documents) is a well-formed row, and the csv
# module's default limit (131,072 characters) would reject it.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
KSHOT_SEEDS = (13, 21, 42, 87, 100)  # LM-BFF's five data seeds
# LM-BFF / MeZO's test subset (tools/generate_k_shot_data.py, mode k-shot-1k-test): one draw with seed 42, the same
# for every data seed (np.random.seed(42) + shuffle for TSVs, DataFrame.sample(random_state=42) for CSVs: both are
# RandomState(42).permutation(n)[:1000]).
LMBFF_TEST_SEED = 42


@dataclass
class DataConfig:
    """How many examples to sample, with which seed, from where. ``dir`` (or $ADAZETA_DATA_DIR) = offline."""

    num_train: int = 1000  # causal protocol: train examples sampled from the train split
    num_dev: int = 500  # causal protocol: dev examples, from the rest of the train split
    num_eval: int = 1000  # test examples sampled from the validation split (both protocols)
    seed: int | None = None  # causal protocol: data sampling seed; defaults to the run seed
    dir: str | None = None  # local data directory; unset = download from the Hub
    k: int = 16  # masked (LM-BFF) protocol: examples per class, for train and again for dev
    kshot_seed: int = 13  # masked protocol: data seed, one of 13, 21, 42, 87, 100 for the LM-BFF splits
    # causal protocol, a train split smaller than num_train + num_dev: dev takes at most half of it (FewGLUE), or,
    # false, all of num_dev from the end of the draw with train the rest (MeZO run.py: WSC's 554 rows train on 54)
    dev_at_most_half: bool = True

    def __post_init__(self) -> None:
        for name in ("num_train", "num_dev", "num_eval", "k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name}={getattr(self, name)} must be >= 1")
        if self.kshot_seed < 0:
            raise ConfigError(f"data.kshot_seed={self.kshot_seed} must be >= 0 (LM-BFF uses {KSHOT_SEEDS})")

    @property
    def data_dir(self) -> str | None:
        return self.dir or os.environ.get(DATA_DIR_ENV) or None


@dataclass
class TaskData:
    train: list[Example]
    dev: list[Example]
    eval: list[Example]
    source: str  # "hub:<id>" or "local:<folder>"


# --------------------------------------------------------------------------------------------------------------
# Local files


def _split_files(local: LocalSource, split: str) -> tuple[str, list[str]]:
    """(folder under the data directory, file names) of a split."""
    if split == "train":
        return local.train_dir or local.dir, local.train
    return local.dir, local.dev if split == "dev" else local.eval


def local_files(
    task: BoundTask,
    data_dir: str,
    k: int = 16,
    kshot_seed: int = 13,
    splits: Sequence[str] = ("train", "dev", "eval"),
    needed_by: str | None = None,
) -> dict[str, list[Path]]:
    """The local files of each split, checked to exist (one line naming the missing path and the fix).

    ``needed_by`` says what needs the splits (e.g. "method 'icl' needs the train split for its demonstrations"):
    it opens the missing-file message, so that a user learns why a file they did not expect to need is missing.
    """
    local = task.local
    if local is None:
        raise ConfigError(
            f"task {task.name!r} has no local data layout; unset {DATA_DIR_ENV} (and data.dir) to load it from the Hub"
        )
    base = Path(data_dir).expanduser()
    hint = local.note or (
        f"point {DATA_DIR_ENV} (or data.dir) at the folder that holds {local.dir}/, "
        f"or unset it to download {task.name} from the Hub"
    )
    files: dict[str, list[Path]] = {}
    for split in splits:
        folder, names = _split_files(local, split)
        root = base / folder
        if local.kshot:
            root = root / f"{k}-{kshot_seed}"
            if not root.is_dir():
                have = sorted(p.name for p in (base / folder).glob("*-*") if p.is_dir())
                raise ConfigError(
                    f"no LM-BFF split {root}; available: {', '.join(have) or 'none'}; set data.k and "
                    f"data.kshot_seed to one of them, or unset {DATA_DIR_ENV} to sample it from the Hub"
                )
        files[split] = [root / name for name in names]
        for path in files[split]:
            problem = _not_a_file(path) if not path.is_file() else _not_plain_text(path)
            if problem:
                why = f"{needed_by}: " if needed_by else ""
                raise ConfigError(f"{why}{problem}: {path}; {hint}")
    if not all(files[s] for s in splits if s != "dev"):
        raise ConfigError(f"task {task.name!r}: local.train and local.eval must each name at least one file")
    return files


# The first bytes of the compressed and archive formats a data file is often shipped in, and the way to open each.
COMPRESSED = ((b"\x1f\x8b", "a gzip-compressed file", "gunzip it"), (b"BZh", "a bzip2-compressed file", "bunzip2 it"),
              (b"\xfd7zXZ\x00", "an xz-compressed file", "unxz it"), (b"(\xb5/\xfd", "a zstd-compressed file", "unzstd it"),
              (b"PK\x03\x04", "a zip archive", "unzip it"), (b"7z\xbc\xaf\x27\x1c", "a 7-zip archive", "extract it"))


def _not_plain_text(path: Path) -> str | None:
    """Why the regular file ``path`` cannot be read as a text data file (it is compressed, or an archive), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as err:
        return f"an unreadable data file ({err.strerror or err})"
    for magic, what, fix in COMPRESSED:
        if head.startswith(magic):
            return f"{what} where a plain-text data file should be ({fix} first, keeping the name the task reads)"
    return None


def _not_a_file(path: Path) -> str:
    """Why ``path`` is not a readable data file, in a few words: missing, a folder, a named pipe, a socket or a
    device (whose reads would block or never end), a broken or looping link."""
    if path.is_dir():
        return "a folder where a data file should be"
    for test, what in ((path.is_fifo, "a named pipe (FIFO)"), (path.is_socket, "a socket"),
                       (path.is_char_device, "a character device"), (path.is_block_device, "a block device")):
        if test():
            return f"{what} where a regular data file should be (copy the data into a file)"
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:  # Python < 3.13 reports a loop as RuntimeError, later ones as OSError
            return "a symlink loop where a data file should be"
        except OSError as err:
            if err.errno == errno.ELOOP:
                return "a symlink loop where a data file should be"
            return "a broken symlink where a data file should be"
    return "data file not found"


def check_data(task: BoundTask, data: DataConfig, train_needed_by: str | None = None) -> None:
    """Start-up checks that need no model: the task's local files exist (binding it to the family checked that
    the task has the family's format).

    The evaluation split is always needed. The train split is checked only when ``train_needed_by`` names what
    needs it (training, ICL's demonstrations, the probe); zero-shot scores the evaluation split alone when the
    train split is absent (BoolQ's offline copy has only its validation file).
    """
    if data.data_dir and task.local is not None:  # without a local layout the Hub serves the task (SQuAD, DROP)
        if train_needed_by is not None:
            local_files(task, data.data_dir, data.k, data.kshot_seed, ("train",), train_needed_by)
        local_files(task, data.data_dir, data.k, data.kshot_seed, ("dev", "eval"))


def split_available(task: BoundTask, split: str, data: DataConfig) -> bool:
    """Whether ``split`` can be read: its local files exist, or (without a local layout) the Hub serves it."""
    if not (data.data_dir and task.local is not None):
        return True
    try:
        local_files(task, data.data_dir, data.k, data.kshot_seed, splits=(split,))
    except ConfigError:
        return False
    return True


def _rename(row: dict[str, Any], rename: dict[str, str]) -> dict[str, Any]:
    return {rename.get(k, k): v for k, v in row.items()} if rename else row


def _check_required(row: dict[str, Any], required: Sequence[str], where: str, expected: str) -> None:
    missing = [k for k in required if k not in row]
    if missing:
        raise ConfigError(f"{where}: missing field {missing[0]!r}; expected {expected}")


def read_jsonl(
    path: Path, required: Sequence[str], flatten: str | None = None, rename: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """JSON lines; ``flatten`` turns one nested line into several rows (MultiRC: one row per answer)."""
    flattener = FLATTENERS.get(flatten).builder if flatten else None
    rows = []
    with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Windows editors write one) is not data
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: a JSON {type(row).__name__}; expected one JSON object per line")
            for item in flattener(row, where) if flattener else [row]:
                item = _rename(item, rename or {})
                _check_required(item, required, where, f"fields {', '.join(required)}")
                item["_where"] = where
                rows.append(item)
    return rows


def read_table(
    path: Path,
    required: Sequence[str],
    delimiter: str = "\t",
    columns: Sequence[str] | None = None,
    ragged: bool = False,
    rename: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """TSV (GLUE, LM-BFF: no quoting) or CSV (LM-BFF's sst-5/mr/cr/trec: quoted, no header).

    With ``columns`` the file has no header row. ``ragged``: a row may hold more values than the header names,
    before the last column (SNLI lists up to five annotator labels; the gold label is always last).
    """
    rows = []
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    with open(path, encoding="utf-8-sig", newline="") as f:  # a byte-order mark would join the first header
        reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
        first = 1
        header = list(columns) if columns else next(reader, None)
        if not columns:
            first = 2
            names = [rename.get(h, h) for h in header] if header and rename else header
            if header is None or any(k not in (names or []) for k in required):
                raise ConfigError(
                    f"{path}:1: header {header} lacks one of {', '.join(required)}; expected a header row"
                )
        for lineno, values in _rows(reader, path, first):
            if not values:
                continue
            n = len(header)
            if len(values) != n and not (ragged and len(values) > n):
                raise ConfigError(f"{path}:{lineno}: {len(values)} columns, expected {n} ({', '.join(header)})")
            if len(values) > n:
                values = values[: n - 1] + values[-1:]
            row = _rename(dict(zip(header, values)), rename or {})
            _check_required(row, required, f"{path}:{lineno}", f"columns {', '.join(required)}")
            row["_where"] = f"{path}:{lineno}"
            rows.append(row)
    return rows


def _rows(reader: Any, path: Path, first: int) -> Any:
    """(line number, values) of a csv reader; a malformed row is one line naming the file and line."""
    lineno = first
    while True:
        try:
            values = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            raise ConfigError(f"{path}:{reader.line_num}: not a well-formed {'TSV' if reader.dialect.delimiter == chr(9) else 'CSV'} "
                              f"row ({err}); fix or remove that row") from None
        yield lineno, values
        lineno += 1


def read_local(path: Path, local: LocalSource, required: Sequence[str]) -> list[dict[str, Any]]:
    try:
        if local.format == "jsonl":
            return read_jsonl(path, required, local.flatten, local.rename)
        delimiter = "\t" if local.format == "tsv" else ","
        return read_table(path, required, delimiter, local.columns, local.ragged, local.rename)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}:{_bad_utf8_line(path)}: not UTF-8 ({err.reason}); save the file as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}; check the file and its permissions") from None


def _bad_utf8_line(path: Path) -> int:
    """The number of the first line of ``path`` that is not valid UTF-8."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return lineno
    return 1


# --------------------------------------------------------------------------------------------------------------
# Rows of one split, from either source


def _all_int(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


class Rows:
    """One split before sampling. A Hub split stays in Arrow until :meth:`take` (ReCoRD has 100k passages)."""

    def __init__(self, spec: TaskSpec, where: str, source: str, rows: list[dict[str, Any]] | None = None,
                 dataset: Any = None, label_names: list[str] | None = None):
        self.spec, self.where, self.source = spec, where, source
        self._rows, self._dataset = rows, dataset
        # Hub ClassLabel names turn an index into its name when the task's labels are names: GLUE's MNLI index 0 is
        # "entailment" but the task lists "contradiction" first (LM-BFF's order).
        self._names = label_names if label_names and not _all_int(spec.labels) else None

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else len(self._dataset)

    def _label(self, value: Any, where: str) -> int:
        if self._names is not None and isinstance(value, int) and not isinstance(value, bool):
            if 0 <= value < len(self._names):
                value = self._names[value]
        return self.spec.label_index(value, where)  # TSV text such as '1' or '1.0' is read there

    def _where(self, row: dict[str, Any], i: int) -> str:
        return row.get("_where") or f"{self.where} row {i}"

    def check(self) -> None:
        """Every local row has a value for each text field and a known label; else one line naming the row.

        An empty string is a value (LM-BFF's CR split and MultiRC hold a few); a JSON null is not.
        """
        for i, row in enumerate(self._rows or []):
            for name in self.spec.text_fields:
                if row.get(name) is None:
                    raise ConfigError(f"{self._where(row, i)}: field {name!r} is null; give it a value or remove the row")
        if self.spec.label_field is not None:
            self.labels()  # names the first row whose label is not one of the task's

    def labels(self) -> list[int]:
        """The label index of every row (k-shot sampling needs them all)."""
        field = self.spec.label_field
        if field is None:
            raise ConfigError(f"task {self.spec.name!r} has no label_field, so it cannot be sampled per class")
        if self._rows is not None:
            return [self._label(r[field], self._where(r, i)) for i, r in enumerate(self._rows)]
        return [self._label(v, f"{self.where} row {i}") for i, v in enumerate(self._dataset[field])]

    def take(self, idx: Sequence[int]) -> list[dict[str, Any]]:
        """The rows at ``idx``, with their label normalised to an index under ``label``."""
        idx = [int(i) for i in idx]
        if self._rows is not None:
            rows = [dict(self._rows[i]) for i in idx]
        else:
            rows = self._dataset.select(idx).to_list() if idx else []
        if self.spec.label_field is not None:
            for i, row in zip(idx, rows):
                row["label"] = self._label(row[self.spec.label_field], self._where(row, i))
        return rows


def _required(spec: TaskSpec) -> list[str]:
    return list(spec.text_fields) + ([spec.label_field] if spec.label_field else [])


def local_rows(spec: TaskSpec, local: LocalSource, paths: Sequence[Path]) -> Rows:
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(read_local(path, local, _required(spec)))
    where = ", ".join(str(p) for p in paths)
    return Rows(spec, where, f"local:{paths[0].parent}" if paths else "local", rows=rows)


def hub_rows(spec: TaskSpec, hub: HubSource, split: str, offline_hint: str = "") -> Rows:
    """A Hub split through ``datasets`` (parquet/json repos: no loading scripts), columns renamed to the task's."""
    import datasets

    dataset_id = hub.path + (f"/{hub.name}" if hub.name else "")
    where = f"{dataset_id}:{split}"
    try:
        ds = datasets.load_dataset(hub.path, hub.name, split=split, revision=hub.revision)
    except Exception as err:  # network, unknown id, missing split: one line, with the way out
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(
            f"could not load {where} from the Hub ({type(err).__name__}: {reason[:200]}); check the dataset id "
            f"and your connection{offline_hint}"
        ) from None
    renames = {k: v for k, v in hub.rename.items() if k in ds.column_names and k != v}
    if renames:
        ds = ds.rename_columns(renames)
    missing = [k for k in _required(spec) if k not in ds.column_names]
    if missing:
        raise ConfigError(f"{where}: no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); "
                          "map it with the source's `rename`")
    if hub.drop_labels:
        drop = set(hub.drop_labels)
        ds = ds.filter(lambda v: v not in drop, input_columns=spec.label_field)
    names = getattr(ds.features.get(spec.label_field), "names", None) if spec.label_field else None
    return Rows(spec, where, f"hub:{dataset_id}", dataset=ds, label_names=names)


def split_rows(task: BoundTask, split: str, data: DataConfig) -> Rows:
    """The rows of ``split`` (train, dev or eval) from local files when a data directory is set, else the Hub."""
    hub, local = task.hub, task.local
    if data.data_dir and local is not None:
        paths = local_files(task, data.data_dir, data.k, data.kshot_seed, splits=(split,))[split]
        return local_rows(task.spec, local, paths)
    if hub is None:
        raise ConfigError(f"task {task.name!r} has no Hub source; set {DATA_DIR_ENV} to a local data folder")
    if data.data_dir:
        log.info("task %s has no local layout for %s models: loading it from the Hub", task.name, task.family)
    if split == "dev":
        raise ValueError("Hub sources have no fixed dev split; dev is sampled from train")
    hint = f", or set {DATA_DIR_ENV} to a folder with local copies" if local is not None else ""
    return hub_rows(task.spec, hub, hub.train_split if split == "train" else hub.eval_split, hint)


def validate_local_rows(task: BoundTask, data: DataConfig, with_train: bool) -> int:
    """Read and check every row of the local splits a run will use, before any model loads; return the count.

    Each row must decode as UTF-8, parse, hold every text field and a known label; the first row
    that does not is named as ``path:line``. Every row is checked, not only those a seed samples, so a bad file
    fails the same way whatever the seed. Splits served by the Hub are checked as they load.
    """
    local = task.local
    if not data.data_dir or local is None:
        return 0
    splits = ["eval"]
    if with_train or split_available(task, "train", data):
        splits.insert(0, "train")
        if task.family.kshot_data and local.kshot:
            splits.insert(1, "dev")
    total = 0
    for split in splits:
        rows = split_rows(task, split, data)
        if len(rows) == 0:
            files = ", ".join(str(p) for p in local_files(task, data.data_dir, data.k, data.kshot_seed,
                                                          (split,))[split])
            raise ConfigError(f"{files}: no rows in the {split} split; the file is empty or holds only a header")
        rows.check()
        total += len(rows)
    return total


def load_rows(
    task: BoundTask, split: str, data_dir: str | None, k: int = 16, kshot_seed: int = 13
) -> tuple[list[dict[str, Any]], str]:
    """Every row of ``split`` with labels normalised to indices under the key ``label``."""
    rows = split_rows(task, split, DataConfig(dir=data_dir, k=k, kshot_seed=kshot_seed))
    return rows.take(range(len(rows))), rows.source


# --------------------------------------------------------------------------------------------------------------
# Sampling


def sample_indices(n: int, k: int, rng: np.random.RandomState) -> np.ndarray:
    """k indices out of n without replacement (all of them, shuffled, when k >= n)."""
    return rng.permutation(n)[: min(k, n)]


def split_sizes(n: int, num_train: int, num_dev: int, dev_at_most_half: bool = True) -> tuple[int, int]:
    """(train, dev) sizes carved from a train split of n rows (MeZO: dev keeps its size, train takes the rest).

    COPA (400 rows, 100 dev) trains on 300. ``dev_at_most_half``: a dev set never takes more than half a small
    split (FewGLUE's 32; WSC's 554 give 277 and 277). Without it, as MeZO's run.py (``dev = train[-num_dev:]`` of
    the ``num_train + num_dev`` drawn), dev keeps num_dev rows and train the rest (WSC: 54 train, 500 dev).
    """
    if n < 2:
        raise ConfigError(f"the train split has {n} rows; at least 2 are needed (one to train, one for dev)")
    n_dev = min(num_dev, n // 2 if dev_at_most_half else n)
    if n_dev == n:
        raise ConfigError(f"the train split has {n} rows and dev takes {num_dev}: none is left to train on; lower "
                          f"data.num_dev or set data.dev_at_most_half=true")
    return min(num_train, n - n_dev), n_dev


def shortfalls(rows: int, num_train: int, n_train: int, dev_key: str, num_dev: int, n_dev: int) -> list[str]:
    """One line for each of train and dev that got fewer examples than asked for, from a train split of ``rows``.

    Not refused: the MeZO protocol's defaults (1,000 + 500) exceed the small tasks' train splits (CB, COPA, WSC),
    and its code takes what is there; the record holds the counts a run used (num_train, num_dev)."""
    out = []
    if n_dev < num_dev:
        out.append(f"{n_dev} dev examples, not the {num_dev} that {dev_key} asks for: the train split has {rows} rows "
                   f"and dev takes at most half of them")
    if n_train < num_train:
        out.append(f"{n_train} train examples, not the {num_train} that data.num_train asks for: the train split has "
                   f"{rows} rows and dev takes {n_dev} of them")
    return out


def kshot_indices(labels: Sequence[int], k: int, seed: int) -> tuple[list[int], list[int]]:
    """LM-BFF's k-shot sampling: shuffle with ``seed``, then per class the first k rows train, the next k dev."""
    order = np.random.RandomState(seed).permutation(len(labels))
    per_class: dict[int, list[int]] = defaultdict(list)
    for i in order:
        per_class[labels[i]].append(int(i))
    classes = sorted(per_class)
    return [i for c in classes for i in per_class[c][:k]], [i for c in classes for i in per_class[c][k : 2 * k]]


def describe_source(train: Rows, test: Rows) -> str:
    """Where the data came from, for the result record; both places when train and test differ (BoolQ offline)."""
    return train.source if train.source == test.source else f"{train.source} (test: {test.source})"


def load_task(task: BoundTask, data: DataConfig, seed: int, need_train: bool = True) -> TaskData:
    """The train, dev and test examples of the task's family's protocol (MeZO or LM-BFF), rendered with its
    template (a masked task is bound with the tokenizer's mask token).

    ``need_train=False`` (zero-shot): a missing train split leaves train and dev empty instead of failing; when the
    split is there, dev is drawn from it exactly as for a training method.
    """

    def make(rows: Rows, idx: Sequence[int]) -> list[Example]:
        examples = [task.render(r, r.get("label", 0)) for r in rows.take(idx)]
        for example, i in zip(examples, idx):  # the source row, for per-example predictions across runs
            example.row = int(i)
        return examples

    spec = task.spec
    train_rows = None
    if need_train or split_available(task, "train", data):
        train_rows = split_rows(task, "train", data)
    else:
        log.info("task %s: no train split; a training-free run goes on without it (and without a dev set drawn "
                 "from it)", spec.name)
    if task.family.kshot_data:
        return _load_kshot(task, data, make, train_rows)
    data_seed = seed if data.seed is None else data.seed
    eval_rows = split_rows(task, "eval", data)
    train: list[Example] = []
    dev: list[Example] = []
    if train_rows is not None:
        order = np.random.RandomState(data_seed).permutation(len(train_rows))
        dev_key, num_dev = ("task.num_dev", spec.num_dev) if spec.num_dev else ("data.num_dev", data.num_dev)
        n_train, n_dev = split_sizes(len(order), data.num_train, num_dev, data.dev_at_most_half)
        train, dev = make(train_rows, order[:n_train]), make(train_rows, order[n_train : n_train + n_dev])
        for line in shortfalls(len(order), data.num_train, n_train, dev_key, num_dev, n_dev):
            log.warning("task %s: %s", spec.name, line)
    # MeZO draws the test subset afresh from the evaluation split with the data seed (its sample_subset on
    # "valid"), not from the stream that drew train and dev: the same seed gives MeZO's test set.
    test = make(eval_rows, sample_indices(len(eval_rows), data.num_eval, np.random.RandomState(data_seed)))
    if len(test) < data.num_eval:  # the protocol's "up to 1,000": the whole of a smaller split, as MeZO does
        log.info("task %s: %d test examples: the whole evaluation split (data.num_eval=%d is an upper bound)",
                 spec.name, len(test), data.num_eval)
    return TaskData(train, dev, test, describe_source(eval_rows if train_rows is None else train_rows, eval_rows))


def _load_kshot(task: BoundTask, data: DataConfig, make: Any, train_rows: Rows | None) -> TaskData:
    """LM-BFF protocol: the k-shot folder as is, or k per class sampled from the Hub (or original local files)."""
    local = task.local
    seed = data.kshot_seed
    train: list[Example] = []
    dev: list[Example] = []
    if data.data_dir and local is not None and local.kshot:
        if train_rows is not None:
            train = make(train_rows, range(len(train_rows)))
        if train_rows is not None or split_available(task, "dev", data):
            dev_rows = split_rows(task, "dev", data)
            dev = make(dev_rows, range(len(dev_rows)))
    elif train_rows is not None:
        train_idx, dev_idx = kshot_indices(train_rows.labels(), data.k, seed)
        train, dev = make(train_rows, train_idx), make(train_rows, dev_idx)
    eval_rows = split_rows(task, "eval", data)
    eval_idx = sample_indices(len(eval_rows), data.num_eval, np.random.RandomState(LMBFF_TEST_SEED))
    source = describe_source(eval_rows if train_rows is None else train_rows, eval_rows)
    return TaskData(train, dev, make(eval_rows, eval_idx), source)
