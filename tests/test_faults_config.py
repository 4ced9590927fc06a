"""Config and command-line faults as a user types them: one line on stderr naming the problem and the fix, exit
status 2, and no run directory: each case is refused before Hydra creates it, and before any model loads.

The command runs in-process (``adazeta.cli.main`` with its argv, as in tests/test_bad_input.py), on the tiny
model and fixture data; one test runs the real command in a subprocess for the exit status the shell sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import adazeta.build as build_module
import adazeta.run as run_module
from adazeta import cli
from adazeta.errors import ConfigError
from helpers import ROOT, compose_cfg, tiny_overrides

# (flags before the overrides, overrides after the tiny run's, a fragment the one-line message must contain)
CASES = [
    # deleting what every run reads
    ([], ["~train"], "~train: train cannot be deleted"),
    ([], ["~model"], "choose another option: model=OPTION (known: hf, "),
    ([], ["~train.batch_size"], "set it instead: train.batch_size=VALUE (now 4)"),
    ([], ["~optimizer@method.optimizer"], "method.optimizer cannot be deleted"),
    ([], ["~method.optimizer"], "or method.optimizer=null for none"),
    # NaN and infinity, in every float setting (and inside lists and mappings)
    ([], ["schedule=adaptive", "schedule.alpha=nan"], "schedule.alpha=nan must be a finite number"),
    ([], ["method.optimizer.lr=nan"], "method.optimizer.lr=nan must be a finite number"),
    ([], ["method.optimizer.eps=inf"], "method.optimizer.eps=inf must be a finite number"),
    ([], ["method.optimizer.lr=-inf"], "method.optimizer.lr=-inf must be a finite number"),
    ([], ["method.optimizer.lr=1e400"], "method.optimizer.lr=inf must be a finite number"),
    ([], ["method.optimizer.lr=1" + "0" * 400], "method.optimizer.lr=inf must be a finite number"),  # past floats
    ([], ["divergence.factor=nan"], "divergence.factor=nan must be a finite number"),
    ([], ["divergence.collapse_fraction=nan"], "divergence.collapse_fraction=nan must be a finite number"),
    ([], ["schedule=adaptive_official", "schedule.q_target=inf"], "schedule.q_target=inf must be a finite number"),
    ([], ["method=lora", "method.adapter.alpha=nan"], "method.adapter.alpha=nan must be a finite number"),
    ([], ["method=lora", "method.optimizer.betas=[0.9,nan]"], "method.optimizer.betas[1]=nan must be a finite"),
    ([], ["method=ft", "+method.optimizer.grad_clip=inf"], "method.optimizer.grad_clip=inf must be a finite"),
    ([], ["method=lp", "method.probe.C=[1.0,inf]"], "method.probe.C[1]=inf must be a finite number"),
    ([], ["+model.architecture.rms_norm_eps=nan"], "model.architecture.rms_norm_eps=nan must be a finite number"),
    # a group option that is a path, empty or null
    ([], ["experiment=../model/tiny-llama"], "experiment options are names in conf/experiment/, not paths"),
    ([], ["experiment=/model/tiny-llama"], "not paths ('/model/tiny-llama')"),
    ([], ["model=./tiny-llama"], "model options are names in conf/model/, not paths"),
    ([], ["model=tiny-llama/../smollm2-135m"], "not paths ('tiny-llama/../smollm2-135m')"),
    ([], ["optimizer@method.optimizer=../adapter/lora"], "optimizer options are names in conf/optimizer/"),
    ([], ["model="], "model=: model needs an option name; known: hf, "),
    ([], ["method=null"], "method=null: method needs an option name; known: adapter, adazeta"),
    # a new key added with + that nothing reads, and + on a key that exists
    ([], ["+learning_rate=0.1"], "the config has no key 'learning_rate'"),
    ([], ["+learning_rate=0.1"], "did you mean method.optimizer.lr?"),
    ([], ["++learning_rate=0.1"], "did you mean method.optimizer.lr?"),
    ([], ["+batch_size=8"], "did you mean train.batch_size?"),
    ([], ["+seed=1"], "+seed=1: seed is already in the config; drop the + to change it: seed=1"),
    ([], ["+method.optimizer.lr=0.1"], "method.optimizer.lr is already in the config; drop the +"),
    # a key the run's other settings ignore
    ([], ["train.eval_every_forwards=3"], "train.eval_every=2 is ignored: train.eval_every_forwards=3 evaluates"),
    ([], ["method=ft", "schedule=adaptive"], "schedule=adaptive is ignored: method 'ft' makes no zeroth-order"),
    ([], ["method=zero_shot", "schedule=constant", "schedule.q=4"], "schedule=constant is ignored"),
    ([], ["method=mezo", "train.grad_accum=2"], "train.grad_accum=2 is ignored: method 'mezo' takes no backward"),
    ([], ["train.gradient_checkpointing=true"], "gradient_checkpointing=true is ignored: method 'adazeta' takes no"),
    ([], ["divergence.rule=none", "divergence.factor=2"], "divergence.factor=2 is ignored: divergence.rule=none"),
    ([], ["divergence.collapse=false", "divergence.collapse_fraction=0.9"], "collapse_fraction=0.9 is ignored"),
    # settings that mean nothing
    ([], ["train.select_from=10"], "train.select_from=10 is after the last step (train.max_steps=4)"),
    ([], ["method=lora", "method.adapter.alpha=0"], "method.adapter.alpha=0.0 must be > 0"),
    # Hydra's own flags
    (["--config-name", "nosuch"], [], "--config-name nosuch: no primary config nosuch.yaml"),
    ([], ["-cn"], "--config-name needs a value"),
    (["--cfg", "jobs"], [], "--cfg jobs: --cfg takes one of job, hydra, all; did you mean 'job'?"),
    ([], ["--cfg"], "--cfg needs a value: --cfg job prints the composed config"),
    (["--cfg"], [], "--cfg model=tiny-llama: --cfg reads the next argument as its value"),
    (["--info"], [], "write --info all before the overrides, or --info after them"),
    (["--info", "tree"], [], "--info tree: --info takes one of all, config, defaults"),
    (["--cf", "job"], [], "--cf: not a flag of adazeta-run (adazeta-run --hydra-help lists Hydra's flags); did you mean '--cfg'?"),
    (["--frobnicate"], [], "--frobnicate: not a flag of adazeta-run"),
    (["--help", "--cfg", "jobs"], [], "--cfg jobs: --cfg takes one of job"),
    (["--cfg", "job", "-m"], [], "--multirun and --cfg cannot be combined"),
    (["-r", "-m"], [], "--run and --multirun cannot be combined"),
    (["--resolve"], [], "--resolve resolves the config that --cfg prints: add --cfg job"),
    (["--package", "train"], [], "--package train chooses the part of the config that --cfg prints"),
    (["--cfg", "job", "--package", "trian"], [], "the job config has nothing at 'trian'; known: data, "),
    (["--experimental-rerun", "config.pickle"], [], "adazeta-run keeps no config pickle"),
    (["--config-path", "/elsewhere"], [], "set ADAZETA_CONFIG_DIR=/elsewhere"),
    (["--config-dir", "/nonexistent/conf"], [], "--config-dir /nonexistent/conf: no such folder"),
    # an interpolation that cannot be resolved: a key that is not there, an unset variable, an unknown resolver
    ([], ["seed=${nosuch.key}"], "seed=${nosuch.key}: cannot resolve seed (Interpolation key 'nosuch.key' not found)"),
    ([], ["train.batch_size=${train.batch_sise}"], "did you mean ${train.batch_size}?"),
    ([], ["seed=${oc.env:ADAZETA_TEST_UNSET}"], "set ADAZETA_TEST_UNSET in the environment, or give a default: "
                                                "${oc.env:ADAZETA_TEST_UNSET,VALUE}"),
    ([], ["seed=${nosuch:x}"], "(Unsupported interpolation type nosuch); known resolvers: "),
    ([], ["seed=${oops"], "seed=${oops: mismatched input"),  # refused by the override parser itself
    # a Hydra group's option (its own groups and its plugins' are no files in conf/)
    ([], ["hydra/launcher=joblb"], "hydra/launcher has no option 'joblb'; known: basic, joblib, submitit_local, "
                                   "submitit_slurm; did you mean 'joblib'?"),
    ([], ["hydra/sweeper=basik"], "hydra/sweeper has no option 'basik'; known: basic"),
    # a misspelled group, Hydra's or ours, and a misspelled top-level name: the nearest of keys and groups
    ([], ["hydra/launchr=joblib"], "no config group 'hydra/launchr'; known: hydra/env, "),
    ([], ["hydra/launchr=joblib"], "did you mean 'hydra/launcher'?"),
    ([], ["optimzer@method.optimizer=zo_adam"], "did you mean 'optimizer'?"),
    ([], ["methd/x=y"], "no config group 'methd/x'"),
    ([], ["adaptr=tt"], "the config has no key or group 'adaptr'; keys: data, "),
    ([], ["adaptr=tt"], "did you mean 'adapter'?"),
    ([], ["sed=3"], "did you mean 'seed'?"),
    # a run directory the process cannot create, even as root (os.access says yes to root)
    ([], ["hydra.run.dir=/proc/adazeta-run"], "cannot write the run directory: cannot create a folder in /proc"),
    # a learning rate that never moves a weight, for every optimizer
    ([], ["method.optimizer.lr=0"], "method.optimizer.lr=0.0 must be > 0: a learning rate of 0.0 never moves"),
    ([], ["method=lora", "method.optimizer.lr=0"], "method.optimizer.lr=0.0 must be > 0"),
    ([], ["optimizer@method.optimizer=zo_adam", "method.optimizer.lr=0"], "method.optimizer.lr=0.0 must be > 0"),
    ([], ["optimizer@method.optimizer=es", "method.optimizer.lr=0"], "method.optimizer.lr=0.0 must be > 0"),
    ([], ["method=mezo", "method.optimizer.lr=-1e-6"], "method.optimizer.lr=-1e-06 must be > 0"),
]


def run_cli(monkeypatch, capsys, args: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``adazeta-run args``, run in this process."""
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))


@pytest.mark.parametrize("before,after,message", CASES, ids=[" ".join(b + a)[:60] for b, a, _ in CASES])
def test_a_config_fault_is_one_line_exit_2_and_no_run_directory(before, after, message, fixture_data, tmp_path,
                                                                monkeypatch, capsys, no_model):
    run_dir = tmp_path / "run"
    args = [*before, *tiny_overrides(fixture_data), f"hydra.run.dir={run_dir}", *after]
    code, _, err = run_cli(monkeypatch, capsys, args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("adazeta-run: error: "), err
    assert message in lines[0], lines[0]
    assert not run_dir.exists()  # refused before Hydra made the folder


@pytest.mark.parametrize("before,after,needle", [
    (["--cfg", "job"], [], "name: tiny-llama"),
    ([], ["--info"], "Config search path"),  # last: --info takes no value (Hydra's `all`)
    (["--help"], [], "== Config groups =="),
    (["--hydra-help"], [], "Hydra (1.3"),  # the overrides are dropped: with them Hydra's help fails
    (["--cfg", "job", "--package", "train"], [], "# @package train"),
])
def test_the_flags_that_print_still_print_and_exit_0(before, after, needle, fixture_data, tmp_path, monkeypatch,
                                                     capsys):
    run_dir = tmp_path / "run"
    args = [*before, *tiny_overrides(fixture_data), f"hydra.run.dir={run_dir}", *after]
    code, out, err = run_cli(monkeypatch, capsys, args)
    assert code == 0, err
    assert needle in out
    assert not run_dir.exists()


def test_flags_between_the_overrides_are_read_as_hydra_reads_them_in_front(fixture_data, monkeypatch, capsys):
    """Hydra's parser refuses overrides on both sides of a flag; they are put in its order first."""
    overrides = tiny_overrides(fixture_data)
    code, out, err = run_cli(monkeypatch, capsys, [*overrides[:3], "--cfg", "job", *overrides[3:], "seed=7"])
    assert code == 0, err
    assert "seed: 7" in out and "name: tiny-llama" in out


def test_an_extra_config_dir_adds_options_that_the_checks_see(tmp_path, monkeypatch, capsys):
    (tmp_path / "extra" / "method").mkdir(parents=True)
    (tmp_path / "extra" / "method" / "mine.yaml").write_text(
        (ROOT / "conf" / "method" / "mezo.yaml").read_text().replace("name: mezo", "name: mine"))
    code, out, err = run_cli(monkeypatch, capsys, ["--cfg", "job", "--config-dir", str(tmp_path / "extra"),
                                                   "method=mine"])
    assert code == 0, err
    assert "name: mine" in out
    code, _, err = run_cli(monkeypatch, capsys, ["--cfg", "job", "--config-dir", str(tmp_path / "extra"),
                                                 "method=mien"])
    assert code == 2 and "did you mean 'mine'?" in err, err


@pytest.mark.parametrize("text, where, what", [
    ("name: mine\nlabels: [0, 1\n", "line 2", "while parsing a flow sequence; expected ',' or ']'"),
    ("name: mine\n  version: 1\n", "line 2", "mapping values are not allowed here"),
])
def test_a_user_config_that_is_not_yaml_is_named_with_its_line(text, where, what, tmp_path, monkeypatch, capsys):
    (tmp_path / "extra" / "task").mkdir(parents=True)
    (tmp_path / "extra" / "task" / "mine.yaml").write_text(text)
    code, _, err = run_cli(monkeypatch, capsys, ["--cfg", "job", "--config-dir", str(tmp_path / "extra"),
                                                 "task=mine"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"task=mine: {tmp_path / 'extra' / 'task' / 'mine.yaml'} {where} is not valid YAML ({what}" in err, err


def test_a_sweep_leaves_out_a_group_option_that_is_a_path(fixture_data, tmp_path, monkeypatch, capsys):
    args = ["-m", *tiny_overrides(fixture_data, "train.max_steps=1"), "model=tiny-llama,../task/rte",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=${model.name}"]
    code, _, err = run_cli(monkeypatch, capsys, args)
    assert code == 2, err
    assert "model=../task/rte: model options are names in conf/model/, not paths" in err
    assert (tmp_path / "sweep" / "tiny-llama" / "result.json").is_file()


def test_a_directory_holding_an_interrupted_run_of_other_settings_says_an(fixture_data, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps({"status": "interrupted", "config": {"seed": 5}}))
    with pytest.raises(ConfigError, match=r"holds an interrupted run with other settings \(seed: 5 -> 0\)"):
        run_module.run(compose_cfg(tiny_overrides(fixture_data)), run_dir)


@pytest.mark.parametrize("args,code,message", [
    (["~train"], 2, "adazeta-run: error: ~train: train cannot be deleted"),
    (["--cfg", "jobs"], 2, "adazeta-run: error: --cfg jobs: --cfg takes one of job, hydra, all"),
    (["--cfg", "job"], 0, None),
])
def test_the_command_exits_as_documented(args, code, message, fixture_data, tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ADAZETA_", "WANDB_"))}
    proc = subprocess.run([sys.executable, "-m", "adazeta.cli", *args, *tiny_overrides(fixture_data),
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stderr
    if message is None:
        assert "name: tiny-llama" in proc.stdout and proc.stderr == ""
    else:
        assert proc.stderr.splitlines() == [proc.stderr.splitlines()[0]] and proc.stderr.startswith(message)
    assert not run_dir.exists()


def test_a_hub_that_cannot_be_reached_is_one_line_naming_the_model_and_the_local_way(monkeypatch):
    """transformers raises OSError for an unreachable Hub or an unknown repo: a model problem, with its fix, not a
    failed write of the run directory (the CLI's OSError line)."""
    import transformers

    from adazeta import models

    monkeypatch.delenv(models.MODEL_DIR_ENV, raising=False)

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nmore")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    cfg = models.ModelConfig(name="m", hub_id="org/no-such-model", family="causal")
    with pytest.raises(ConfigError, match=r"cannot load model org/no-such-model from the Hugging Face Hub \(OSError: "
                                          r"We couldn't connect.*\); .*model.model_dir=<folder> or ADAZETA_MODEL_DIR"):
        models.load_model(cfg)


@pytest.mark.parametrize("make,message", [
    (lambda p: p, "ADAZETA_CONFIG_DIR={}: no such folder; point ADAZETA_CONFIG_DIR at a conf/ folder"),
    (lambda p: (p.write_text("x"), p)[1], "ADAZETA_CONFIG_DIR={}: a file, not a folder"),
    (lambda p: p.mkdir() or p, "ADAZETA_CONFIG_DIR={}: the folder holds no config.yaml"),
], ids=["missing", "file", "empty-folder"])
def test_a_config_tree_that_is_not_one_is_one_line(make, message, fixture_data, tmp_path, monkeypatch, capsys):
    """ADAZETA_CONFIG_DIR is read before any flag or override: a path that holds no config tree is one line, for a
    run and for --help alike."""
    tree = make(tmp_path / "conf")
    monkeypatch.setenv("ADAZETA_CONFIG_DIR", str(tree))
    for args in ([*tiny_overrides(fixture_data), f"hydra.run.dir={tmp_path / 'run'}"], ["--help"]):
        code, _, err = run_cli(monkeypatch, capsys, args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"adazeta-run: error: {message.format(tree)}"), err
    assert not (tmp_path / "run").exists()
