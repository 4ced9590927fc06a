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


STATUSES = {"finished", "diverged", "stalled", "interrupted"}


def assigned_attributes(node: ast.AST) -> set[str]:
    """The attribute names ``node`` assigns (``x.a = ...``, ``x.a += ...``, ``x.a, x.b = ...``)."""
    targets = [t for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets]
    targets += [n.target for n in ast.walk(node) if isinstance(n, (ast.AugAssign, ast.AnnAssign))]
    flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return {t.attr for t in flat if isinstance(t, ast.Attribute)}


def test_the_loop_has_one_exit_and_never_decides_a_status():
    """``train()`` returns once, as its last statement, and names no status: each ending is decided by the piece
    that saw it (``Ending``: the step's guards, the budget, a stop signal; ``LoopState.finish`` turns it into the
    run's outcome)."""
    node = ast.parse(inspect.getsource(train_module.train)).body[0]
    returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
    assert len(returns) == 1 and node.body[-1] is returns[0]
    assert not assigned_attributes(node) & {"status", "reason"}
    named = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not named & STATUSES


def test_the_loop_state_holds_pieces_that_own_their_fields():
    """The kept state (``Kept``), the position (``Position``) and a resume (``Resume``) own their fields: no
    method of ``LoopState`` assigns one of theirs, or a status, on itself."""
    owned = {"step", "forward_passes", "max_steps", "budget", "best", "best_step", "best_state", "initial", "state",
             "done", "first_step", "status", "reason"}
    node = ast.parse(inspect.getsource(train_module.LoopState)).body[0]
    own = {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
           for t in ([*n.targets] if isinstance(n, ast.Assign) else [n.target])
           for t in (t.elts if isinstance(t, ast.Tuple) else [t])
           if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert own and not own & owned, own & owned


def test_the_assignment_reader_sees_every_form():
    source = "a.status = 1\nb.reason += 'x'\nc.x, d.y = 1, 2\ne.z: int = 3\nf = 4\n"
    assert assigned_attributes(ast.parse(source)) == {"status", "reason", "x", "y", "z"}


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
