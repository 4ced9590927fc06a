"""Progress a person can watch: a bar on a terminal, log lines elsewhere, third-party bars only when verbose."""

from __future__ import annotations

import io
import logging

import datasets
from transformers.utils import logging as hf_logging

from adazeta import tracking
from adazeta.run import run
from adazeta.tracking import Progress, quiet_third_party
from helpers import compose_cfg, tiny_overrides


def test_log_lines_carry_step_loss_queries_forwards_dev_accuracy_and_eta(monkeypatch, caplog):
    monkeypatch.setattr(tracking, "show_progress", lambda: False)
    progress = Progress(total=4, every_s=0.0)
    with caplog.at_level(logging.INFO, logger="adazeta"):
        progress.step(1, 0.6931, 1, 2)
        progress.evaluated(2, 0.625)
        progress.step(2, 0.61, 4, 10)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("step 1/4  loss 0.6931  Q 1  fwd 2  eta ")
    assert lines[1].startswith("step 2/4  loss 0.6100  Q 4  fwd 10  dev_acc 0.625@2  eta ")
    assert progress.bar is None
    progress.evaluated(4, 0.5, "f1")  # a generation task's score is F1, and says so
    assert "dev_f1" in progress.fields(4, 0.6, 1, 12) and "dev_acc" not in progress.fields(4, 0.6, 1, 12)


def test_log_lines_are_spaced_in_time(monkeypatch, caplog):
    monkeypatch.setattr(tracking, "show_progress", lambda: False)
    progress = Progress(total=100, every_s=3600.0)
    with caplog.at_level(logging.INFO, logger="adazeta"):
        for step in range(1, 101):
            progress.step(step, 0.5, 1, 2 * step)
    assert [r.getMessage().split()[1] for r in caplog.records] == ["100/100"]  # only the last step's line


def test_a_forward_budget_sets_the_eta_and_the_last_line(monkeypatch, caplog):
    # A budget of 100 forward passes with a step limit nobody reaches: the ETA follows the forwards (half spent
    # after half the time: as much time again), not the 100,000 steps; the line at the budget is printed.
    monkeypatch.setattr(tracking, "show_progress", lambda: False)
    clock = iter([0.0, 10.0, 10.0, 20.0, 20.0, 20.0])
    monkeypatch.setattr(tracking.time, "monotonic", lambda: next(clock))
    progress = Progress(total=100_000, every_s=3600.0, budget=100)
    assert progress.eta(25, 50) == 10.0
    with caplog.at_level(logging.INFO, logger="adazeta"):
        progress.step(25, 0.5, 2, 50)     # not due: no line
        progress.step(50, 0.4, 2, 100)    # the budget is spent: its line is printed
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step 50  loss 0.4000  Q 2  fwd 100/100  eta 0m00s"]


def test_the_step_limit_wins_when_it_comes_first(monkeypatch):
    monkeypatch.setattr(tracking, "show_progress", lambda: False)
    clock = iter([0.0, 10.0])
    monkeypatch.setattr(tracking.time, "monotonic", lambda: next(clock))
    progress = Progress(total=20, budget=1000)
    assert progress.eta(10, 20) == 10.0  # 10 steps of 20 in 10 s; the budget would take 490 s more


def test_a_budgeted_bar_counts_forward_passes(monkeypatch):
    monkeypatch.setattr(tracking, "show_progress", lambda: True)
    progress = Progress(total=100_000, initial=3, budget=64, initial_forwards=12)
    progress.step(4, 0.4, 4, 20)
    assert progress.bar.total == 64 and progress.bar.n == 20
    assert "fwd=20/64" in progress.bar.postfix.replace(" ", "")
    progress.close()


def test_a_terminal_gets_a_bar_with_the_same_fields(monkeypatch):
    monkeypatch.setattr(tracking, "show_progress", lambda: True)
    progress = Progress(total=3, initial=1, every_s=0.0)
    progress.evaluated(1, 0.5)
    progress.step(2, 0.4, 2, 8)
    assert progress.bar is not None and progress.bar.n == 2
    assert progress.bar.postfix.replace(" ", "") == "loss=0.4000,Q=2,fwd=8,dev_acc=0.500@1"
    progress.close()


def test_no_bars_under_ci_or_in_a_sweep(monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv(tracking.PLAIN_PROGRESS_ENV, "1")
    assert not tracking.show_progress()
    monkeypatch.delenv(tracking.PLAIN_PROGRESS_ENV)
    monkeypatch.setenv("CI", "true")
    assert not tracking.show_progress()


def test_third_party_bars_only_when_verbose():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils  # its bar ignores transformers' switch

    try:
        quiet_third_party(False)
        assert not hf_logging.is_progress_bar_enabled() and not datasets.is_progress_bar_enabled()
        assert gguf_utils.tqdm(range(3)).disable
        quiet_third_party(True)
        assert hf_logging.is_progress_bar_enabled() and datasets.is_progress_bar_enabled()
        assert not gguf_utils.tqdm(range(3), file=io.StringIO()).disable
    finally:
        quiet_third_party(False)


def test_a_piped_run_logs_its_progress(fixture_data, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tracking, "show_progress", lambda: False)
    with caplog.at_level(logging.INFO, logger="adazeta"):
        record = run(compose_cfg(tiny_overrides(fixture_data, "method=mezo_lora")), tmp_path / "run")
    assert record["status"] == "finished"
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert steps and steps[-1].startswith("step 4/4  loss ") and "dev_acc" in steps[-1]
