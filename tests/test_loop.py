"""The training loop's shape: a short top-level function made of named pieces, and observers that watch a real
run without changing a number."""

from __future__ import annotations

import ast
import csv
import inspect

from adazeta import train as train_module
from adazeta.run import run
from adazeta.train import Observer
from helpers import compose_cfg, tiny_overrides


def test_the_loop_reads_top_to_bottom_in_sixty_lines_or_fewer():
    node = ast.parse(inspect.getsource(train_module.train)).body[0]
    assert node.end_lineno - node.lineno + 1 <= 60


class Recorder(Observer):
    def __init__(self):
        self.steps, self.evals, self.forwards = [], [], []

    def on_step(self, step, row, optimizer):
        self.steps.append(step)
        self.forwards.append(optimizer.forward_passes)
        assert row["forward_passes"] == optimizer.forward_passes

    def on_eval(self, step, split, result):
        self.evals.append((step, split, round(result.loss, 12)))


def _rows(path):
    with open(path) as f:
        return [{k: v for k, v in r.items() if k not in ("step_time_s", "peak_mem_mb")} for r in csv.DictReader(f)]


def test_observers_see_every_step_and_evaluation_and_change_nothing(fixture_data, tmp_path):
    overrides = tiny_overrides(fixture_data, "method=mezo_lora", "train.max_steps=6", "train.eval_every=3")
    plain = run(compose_cfg(overrides), tmp_path / "plain")
    seen = Recorder()
    watched = run(compose_cfg(overrides), tmp_path / "watched", observers=[seen])
    assert seen.steps == [1, 2, 3, 4, 5, 6] and seen.forwards == [2, 4, 6, 8, 10, 12]
    assert [(s, split) for s, split, _ in seen.evals] == [(0, "dev"), (3, "dev"), (6, "dev"), (watched["best_step"], "test")]
    for name in ("metrics.csv", "eval.csv"):
        assert _rows(tmp_path / "watched" / name) == _rows(tmp_path / "plain" / name)
    assert watched["test_loss"] == plain["test_loss"]
