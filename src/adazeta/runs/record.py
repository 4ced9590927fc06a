"""A run's record (``result.json``), typed: what ran, what it used, what it measured, in the order it is written.

``execute`` fills one ``RunRecord`` as the run goes, from what was built (``adazeta.build.Built.record_fields``) and
what happened (``adazeta.train.Outcome.record_fields``); ``as_dict`` is what ``result.json`` holds. A field left at
``UNSET`` is not written: an interrupted run has no test fields, a run without demonstrations no
``demonstrations``, a run that failed while loading only the fields it had reached. ``None`` is written as
``null`` (a run without a dev set has a null ``dev_loss``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adazeta.errors import ConfigError


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


# A run that ended with a result: rerunning the same settings would give it again, so drivers skip it and its
# checkpoint goes. A diverged or stalled run is a result (its best-dev state was tested), not a failure.
ENDED = ("finished", "diverged", "stalled")


@dataclass
class RunRecord:
    # What ran.
    method: str
    task: str
    task_version: Any
    model: str
    seed: int
    experiment: str | None
    status: str = "failed"  # finished | diverged | stalled | interrupted | failed (until the run says otherwise)
    resumed_from_step: int = UNSET  # continued from a checkpoint written at this step
    demonstrations: float = UNSET  # ICL: mean demonstrations per test prompt
    # What it used.
    total_params: int = UNSET
    trainable_params: int = UNSET
    num_train: int = UNSET
    num_dev: int = UNSET
    num_eval: int = UNSET
    data_source: str = UNSET
    model_source: dict[str, Any] = UNSET
    truncated: dict[str, int] = UNSET  # examples cut to fit model.max_length, per split
    schedule_epochs: float = UNSET  # E of the query schedule, when a forward-pass budget decided it
    mean_queries: float = UNSET  # ZO: the schedule's mean Q over the planned steps
    zo: dict[str, Any] = UNSET  # ZO: estimator, batched_queries, query_chunk
    scoring_layout: str = UNSET  # packed | rows
    world_size: int = UNSET
    parallel: str = UNSET  # none | zo:auto | zo:query | zo:data | ddp
    backend: str = UNSET  # several processes: gloo | nccl
    devices: list[str] = UNSET  # model.device_map: the devices the model was spread over
    probe: dict[str, Any] = UNSET  # linear probing: the probe's fit
    calibration: dict[str, Any] = UNSET  # calibrated zero-shot / ICL: kind, bias per candidate, how it was fitted
    # What it measured.
    metric: str = UNSET  # the task's main metric: accuracy, or f1 for generation tasks (names the *_score keys)
    reason: str | None = UNSET  # why it ended as it did (divergence rule, signal, error), or None
    steps: int = UNSET
    best_step: int = UNSET
    initial_dev_loss: float | None = UNSET
    initial_dev_score: float | None = UNSET  # written as initial_dev_<metric>, as are dev_ and test_score
    dev_loss: float | None = UNSET
    dev_score: float | None = UNSET
    forward_passes: int = UNSET
    device: dict[str, Any] = UNSET
    peak_mem_mb: float = UNSET
    dev_metrics: dict[str, float] = field(default_factory=dict)  # written as dev_<name>: f1, em
    # How much the kept dev evaluation's answers depend on the input (adazeta.scoring.evaluate.Dependence: the most common
    # answer's share, the gold labels' share of it, the score gap's spread); test_dependence the same for test.
    dev_dependence: dict[str, Any] = UNSET
    # interrupted: the signal that stopped it; finished, diverged: a signal that came during the final evaluation,
    # which finished first (the command still exits with the signal's status)
    signal: str | None = UNSET
    checkpoint_step: int | None = UNSET  # interrupted, failed: the checkpoint's step the same command resumes from;
    # null: no checkpoint, the same command starts the run over
    test_loss: float = UNSET
    test_score: float = UNSET
    test_metrics: dict[str, float] = field(default_factory=dict)  # written as test_<name>
    test_dependence: dict[str, Any] = UNSET
    # Provenance, written last.
    wall_time_s: float = UNSET  # over every invocation; a resumed one adds its time to its checkpoint's
    git: dict[str, Any] = UNSET
    packages: dict[str, str] = UNSET
    config: dict[str, Any] = UNSET

    def update(self, **fields: Any) -> None:
        """Set ``fields`` (``Built.record_fields``: what was built; ``Outcome.record_fields``: what happened); a name
        the record has no field for is an error, not a key that silently never reaches result.json."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise AttributeError(f"RunRecord has no field {', '.join(unknown)}")
        for name, value in fields.items():
            setattr(self, name, value)

    def as_dict(self) -> dict[str, Any]:
        """``result.json``'s contents: the fields that were set, metric dicts spread into their own keys."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("dev_metrics", "test_metrics"):
                out.update({f"{f.name.split('_')[0]}_{k}": v for k, v in value.items()})
            elif value is not UNSET and f.name.endswith("_score"):
                out[f.name.removesuffix("score") + (self.metric if self.metric is not UNSET else "accuracy")] = value
            elif value is not UNSET:
                out[f.name] = value
        return out


def resume_hint(record: dict[str, Any]) -> str:
    """What the same command does with an interrupted (or failed) run, as its record says: resume, or start over."""
    step = record.get("checkpoint_step")
    if step is None:
        return "no checkpoint was written, so the same command starts the run over"
    return f"run the same command again to resume from its checkpoint at step {step}"


def main_score(record: dict[str, Any], split: str) -> Any:
    """A ``result.json``'s main metric for ``split`` (``dev``, ``test`` or ``initial_dev``): ``<split>_<metric>``,
    accuracy unless the record names another metric (F1 for generation tasks); None when absent."""
    return record.get(f"{split}_{record.get('metric') or 'accuracy'}")


def read_record(path: Path) -> dict[str, Any] | None:
    """The ``result.json`` at ``path`` (a run directory or the file): None when the run has none yet.

    A file that is not a JSON object (a run cut while writing it, an edit) is a ConfigError naming it: tables and
    reports never drop a run silently.
    """
    path = Path(path)
    file = path / "result.json" if path.is_dir() else path
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"cannot read {file}: {err.strerror}") from None
    try:
        record = json.loads(text)
    except ValueError as err:
        record = err
    if not isinstance(record, dict):
        why = f" ({record})" if isinstance(record, ValueError) else ""
        raise ConfigError(f"{file} is not a run record{why}; rerun that run (force=true) or move its folder away")
    return record
