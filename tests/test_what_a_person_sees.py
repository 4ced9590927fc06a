"""What a person sees: the progress bar and log lines of a run, its last line, its errors, the folders it leaves,
its figures and its --help page."""

from __future__ import annotations

import io
import logging
import sys
from types import SimpleNamespace

import pytest

from adazeta import tracking
from adazeta.errors import ConfigError
from adazeta.run import run
from adazeta.tracking import Progress
from helpers import compose_cfg, study_script, tiny_overrides


def run_cli(monkeypatch, capsys, args: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``adazeta-run args``, run in this process."""
    from adazeta import cli

    monkeypatch.setattr(sys, "argv", ["adazeta-run", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


# --- the training bar and log lines ------------------------------------------------------------------------------

def test_the_bar_shows_the_fields_of_the_step_it_counts(monkeypatch):
    # tqdm redraws the line in update(): fields set after it showed the step before (at 2/3: fwd=2, not 4).
    monkeypatch.setattr(tracking, "show_progress", lambda: True)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)  # where the bar draws
    progress = Progress(total=3)
    progress.bar.mininterval = 0  # redraw on every step, as a slow real step does
    progress.step(1, 0.5, 1, 2)
    progress.step(2, 0.4, 1, 4)
    line = out.getvalue().split("\r")[-1]
    assert "2/3" in line and "fwd=4" in line and "loss=0.4000" in line, line
    progress.evaluated(2, 0.575, "accuracy", 1.31, 2)  # the evaluation after step 2 shows at once, not at step 3
    line = out.getvalue().split("\r")[-1]
    assert "2/3" in line and "dev_loss=1.3100" in line and "dev_acc=0.575@2" in line, line
    progress.close()


def test_the_fields_name_the_dev_loss_and_what_chooses_the_kept_state(monkeypatch, caplog):
    monkeypatch.setattr(tracking, "show_progress", lambda: False)
    progress = Progress(total=10, every_s=0.0)
    with caplog.at_level(logging.INFO, logger="adazeta"):
        progress.step(1, 0.7, 1, 2)
        progress.evaluated(2, 0.575, "accuracy", 1.31, 2)
        progress.step(3, 0.6, 1, 6)
    line = caplog.records[-1].getMessage()
    assert "dev_loss 1.3100  dev_acc 0.575@2  best loss@2" in line, line
    on_metric = Progress(total=10, every_s=0.0, select_on="metric")
    on_metric.evaluated(4, 0.6, "accuracy", 1.4, 2)
    assert on_metric.fields(5, 0.5, 1, 10)["best"] == "acc@2"


def test_the_last_line_shows_the_dev_loss_that_chose_the_state(tmp_path):
    from adazeta.run import summary_line

    result = lambda loss, score: SimpleNamespace(loss=loss, score=score)  # noqa: E731
    outcome = SimpleNamespace(status="finished", steps=400, best_step=200, initial_dev=result(1.56, 0.575),
                              best_dev=result(1.31, 0.575), test=result(1.2, 0.6))
    line = summary_line(outcome, "accuracy", "loss", tmp_path)
    assert line.startswith("finished after 400 steps (best dev step 200, chosen on dev loss): dev loss 1.5600 -> "
                           "1.3100, dev accuracy 0.5750 -> 0.5750, test accuracy 0.6000"), line
    assert "chosen on dev accuracy" in summary_line(outcome, "accuracy", "metric", tmp_path)


# --- evaluations in a log file -----------------------------------------------------------------------------------

def test_a_logged_run_says_when_each_evaluation_starts_and_ends(fixture_data, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tracking, "show_progress", lambda: False)  # stdout is a file: no bars
    with caplog.at_level(logging.INFO, logger="adazeta"):
        record = run(compose_cfg(tiny_overrides(fixture_data, "method=mezo_lora", "train.eval_batch_size=4")),
                     tmp_path / "run")
    assert record["status"] == "finished"
    lines = [r.getMessage() for r in caplog.records]
    assert "dev@0: evaluating 16 examples (4 batches)" in lines
    assert any(line.startswith("dev@0: 16 examples in ") and "loss " in line and "accuracy " in line for line in lines)
    assert any(line.startswith("test: 16 examples in ") for line in lines)
    assert not any("examples after" in line for line in lines)  # quick evaluations: no progress lines
    summary = lines[-1]
    assert "chosen on dev loss" in summary and "dev loss " in summary and " -> " in summary, summary


def test_a_long_evaluation_logs_its_progress(fixture_data, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tracking, "show_progress", lambda: False)
    monkeypatch.setattr(tracking, "EVAL_LINES_EVERY_S", 0.0)  # as if every batch took longer than the period
    with caplog.at_level(logging.INFO, logger="adazeta"):
        run(compose_cfg(tiny_overrides(fixture_data, "method=zero_shot", "train.eval_batch_size=4")), tmp_path / "run")
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("test: ") and "after" in
                r.getMessage()]
    assert [p.split(" after")[0] for p in progress] == ["test: 4/16 examples", "test: 8/16 examples",
                                                        "test: 12/16 examples"], progress
    assert all("left" in p for p in progress)


def test_a_terminal_gets_bars_not_evaluation_lines(fixture_data, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tracking, "show_progress", lambda: True)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="adazeta"):
        run(compose_cfg(tiny_overrides(fixture_data, "method=zero_shot")), tmp_path / "run")
    assert not any("evaluating" in r.getMessage() for r in caplog.records)


# --- a missing local model -----------------------------------------------------------------------------------------

def test_a_model_dir_without_the_model_fails_at_once_without_the_hub(tmp_path, monkeypatch):
    import transformers

    from adazeta.models import ModelConfig, complete_config

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: pytest.fail(f"looked for the model config at {a[0]}"))
    cfg = ModelConfig(name="hf", family=None, hub_id="google/gemma-3-270m", model_dir=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        complete_config(cfg)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message
    assert f"{tmp_path / 'gemma-3-270m'}" in message and "model.local_name=gemma-3-270m" in message
    named = ModelConfig(name="hf", family=None, hub_id="google/gemma-3-270m", local_name="gemma",
                        model_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=f"model file not found: {tmp_path / 'gemma' / 'config.json'}"):
        complete_config(named)


def test_the_command_names_the_folder_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADAZETA_MODEL_DIR", str(tmp_path / "models"))
    (tmp_path / "models").mkdir()
    code, _, err = run_cli(monkeypatch, capsys, ["model=hf", "model.hub_id=google/gemma-3-270m", "dry_run=true",
                                                 f"hydra.run.dir={tmp_path / 'run'}"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and str(tmp_path / "models" / "gemma-3-270m") in lines[0], err


# --- folders left behind -------------------------------------------------------------------------------------------

def test_a_dry_run_leaves_no_folder(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "outputs" / "sst2" / "run"
    code, out, err = run_cli(monkeypatch, capsys, ["model=tiny-llama", "dry_run=true", f"hydra.run.dir={run_dir}"])
    assert code == 0 and "trainable params" in out, err
    assert not (tmp_path / "outputs").exists()


def test_a_run_refused_at_its_start_leaves_no_folder(tmp_path, monkeypatch, capsys, fixture_data):
    # A model file that is missing is found once the run starts, after Hydra made the run directory.
    run_dir = tmp_path / "outputs" / "run"
    code, _, err = run_cli(monkeypatch, capsys, [f"model.model_dir={tmp_path / 'models'}", f"data.dir={fixture_data}",
                                                 f"hydra.run.dir={run_dir}"])
    assert code == 2 and "model file not found" in err, err
    assert not (tmp_path / "outputs").exists()


def test_what_existed_before_is_never_removed(tmp_path, monkeypatch, capsys):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "cli.log").write_text("")  # an earlier command's empty log
    (tmp_path / "empty").mkdir()  # an empty folder above the run directory
    for run_dir in (kept, tmp_path / "empty" / "run"):
        code, _, err = run_cli(monkeypatch, capsys, ["model=tiny-llama", "dry_run=true", f"hydra.run.dir={run_dir}"])
        assert code == 0, err
    assert (kept / "cli.log").is_file() and (tmp_path / "empty").is_dir()
    assert not (tmp_path / "empty" / "run").exists()


def test_a_run_keeps_its_folder(fixture_data, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    code, _, err = run_cli(monkeypatch, capsys, [*tiny_overrides(fixture_data), "train.max_steps=1",
                                                 f"hydra.run.dir={run_dir}"])
    assert code == 0, err
    assert (run_dir / "result.json").is_file()


# --- fewer examples than asked for -------------------------------------------------------------------------------

def test_asking_for_more_examples_than_a_split_has_is_said_and_recorded(fixture_data, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tracking, "show_progress", lambda: False)
    overrides = tiny_overrides(fixture_data, "data.num_train=1000", "data.num_dev=500", "train.max_steps=1",
                               "method=mezo_lora")
    with caplog.at_level(logging.INFO, logger="adazeta"):
        record = run(compose_cfg(overrides), tmp_path / "run")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # The fixture's RTE train split has 120 rows: dev takes half, train the rest.
    assert ("task rte: 60 dev examples, not the 500 that data.num_dev asks for: the train split has 120 rows and dev "
            "takes at most half of them") in warnings, warnings
    assert ("task rte: 60 train examples, not the 1000 that data.num_train asks for: the train split has 120 rows "
            "and dev takes 60 of them") in warnings, warnings
    assert (record["num_train"], record["num_dev"]) == (60, 60)
    assert record["config"]["data"]["num_train"] == 1000  # what was asked stays in the config


def test_enough_rows_no_warning(fixture_data, tmp_path, caplog):
    from adazeta.settings import parse
    from adazeta.tasks.loaders import load_task

    s = parse(compose_cfg(tiny_overrides(fixture_data)))
    with caplog.at_level(logging.INFO, logger="adazeta"):
        data = load_task(s.bound_task(), s.data, 0)
    assert (len(data.train), len(data.dev)) == (32, 16)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --- figures -------------------------------------------------------------------------------------------------------

def _memory_csv(path, methods):
    import pandas as pd

    pd.DataFrame({"method": methods, "peak_mem_mb": [1000.0 + 50 * i for i in range(len(methods))]}).to_csv(
        path, index=False)
    return path


def _make_figures(monkeypatch, *args: str) -> None:
    from adazeta.tools import make_figures

    monkeypatch.setattr(sys, "argv", ["make_figures", *args])
    make_figures.main()


def test_make_figures_rewrites_a_figure_only_when_its_picture_changes(tmp_path, monkeypatch, capsys):
    memory = _memory_csv(tmp_path / "memory.csv", ["inference", "mezo", "adazeta"])
    args = ["--results", str(tmp_path / "none"), "--memory", str(memory), "--out", str(tmp_path / "figures")]
    _make_figures(monkeypatch, *args)
    figure = tmp_path / "figures" / "memory.png"
    stamp, data = figure.stat().st_mtime_ns, figure.read_bytes()
    _make_figures(monkeypatch, *args)
    assert figure.stat().st_mtime_ns == stamp  # the same results: the (committed) file is left alone
    assert "unchanged" in capsys.readouterr().out
    _memory_csv(memory, ["inference", "mezo", "mezo_lora"])
    _make_figures(monkeypatch, *args)
    assert figure.read_bytes() != data  # other results: a new picture


def test_make_figures_writes_where_nothing_is_committed_unless_told(tmp_path, monkeypatch):
    from helpers import ROOT

    memory = _memory_csv(tmp_path / "memory.csv", ["inference", "mezo"])
    monkeypatch.chdir(tmp_path)
    _make_figures(monkeypatch, "--results", str(tmp_path / "none"), "--memory", str(memory))
    assert (tmp_path / "outputs" / "figures" / "memory.png").is_file()
    assert "outputs/" in (ROOT / ".gitignore").read_text().split()
    assert "FIGURES ?= outputs/figures" in (ROOT / "Makefile").read_text()


def test_the_memory_chart_names_do_not_overlap():
    from adazeta.tools.plots import memory_figure
    import pandas as pd

    methods = ["inference", "ft", "lora", "mezo", "sparse_mezo", "mezo_lora", "mezo_adapter", "adazeta", "tt_adapter",
               "zero_shot", "icl", "lp"]
    fig = memory_figure(pd.DataFrame({"method": methods, "peak_mem_mb": [1000.0] * len(methods)}))
    renderer = fig.canvas.get_renderer()
    labels = fig.axes[0].get_xticklabels()
    assert [t.get_text() for t in labels] == methods
    flat = [t for t in labels if t.get_rotation() == 0]
    if flat:  # written flat: their boxes must not touch
        boxes = [t.get_window_extent(renderer) for t in labels]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    else:  # slanted alike: neighbours' lines must lie at least a line's height apart
        import math

        angle = math.radians(labels[0].get_rotation())
        xs = [t.get_window_extent(renderer).x1 for t in labels]  # right-aligned: each ends at its tick
        gap = min(b - a for a, b in zip(xs, xs[1:])) * math.sin(angle)
        height = max(renderer.get_text_width_height_descent(t.get_text(), t.get_fontproperties(), ismath=False)[1]
                     for t in labels)
        assert gap >= height, (gap, height)


def _run(method, losses, status="finished", seed=0):
    import pandas as pd

    steps = list(range(0, 10 * len(losses), 10))
    dev = pd.DataFrame({"step": steps, "loss": losses, "forward_passes": [2 * s for s in steps]})
    metrics = pd.DataFrame({"step": steps[1:], "forward_passes": [2 * s for s in steps[1:]],
                            "n_queries": [1] * (len(steps) - 1)})
    return {"record": {"method": method, "status": status, "seed": seed}, "metrics": metrics, "dev": dev}


def test_each_method_keeps_one_colour_of_its_own_in_every_chart():
    from matplotlib.colors import to_hex

    from adazeta.tools.plots import convergence_figure, method_colors

    methods = ["adazeta", "ft", "lora", "mezo", "mezo_lora", "sparse_mezo", "tt_q1", "ada_official", "zero_shot_cc"]
    fig = convergence_figure([_run(m, [1.0, 0.9, 0.8]) for m in methods], "t")
    colours = {line.get_label().split(" (")[0]: to_hex(line.get_color()) for line in fig.axes[0].get_lines()
               if not line.get_label().startswith("_")}
    assert sorted(colours) == sorted(methods)
    assert len(set(colours.values())) == len(methods), colours  # no two methods share a colour
    other = convergence_figure([_run(m, [1.0, 0.9]) for m in ["mezo_lora", "tt_q1", "ft"]], "t")
    again = {line.get_label().split(" (")[0]: to_hex(line.get_color()) for line in other.axes[0].get_lines()
             if not line.get_label().startswith("_")}
    assert all(again[m] == colours[m] for m in again)  # the same colour in another chart
    assert len(set(method_colors([f"arm{i}" for i in range(8)]).values())) == 8


def test_a_diverged_run_does_not_set_the_loss_scale(monkeypatch, tmp_path):
    cpu_zo_report = study_script("cpu_zo")
    from adazeta.tools.plots import convergence_figure

    fig = convergence_figure([_run("mezo_lora", [1.0, 0.8, 0.7]), _run("mezo", [1.0, 0.9, 0.8]),
                              _run("mezo", [1.0, 4.0, 31.0], "diverged", seed=1)], "t")
    assert fig.axes[0].get_ylim()[1] < 1.5  # set by the runs that did not diverge, not 0 to 30

    records = {
        (arm, lr): {"status": status, "curve": [(0, 1.0, 0.5), (100, loss, 0.6), (200, loss2, 0.6)]}
        for arm, lr, status, loss, loss2 in [("mezo", 1e-5, "finished", 0.8, 0.7), ("mezo", 1e-4, "diverged", 3.8, 31.0),
                                             ("mezo_lora", 1e-3, "finished", 0.9, 0.6)]
    }
    monkeypatch.setattr(cpu_zo_report, "load", lambda run_dir: records.get((run_dir.parent.name, float(
        run_dir.name.split(",")[0].split("=")[1]))))
    from adazeta.experiments import Arm

    arms = {"mezo": Arm("mezo", ("method=mezo",), (1e-5, 1e-4)), "mezo_lora": Arm("mezo_lora", ("method=mezo_lora",), (1e-3,))}
    fig = cpu_zo_report.plot_grids("grid", ["mezo", "mezo_lora"], arms, 0, tmp_path / "grid.png")
    low, high = fig.axes[0].get_ylim()
    assert high < 1.5 and low < 0.6, (low, high)
    marks = [line for line in fig.axes[0].get_lines() if line.get_marker() == "^"]
    assert marks and max(marks[0].get_ydata()) == pytest.approx(high)  # the diverged run, marked at the top
    assert "31" in " ".join(t.get_text() for t in fig.axes[0].texts)  # with the highest loss it reached


# --- adazeta-run --help --------------------------------------------------------------------------------------------

def test_help_is_a_page_to_read(monkeypatch, capsys):
    import itertools
    import re

    from helpers import CONF, ROOT

    code, page, err = run_cli(monkeypatch, capsys, ["--help"])
    assert code == 0, err
    lines = page.splitlines()
    assert len(lines) < 120, len(lines)
    assert lines[0].startswith("adazeta-run: ") and "Usage" in lines
    assert "experiment_method" not in page and "hub_id: " not in page and "placements:" not in page  # no dump
    for group in ("model", "task", "method", "schedule", "experiment", "adapter", "optimizer"):  # all options
        first, *rest = page.split(f"\n  {group:<12}")[1].split("\n")
        text = " ".join([first, *itertools.takewhile(lambda line: line.startswith(" " * 14), rest)])  # its lines
        assert all(option.stem in text for option in (CONF / group).glob("*.yaml")), group
    # Every key of the run-level blocks, and every key the getting-started page lists, with a line of its own.
    from helpers import compose_cfg

    cfg = compose_cfg([])
    keys = [f"{block}.{key}" for block in ("train", "data", "guard", "divergence", "wandb") for key in cfg[block]]
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    documented = re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)`", guide.split("Run-level keys:")[1].split("\n\n")[0])
    assert "method.adapter.init" in documented and "train.max_steps" in documented
    missing = [key for key in keys + documented if not re.search(rf"(^|[ ,]){re.escape(key)}( |,|$)", page, re.M)]
    assert not missing, missing
    for status in ("0  ", "1  ", "2  ", "128+n"):
        assert f"\n  {status}" in page.split("== Exit status ==")[1]
    assert "README.md" in page


def test_help_stars_what_the_command_would_use(monkeypatch, capsys):
    code, page, err = run_cli(monkeypatch, capsys, ["--help", "method=mezo", "task=rte"])
    assert code == 0, err
    assert "*mezo," in page and "*rte," in page and "*constant" in page and "*adaptive" not in page


def test_help_lists_the_options_of_a_users_config_dir(tmp_path, monkeypatch, capsys):
    from helpers import ROOT

    (tmp_path / "method").mkdir()
    (tmp_path / "method" / "mine.yaml").write_text(
        (ROOT / "conf" / "method" / "mezo.yaml").read_text().replace("name: mezo", "name: mine"))
    code, page, err = run_cli(monkeypatch, capsys, ["--config-dir", str(tmp_path), "--help"])
    assert code == 0, err
    assert " mine" in page.split("\n  method")[1].split("\n  schedule")[0]
