"""adazeta.tools.diagnose_zo watches a real run through the loop's observers: its rows are the run's own."""

from __future__ import annotations

import csv

from adazeta.tools import diagnose_zo
from helpers import tiny_overrides


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_diagnosis_rows_are_the_runs_steps_with_probes_at_each_evaluation(fixture_data, tmp_path):
    out = diagnose_zo.main(["--steps", "4", "--eval-every", "2", "--out", str(tmp_path / "diag.csv"), "--",
                            *tiny_overrides(fixture_data, "method=adazeta", "schedule=constant")])
    rows, metrics = _rows(out), _rows(tmp_path / "diag_run" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]
    for row, step in zip(rows[1:], metrics):  # the run's own steps, not a copy of its loop
        assert row["loss"] == step["loss"] and row["forward_passes"] == step["forward_passes"]
        assert float(row["update_norm"]) > 0
    dev = [r for r in _rows(tmp_path / "diag_run" / "eval.csv") if r["split"] == "dev"]
    evaluated = [r for r in rows if r["dev_loss"]]
    assert [int(r["step"]) for r in evaluated] == [int(r["step"]) for r in dev] == [0, 2, 4]
    for row, d in zip(evaluated, dev):
        assert abs(float(row["dev_loss"]) - float(d["loss"])) < 1e-9
        assert float(row["final_norm_input_rms"]) > 0 and float(row["max_adapter_gain"]) >= 0
