"""Experiments: configs compose, sweeps run and skip finished runs, tables select on dev and aggregate seeds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from adazeta.settings import parse
from adazeta.errors import ConfigError
from adazeta.tools.tables import build_table, load_paper_numbers, load_results, select_on_dev, to_latex, to_markdown
from helpers import CONF, ROOT, compose_cfg
from test_cli import ENV

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    s = parse(compose_cfg([f"experiment={name}"]))
    assert s.experiment == name


def sweep_params(overrides: list[str]) -> dict:
    """The Hydra sweeper params an experiment composes to (what `adazeta-run -m` sweeps)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    return {k: str(v) for k, v in cfg.hydra.sweeper.params.items()}


# What the AdaZeta reference scripts pass (large_models/run_all_large_exp.sh, mezo.sh, finetune.sh):
# method -> (lr, weight decay), eps 1e-3 on every ZO run.
TABLE2_REFERENCE = {
    "adazeta": (1e-4, 0.01),
    "mezo": (5e-7, 0.01),
    "mezo_lora": (1e-4, 0.01),
    "sparse_mezo": (1e-6, 0.0),  # never launched by the scripts: not their lr; our sparse update takes no decay
    "ft": (1e-5, 0.0),
}
TABLE2_METHODS = ["zero_shot", "icl", "lp", "ft", "lora", "mezo", "mezo_lora", "sparse_mezo", "adazeta"]


def queries(s) -> list[int]:
    """Q at every epoch of a 10,000-step run on 1,000 examples at batch 16 (E = 160)."""
    from adazeta.schedules import SCHEDULES

    schedule = SCHEDULES.get(s.schedule.kind).builder(s.schedule.config, 160.0)
    return [schedule(e) for e in range(160)]


@pytest.mark.parametrize("method", TABLE2_METHODS)
def test_table2_composes_to_what_the_reference_scripts_ran(method):
    s = parse(compose_cfg(["experiment=table2_llama", f"method={method}", "task=rte"]))
    first_order = method in ("ft", "lora")
    assert s.model.name == "llama2-7b" and s.seed == 0 and s.experiment == "table2_llama"
    assert (s.train.max_steps, s.train.batch_size, s.train.eval_every) == ((189 if first_order else 10000), 16, 200)
    assert (s.data.num_train, s.data.num_dev, s.data.num_eval) == (1000, 500, 1000)
    if method in TABLE2_REFERENCE:
        lr, weight_decay = TABLE2_REFERENCE[method]
        assert (s.optimizer.config.lr, s.optimizer.config.weight_decay) == (lr, weight_decay)
    if s.optimizer is not None and s.optimizer.kind != "adamw":  # every ZO method
        assert s.optimizer.config.eps == 1e-3
        arms = compose_cfg(["experiment=table2_llama"]).arms
        assert s.optimizer.config.lr in arms[method].lr  # the arm's lr grid holds the reference lr
    if method == "adazeta":
        # The reference code's schedule (SHRINK 0.85, NUM 20, NUM_MAX 15): beta derived from E, Q capped at 15.
        assert s.schedule.kind == "adaptive_official"
        assert (s.schedule.config.alpha, s.schedule.config.q_target, s.schedule.config.q_cap) == (0.85, 20, 15)
        q = queries(s)
        assert q[0] == 1 and max(q) == 15 and q == sorted(q)
    elif method in ("mezo", "mezo_lora", "sparse_mezo"):
        assert set(queries(s)) == {1}  # the MeZO trainer: one query per step
    if method == "mezo_lora":
        assert (s.adapter.config.r, s.adapter.config.alpha) == (5, 16)  # run.py:677 copies RANK=5 into lora_r
    if method == "sparse_mezo":
        assert (s.optimizer.config.mask, s.optimizer.config.sparsity) == ("random", 0.75)  # trainer_sparse.py


def test_table2_sweeps_every_method_and_task_and_its_ablation_changes_only_the_schedule():
    params = sweep_params(["experiment=table2_llama"])
    assert params["method"].split(",") == TABLE2_METHODS and params["seed"] == "0"
    assert len(params["task"].split(",")) == 10
    ablation = parse(compose_cfg(["experiment=table2_llama_paper_schedule"]))
    reference = parse(compose_cfg(["experiment=table2_llama", "method=adazeta"]))
    assert ablation.method == "adazeta" and ablation.experiment == "table2_llama_paper_schedule"
    assert ablation.schedule.kind == "adaptive"  # the paper's formula, Q = min(floor(0.85 e^0.45), 20)
    assert (ablation.schedule.config.alpha, ablation.schedule.config.beta, ablation.schedule.config.q_max) == (
        0.85, 0.45, 20)
    assert queries(ablation) != queries(reference)
    for part in ("optimizer", "adapter", "train", "data", "model"):
        assert getattr(ablation, part) == getattr(reference, part), part
    ablation_params = sweep_params(["experiment=table2_llama_paper_schedule"])
    assert ablation_params == {**params, "method": "adazeta"}


@pytest.mark.parametrize("method,lr,steps,every,batch", [
    ("adazeta", 1e-4, 80000, 1000, 16), ("mezo_lora", 1e-4, 80000, 1000, 16), ("mezo", 1e-6, 80000, 1000, 16),
    ("ft", 1e-5, 1000, 100, 8)])
def test_table1_composes_to_what_the_medium_model_scripts_ran(method, lr, steps, every, batch):
    # medium_models/run_all_bert_exp.sh, mezo.sh (STEP 80,000, EVAL_STEP 1,000, WD 0); FT: MeZO's finetune.sh
    s = parse(compose_cfg(["experiment=table1_roberta", f"method={method}", "task=sst2"]))
    assert (s.train.max_steps, s.train.eval_every, s.train.batch_size) == (steps, every, batch)
    assert (s.optimizer.config.lr, s.optimizer.config.weight_decay) == (lr, 0.0)
    assert s.schedule.kind == "constant" and s.schedule.config.q == 1


def write_result(root: Path, method: str, seed: int, lr: float, dev: float, test: float, status: str = "finished",
                 dev_loss: float = 0.5):
    run = root / f"{method}-lr{lr}-s{seed}"
    run.mkdir(parents=True)
    config = {"seed": seed, "method": {"name": method, "optimizer": {"lr": lr}}, "wandb": {"mode": "offline"}}
    record = {"experiment": "fx", "model": "m", "task": "rte", "method": method, "seed": seed, "status": status,
              "dev_accuracy": dev, "dev_loss": dev_loss, "test_accuracy": test, "peak_mem_mb": 100.0,
              "config": config}
    (run / "result.json").write_text(json.dumps(record))


PAPER_HEADER = "experiment,model,task,method,value,std,metric,source,table,confirmed,note"


def write_paper(path: Path, *rows: str) -> Path:
    path.write_text("\n".join([PAPER_HEADER, *rows]) + "\n")
    return path


def test_selection_uses_dev_never_test_and_aggregates_seeds(tmp_path):
    # lr 1e-3 has the better dev mean but the worse test: it must still be chosen.
    for seed, (dev, test) in enumerate([(0.80, 0.60), (0.70, 0.70)]):
        write_result(tmp_path, "adazeta", seed, 1e-3, dev, test)
    for seed, (dev, test) in enumerate([(0.60, 0.90), (0.60, 0.95)]):
        write_result(tmp_path, "adazeta", seed, 1e-4, dev, test)
    write_result(tmp_path, "mezo", 0, 1e-6, 0.5, 0.5, status="diverged")
    write_result(tmp_path, "mezo", 1, 1e-6, 0.6, 0.7)
    write_result(tmp_path, "mezo", 2, 1e-6, 0.0, 0.0, status="failed")  # failed runs are not results
    selected = select_on_dev(load_results([tmp_path]))
    paper = load_paper_numbers(write_paper(tmp_path / "paper.csv",
                                           "fx,m,rte,adazeta,74.0,,accuracy,Paper A,Table 2,yes,"))
    table = build_table(selected, paper, "fx", ["adazeta", "mezo", "ft"], ["rte"])
    # Student-t 95 % interval over 2 seeds: mean +- t(0.975, 1) * sd / sqrt(2), t = 12.706, sd with ddof = 1
    t1 = 12.706204736174707
    half_a = t1 * (0.1 / 2**0.5) / 2**0.5  # 0.60 and 0.70
    half_m = t1 * (0.2 / 2**0.5) / 2**0.5  # 0.5 and 0.7
    # two seeds' t intervals reach past 100 (and below 0): clipped to the range of an accuracy
    cell_a = f"65.0 [{65 - 100 * half_a:.1f}, 100.0]t n=2"  # no predictions kept: t over the seeds, marked
    cell_m = f"60.0 [{max(0.0, 60 - 100 * half_m):.1f}, 100.0]t n=2 †1"
    expected = pd.DataFrame(
        [
            {"method": "adazeta", "rte": cell_a, "rte (paper)": "74.0ᵃ", "paper sources": "ᵃ"},
            {"method": "mezo", "rte": cell_m, "rte (paper)": "—", "paper sources": "—"},
            {"method": "ft", "rte": "—", "rte (paper)": "—", "paper sources": "—"},
        ]
    )
    pd.testing.assert_frame_equal(table.cells, expected)
    markdown = to_markdown(table)
    assert f"| adazeta | {cell_a} | 74.0ᵃ | ᵃ |" in markdown
    assert ("- Ours: test mean of the setting selected on dev [95 % interval that resamples seeds, then test "
            "examples within each") in markdown
    assert "- ᵃ Paper A, Table 2, m: confirmed\n" in markdown
    latex = to_latex(table, "caption")
    assert r"n=2 $^\dagger$1" in latex and r"74.0$^{\mathrm{a}}$" in latex
    assert r"$^{\mathrm{a}}$ Paper A, Table 2, m: confirmed\par" in latex


def test_the_best_is_bold_only_where_its_interval_clears_every_other_and_versions_are_marked(tmp_path):
    for seed, test in enumerate([0.80, 0.82, 0.81]):
        write_result(tmp_path, "ft", seed, 1e-5, 0.8, test)
    for seed, test in enumerate([0.60, 0.62, 0.61]):
        write_result(tmp_path, "mezo", seed, 1e-6, 0.6, test)
    for seed, test in enumerate([0.55, 0.95, 0.70]):  # a wide interval that overlaps ft's
        write_result(tmp_path, "adazeta", seed, 1e-4, 0.7, test)
    paper = load_paper_numbers(write_paper(tmp_path / "paper.csv", "gx,m,rte,mezo,1.0,,accuracy,P,T,yes,"))
    cells = build_table(select_on_dev(load_results([tmp_path])), paper, "fx", ["ft", "mezo", "adazeta"], ["rte"]).cells
    assert not any("**" in c for c in cells["rte"])  # ft's best mean is not supported against adazeta's interval
    for path in tmp_path.glob("adazeta-*"):
        shutil.rmtree(path)
    write_result(tmp_path, "adazeta", 0, 1e-4, 0.7, 0.5)
    cells = build_table(select_on_dev(load_results([tmp_path])), paper, "fx", ["ft", "mezo"], ["rte"]).cells
    assert cells.set_index("method").loc["ft", "rte"].startswith("**81.0**")  # adazeta has one seed: no interval
    cells = build_table(select_on_dev(load_results([tmp_path])), paper, "fx", ["ft", "mezo", "adazeta"], ["rte"]).cells
    assert not any("**" in c for c in cells["rte"])
    # runs of one cell from two code versions are marked
    record = json.loads((tmp_path / "ft-lr1e-05-s0" / "result.json").read_text())
    record["git"] = {"commit": "1111111aaaa", "dirty": False}
    (tmp_path / "ft-lr1e-05-s0" / "result.json").write_text(json.dumps(record))
    cells = build_table(select_on_dev(load_results([tmp_path])), paper, "fx", ["ft"], ["rte"]).cells
    assert cells.loc[0, "rte"].endswith("n=3 ‡")


def test_a_cell_with_predictions_gets_an_interval_over_seeds_and_examples(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    for seed, accuracy in enumerate([0.70, 0.80]):  # two seeds 10 points apart
        write_result(tmp_path, "ft", seed, 1e-5, 0.8, 0.0)
        correct = (rng.random(400) < accuracy).astype(int)
        (tmp_path / f"ft-lr1e-05-s{seed}" / "predictions").mkdir()
        lines = ["index,row,gold,pred,correct,score_0,score_1"] + [f"{i},{i},1,{c},{c},0,1" for i, c in enumerate(correct)]
        (tmp_path / f"ft-lr1e-05-s{seed}" / "predictions" / "test.csv").write_text("\n".join(lines) + "\n")
    selected = select_on_dev(load_results([tmp_path]))
    lo, hi = selected.loc[0, "test_lo"], selected.loc[0, "test_hi"]
    assert selected.loc[0, "interval"] == "seeds+examples"
    # the seeds' spread is in the interval: wider than the examples-only bootstrap, which holds them fixed
    assert lo < selected.loc[0, "test_boot_lo"] < 0.75 < selected.loc[0, "test_boot_hi"] < hi
    cell = build_table(selected, load_paper_numbers(write_paper(tmp_path / "p.csv", "gx,m,rte,mezo,1.0,,accuracy,P,T,yes,")),
                       "fx", ["ft"], ["rte"]).cells.loc[0, "rte"]
    assert cell.startswith(f"{100 * selected.loc[0, 'test_mean']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] n=2")


def test_every_paper_number_is_marked_with_its_source_and_mixed_rows_say_so(tmp_path):
    paper = load_paper_numbers(write_paper(
        tmp_path / "paper.csv",
        "fx,big,rte,adazeta,74.0,,accuracy,Paper A,table not known,no,via a summary",
        "fx,big,rte,mezo,54.6,,accuracy,Paper A,table not known,no,via a summary",
        "fx,other,rte,mezo,64.0,3.3,accuracy,Paper B,Table 18,yes,another model",
        "fx,other,sst2,mezo,90.5,1.2,accuracy,Paper B,Table 18,yes,another model",
        "gx,big,rte,mezo,1.0,,accuracy,Paper C,Table 9,yes,",  # another experiment: not in this table
    ))
    table = build_table(select_on_dev(load_results([])), paper, "fx", ["adazeta", "mezo", "ft"], ["rte", "sst2"])
    cells = table.cells.set_index("method")
    # marks follow first use; a cell lists the confirmed number first, each with its own mark
    assert cells.loc["adazeta", "rte (paper)"] == "74.0ᵃ"
    assert cells.loc["mezo", "rte (paper)"] == "64.0 (3.3)ᵇ; 54.6ᵃ"
    assert cells.loc["mezo", "sst2 (paper)"] == "90.5 (1.2)ᵇ"
    assert list(cells["paper sources"]) == ["ᵃ", "ᵃ ᵇ mixed", "—"]
    assert table.legend()[2:] == [
        "ᵃ Paper A, table not known, big: unconfirmed (via a summary)",
        "ᵇ Paper B, Table 18, other: confirmed (another model)",
    ]
    # an experiment without published numbers has no paper columns and says so
    bare = build_table(select_on_dev(load_results([])), paper, "hx", ["adazeta"], ["rte"])
    assert list(bare.cells.columns) == ["method", "rte"]
    assert bare.legend()[-1] == "No published numbers for this experiment."


def test_the_committed_paper_numbers_load_and_name_their_sources():
    paper = load_paper_numbers(ROOT / "results" / "paper_numbers.csv")
    assert len(paper) > 0 and paper["table"].str.len().min() > 0
    adazeta = paper[paper["source"].str.startswith("AdaZeta")]
    assert len(adazeta) and not adazeta["confirmed"].any()  # only a secondary summary so far
    # where the AdaZeta paper's baseline numbers are unconfirmed, MeZO's own are beside them
    for experiment, task, method in [("table1_roberta", "rte", "mezo_lora"), ("table2_llama", "rte", "mezo")]:
        cell = paper[(paper["experiment"] == experiment) & (paper["task"] == task) & (paper["method"] == method)]
        assert set(cell["source"].str.split().str[0]) == {"AdaZeta", "MeZO"}
        assert cell.loc[cell["source"].str.startswith("MeZO"), "confirmed"].all()


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("fx,m,rte,mezo,54.6,,accuracy,Paper A,Table 2,maybe,", "confirmed must be 'yes' or 'no', got 'maybe'"),
        ("fx,m,rte,mezo,n/a,,accuracy,Paper A,Table 2,yes,", "value must be a finite number, got 'n/a'"),
        ("fx,m,rte,mezo,54.6,-1,accuracy,Paper A,Table 2,yes,", "std must be a finite number >= 0, got '-1'"),
        ("fx,m,rte,mezo,54.6,,accuracy,,Table 2,yes,", "source is empty"),
        ("fx,m,rte,mezo,54.6,,accuracy,Paper A,Table 2,no,", "an unconfirmed number needs a note"),
        ("fx,m,rte,mezo,54.6,,accuracy,Paper A,Table 2,yes", "expected 11 fields"),
        ("fx,m,rte,adazeta,74.0,,accuracy,Paper A,Table 2,yes,", "repeats line 2"),
    ],
)
def test_a_bad_paper_numbers_row_is_named_by_file_and_line(tmp_path, row, message):
    path = write_paper(tmp_path / "paper.csv", "fx,m,rte,adazeta,74.0,,accuracy,Paper A,Table 2,yes,", row)
    with pytest.raises(ConfigError) as err:
        load_paper_numbers(path)
    text = str(err.value)
    assert text.startswith(f"{path} line 3: ") and message in text and "\n" not in text


def test_make_tables_stops_on_a_bad_paper_file_with_one_line(tmp_path):
    bad = tmp_path / "paper.csv"
    bad.write_text("table,model,task,method,value,std,metric,source,confirmed\n")  # the schema before provenance
    out = subprocess.run([sys.executable, "-m", "adazeta.tools.make_tables", "--results", str(tmp_path / "none"), "--paper",
                          str(bad), "--out", str(tmp_path / "tables")], cwd=ROOT, env=ENV, capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"make_tables: error: {bad} line 1: the header must name the columns {PAPER_HEADER}, "
        "got table,model,task,method,value,std,metric,source,confirmed"
    ]


def test_a_grid_at_one_seed_is_selected_on_that_seed_and_ties_go_to_the_lower_dev_loss(tmp_path):
    # The grid ran at seed 0; lr 1e-3 won there and then ran seeds 1, 2 with lower dev. Selecting on all seeds
    # would now prefer 1e-4 (one lucky seed); comparing on the shared seed keeps the choice that was made.
    write_result(tmp_path, "a", 0, 1e-3, 0.80, 0.7)
    write_result(tmp_path, "a", 1, 1e-3, 0.60, 0.6)
    write_result(tmp_path, "a", 2, 1e-3, 0.60, 0.8)
    write_result(tmp_path, "a", 0, 1e-4, 0.75, 0.9)
    # b: equal dev accuracy, the lower dev loss wins
    write_result(tmp_path, "b", 0, 1e-3, 0.70, 0.1, dev_loss=0.6)
    write_result(tmp_path, "b", 0, 1e-4, 0.70, 0.2, dev_loss=0.4)
    selected = select_on_dev(load_results([tmp_path])).set_index("method")
    assert selected.loc["a", "runs"] == 3 and selected.loc["a", "test_mean"] == pytest.approx(0.7)
    assert selected.loc["b", "test_mean"] == pytest.approx(0.2)


def sweep(tmp_path: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [
        "-m", "model=tiny-llama", "task=rte", "method=adazeta,mezo_lora", "method.optimizer.lr=1e-4,1e-3",
        "seed=0,1", "experiment_name=sweeptest", f"hydra.sweep.dir={tmp_path / 'runs'}", f"data.dir={data}",
        "data.num_train=16", "data.num_dev=8", "data.num_eval=8", "train.max_steps=2", "train.eval_every=1",
        "train.batch_size=4", "wandb.mode=disabled", *extra,
    ]
    return subprocess.run([sys.executable, "-m", "adazeta.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)


def test_sweep_grid_seeds_table_and_rerun_skips(tmp_path, fixture_data):
    first = sweep(tmp_path, fixture_data)
    assert first.returncode == 0, first.stderr[-2000:]
    results = sorted((tmp_path / "runs").rglob("result.json"))
    assert len(results) == 8  # 2 methods x 2 learning rates x 2 seeds
    stamps = {p: p.stat().st_mtime_ns for p in results}
    out = subprocess.run([sys.executable, "-m", "adazeta.tools.make_tables", "--results", str(tmp_path / "runs"), "--out",
                          str(tmp_path / "tables")], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "tables" / "sweeptest.md").read_text()
    assert "| adazeta |" in table and "| mezo_lora |" in table
    selected = pd.read_csv(tmp_path / "tables" / "selected.csv")
    assert set(selected["settings_tried"]) == {2} and set(selected["runs"]) == {2}

    figures = subprocess.run([sys.executable, "-m", "adazeta.tools.make_figures", "--results", str(tmp_path / "runs"),
                              "--out", str(tmp_path / "figures")], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert figures.returncode == 0, figures.stderr
    assert (tmp_path / "figures" / "sweeptest_tiny-llama_rte.png").stat().st_size > 10_000

    again = sweep(tmp_path, fixture_data)
    assert again.returncode == 0
    assert again.stdout.count("skipping:") == 8  # Hydra logs INFO to stdout
    assert all(p.stat().st_mtime_ns == stamps[p] for p in results)  # nothing was rerun


def test_a_failed_job_does_not_stop_the_sweep(tmp_path, fixture_data):
    # The second learning rate is invalid: its points are left out before any job starts, the others still run.
    res = sweep(tmp_path, fixture_data, "method.optimizer.lr=1e-4,-1")
    assert res.returncode == 2  # ... and the sweep says so at the end, one line per value left out
    assert "sweep point(s) did not run to a result" in res.stderr and "method.optimizer.lr=-1" in res.stderr
    assert len(list((tmp_path / "runs").rglob("result.json"))) == 4


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_parallel_and_cluster_launchers(tmp_path, fixture_data, launcher):
    args = [
        "-m", f"hydra/launcher={launcher}", "model=tiny-llama", "task=rte", "method=adazeta", "seed=0,1",
        f"hydra.sweep.dir={tmp_path / 'runs'}", f"data.dir={fixture_data}", "data.num_train=16", "data.num_dev=8",
        "data.num_eval=8", "train.max_steps=2", "train.eval_every=1", "train.batch_size=4", "wandb.mode=disabled",
    ]
    if launcher == "joblib":
        args.append("hydra.launcher.n_jobs=2")
    res = subprocess.run([sys.executable, "-m", "adazeta.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs").rglob("result.json")]
    assert sorted(r["seed"] for r in records) == [0, 1] and {r["status"] for r in records} == {"finished"}


def test_a_setting_is_what_the_run_used():
    """Seeds, paths, the task's version and its other family's prompt format do not split a setting."""
    from adazeta.tools.tables import setting_of

    def config(family, **changes):
        cfg = {"seed": 0, "model": {"family": family}, "train": {"max_steps": 4},
               "task": {"name": "sst2", "version": 3, "causal": {"template": "{s} It was"},
                        "masked": {"template": "{s} It was {mask} ."}, "local": {"dir": "glue"}}}
        for key, value in changes.items():
            node = cfg
            *parents, leaf = key.split("__")
            for name in parents:
                node = node[name]
            node[leaf] = value
        return cfg

    causal = setting_of(config("causal"))
    assert setting_of(config("causal", seed=1, task__version=4, task__masked={"template": "{s} It was{mask}."},
                             data={"dir": "/x"})) == causal
    assert setting_of(config("causal", task__causal={"template": "{s} It is"})) != causal
    assert setting_of(config("causal", train__max_steps=5)) != causal
    masked = setting_of(config("masked"))
    assert setting_of(config("masked", task__causal={"template": "other"}, task__local={"dir": "x"})) == masked
    assert setting_of(config("masked", task__masked={"template": "{s} It was{mask}."})) != masked


def test_an_experiment_plan_that_grows_does_not_split_its_runs():
    """A new arm in an experiment's plan, or a model's placement table moved into its YAML, is not a setting."""
    from adazeta.runs.rundir import config_differences
    from adazeta.tools.tables import setting_of

    old = {"seed": 0, "model": {"family": "causal", "name": "m"}, "train": {"max_steps": 4},
           "arms": {"a": {"grid": [1]}}, "design": {"order": ["a"]}}
    new = {"seed": 0, "model": {"family": "causal", "name": "m", "placements": {"llama": {"official": []}}},
           "train": {"max_steps": 4}, "arms": {"a": {"grid": [1]}, "b": {"grid": [2]}}, "design": {"order": ["a", "b"]},
           "tuning": {"a": {"lr": [1]}}}
    assert setting_of(old) == setting_of(new)
    assert config_differences(old, new) == []
    assert config_differences(old, {**new, "train": {"max_steps": 5}}) == ["train.max_steps: 4 -> 5"]


def test_an_experiments_hydra_sweep_comes_from_its_arms_and_design(tmp_path, fixture_data):
    """`adazeta-run -m experiment=NAME` runs the grid x seeds x methods its one schema declares (a user's experiment
    in a --config-dir), each point once, and skips them all on a rerun."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "derived.yaml").write_text(
        "# @package _global_\nexperiment_name: derived\n"
        "arms:\n  mezo: {overrides: [method=mezo], lr: [1.0e-4, 1.0e-3]}\n  zero_shot: {overrides: [method=zero_shot]}\n"
        "design:\n  grid: {task: [rte]}\n  seeds: [0, 1]\n"
        f"hydra:\n  sweep: {{dir: {tmp_path / 'runs'}}}\n  sweeper:\n    params: ${{experiment_sweep:}}\n")
    args = ["-m", "--config-dir", str(tmp_path / "conf"), "experiment=derived", "model=tiny-llama",
            f"data.dir={fixture_data}", "data.num_train=16", "data.num_dev=8", "data.num_eval=8", "train.max_steps=1",
            "train.eval_every=1", "train.batch_size=4", "wandb.mode=disabled"]
    first = subprocess.run([sys.executable, "-m", "adazeta.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    points = sorted(tuple(kv for kv in p.parent.name.split(",") if kv.split("=")[0] in ("method", "seed", "task"))
                    for p in (tmp_path / "runs").rglob("result.json"))
    assert points == [("method=mezo", "seed=0", "task=rte"), ("method=mezo", "seed=1", "task=rte"),
                      ("method=zero_shot", "seed=0", "task=rte"), ("method=zero_shot", "seed=1", "task=rte")]
    assert "method.optimizer.lr" not in first.stdout  # the reference lr: the lr grid is the driver's
    again = subprocess.run([sys.executable, "-m", "adazeta.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.count("skipping:") == 4


def test_make_tables_names_a_damaged_run_record_instead_of_a_traceback(tmp_path):
    write_result(tmp_path / "runs", "adazeta", 0, 1e-3, 0.8, 0.7)
    damaged = tmp_path / "runs" / "cut" / "result.json"
    damaged.parent.mkdir()
    damaged.write_text("[1, 2]")  # JSON, but not a record
    out = subprocess.run([sys.executable, "-m", "adazeta.tools.make_tables", "--results", str(tmp_path / "runs"),
                          "--out", str(tmp_path / "tables")], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert out.returncode == 2 and not (tmp_path / "tables").exists()
    assert out.stderr.strip().splitlines() == [
        f"make_tables: error: {damaged} is not a run record; rerun that run (force=true) or move its folder away"]


def test_committed_runs_of_one_arm_at_one_rate_are_one_setting():
    """Seeds of one arm run months apart must pool into one table cell: a key added to the config since (with its
    old-behaviour value) must not make a new setting (tables.ADDED_DEFAULTS), or a cell silently drops seeds."""
    from adazeta.runs.record import read_record
    from adazeta.tools.tables import setting_of

    results = load_results([ROOT / "results" / "runs"])
    assert len(results) > 20
    results["lr"] = [str(((read_record(Path(p))["config"].get("method") or {}).get("optimizer") or {}).get("lr"))
                     for p in results["path"]]
    split = {}
    for key, group in results.groupby(["experiment", "model", "task", "method", "lr"]):
        if group["setting"].nunique() > 1:
            settings = [setting_of(read_record(Path(p))["config"]) for p in group["path"]]
            keys = set().union(*settings)
            split[key] = sorted(k for k in keys if len({repr(s.get(k, "<absent>")) for s in settings}) > 1)
    assert not split, f"runs of one arm and rate split into several settings by: {split}"


def test_the_cell_listing_leaves_a_task_matrix_to_its_own_rule(tmp_path):
    """``selected.csv`` lists each experiment's setting chosen on dev cell by cell; a task matrix (cpu_table2)
    chooses one rate per arm pooled over its grid tasks once the grid has ended, so its grid points are not
    listed there as chosen cells (its report says what is chosen)."""
    from adazeta.tools.make_tables import cells_chosen_on_dev, matrix_experiments

    assert "cpu_table2" in matrix_experiments()
    write_result(tmp_path, "adazeta", 0, 1e-3, 0.70, 0.6)
    matrix = tmp_path / "adazeta-lr0.001-s0" / "result.json"
    (tmp_path / "in_matrix").mkdir()
    record = json.loads(matrix.read_text())
    (tmp_path / "in_matrix" / "result.json").write_text(json.dumps({**record, "experiment": "cpu_table2"}))
    chosen = cells_chosen_on_dev(load_results([tmp_path]))
    assert list(chosen["experiment"]) == ["fx"]
    assert set(select_on_dev(load_results([tmp_path]))["experiment"]) == {"fx", "cpu_table2"}
