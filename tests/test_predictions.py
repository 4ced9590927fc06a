"""Per-example predictions: every run writes predictions/dev.csv (at the best-dev state) and predictions/test.csv,
in the split's order, and they agree with the run's own aggregate scores."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from adazeta.run import run
from helpers import compose_cfg, tiny_overrides


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def eval_row(run_dir: Path, split: str, step: int | None = None) -> dict[str, str]:
    rows = [r for r in read_rows(run_dir / "eval.csv") if r["split"] == split]
    return rows[-1] if step is None else next(r for r in rows if int(r["step"]) == step)


@pytest.mark.parametrize("method", ["adazeta", "ft", "zero_shot", "lp"])
def test_predictions_match_the_runs_own_scores(method, fixture_data, tmp_path):
    record = run(compose_cfg(tiny_overrides(fixture_data, f"method={method}")), tmp_path)
    for split, count in (("dev", record["num_dev"]), ("test", record["num_eval"])):
        rows = read_rows(tmp_path / "predictions" / f"{split}.csv")
        assert [int(r["index"]) for r in rows] == list(range(count))
        accuracy = sum(int(r["correct"]) for r in rows) / len(rows)
        expected = record["dev_accuracy"] if split == "dev" else record["test_accuracy"]
        assert accuracy == pytest.approx(expected, abs=1e-12)
        for r in rows:
            scores = [float(r[k]) for k in r if k.startswith("score_") and r[k] != ""]
            assert len(scores) >= 2 and all(math.isfinite(v) for v in scores)
            assert int(r["pred"]) == scores.index(max(scores))
            assert int(r["correct"]) == int(int(r["pred"]) == int(r["gold"]))
        # the mean loss of the kept scores is the split's logged loss (cross-entropy over the candidates)
        if method != "lp":
            losses = []
            for r in rows:
                s = [float(r[k]) for k in r if k.startswith("score_") and r[k] != ""]
                top = max(s)
                losses.append(top + math.log(sum(math.exp(v - top) for v in s)) - s[int(r["gold"])])
            logged = eval_row(tmp_path, split, record["best_step"] if split == "dev" else None)
            assert sum(losses) / len(losses) == pytest.approx(float(logged["loss"]), rel=1e-5)


def test_rows_name_the_source_examples_and_repeat_across_seeds(fixture_data, tmp_path):
    """With data.seed fixed, two run seeds score the same examples: the paired comparisons rely on it."""
    a = run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "seed=1", "data.seed=5")), tmp_path / "a")
    b = run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "seed=2", "data.seed=5")), tmp_path / "b")
    c = run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "seed=2", "data.seed=6")), tmp_path / "c")
    assert a["status"] == b["status"] == c["status"] == "finished"
    for split in ("dev", "test"):
        rows = {k: read_rows(tmp_path / k / "predictions" / f"{split}.csv") for k in "abc"}
        assert [r["row"] for r in rows["a"]] == [r["row"] for r in rows["b"]]
        assert [r["gold"] for r in rows["a"]] == [r["gold"] for r in rows["b"]]
        assert len({r["row"] for r in rows["a"]}) == len(rows["a"])  # distinct source rows
    assert [r["row"] for r in read_rows(tmp_path / "a" / "predictions" / "dev.csv")] != \
        [r["row"] for r in read_rows(tmp_path / "c" / "predictions" / "dev.csv")]


def test_predictions_of_a_sorted_evaluation_come_back_in_split_order():
    import torch

    from adazeta.scoring.evaluate import gather_predictions
    from adazeta.scoring import Batch

    def batch(index, gold, slots, max_c):
        z = torch.zeros(0, dtype=torch.long)
        return Batch(z, z, z, z, z, z, torch.zeros(len(slots)), torch.tensor(slots), torch.tensor(gold), max_c,
                     index=tuple(index))

    # two batches, split positions 2, 0 then 1; example at position 0 has 3 candidates, the others 2
    b1 = batch([2, 0], [1, 2], [0, 1, 3, 4, 5], 3)
    b2 = batch([1], [0], [0, 1], 2)
    s1 = torch.tensor([[0.1, 0.5, float("-inf")], [0.3, 0.2, 0.9]])
    s2 = torch.tensor([[0.4, -1.0]])
    p = gather_predictions([(b1, s1), (b2, s2)], 3)
    assert p.gold == [2, 0, 1] and p.pred == [2, 0, 1]
    assert p.scores[0] == pytest.approx([0.3, 0.2, 0.9]) and p.scores[2] == pytest.approx([0.1, 0.5])
    assert p.correct == [1.0, 1.0, 1.0]


def test_a_runs_code_is_dirty_only_when_its_code_or_config_changed(tmp_path):
    """A driver appends to a committed results/.../launches.csv as it launches runs: that must not mark them dirty."""
    import subprocess

    from adazeta.runs.results import git_state

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    for name in ("src/pkg/code.py", "conf/config.yaml", "results/launches.csv", "README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("one\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    where = tmp_path / "src" / "pkg"
    assert git_state(where)["dirty"] is False
    for name in ("results/launches.csv", "README.md"):
        (tmp_path / name).write_text("two\n")
    (tmp_path / "src" / "pkg" / "new_untracked.py").write_text("")
    assert git_state(where)["dirty"] is False
    (tmp_path / "conf" / "config.yaml").write_text("two\n")
    assert git_state(where)["dirty"] is True
