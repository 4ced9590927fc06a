"""Bad input as a user types it: each case is one line on stderr naming the problem, and exit status 2.

The command runs in-process (``adazeta.cli.main`` with its argv), on the tiny model and fixture data, so each
case costs a config composition, not a model load: every one of them must fail before the model loads.
"""

from __future__ import annotations

import sys

import pytest

from adazeta import cli
from conftest import tiny_overrides

# (overrides, a fragment the one-line message must contain)
CASES = [
    # Hydra's own mistakes: group options, unknown keys, sweep syntax outside a sweep
    (["method=adazet"], "method has no option 'adazet'; known: adapter, adazeta"),
    (["method=adazet"], "did you mean 'adazeta'?"),
    (["task=sst3"], "task has no option 'sst3'"),
    (["model=smollm"], "model has no option 'smollm'"),
    (["schedule=adaptiv"], "did you mean 'adaptive'?"),
    (["experiment=tabel2_llama"], "did you mean 'table2_llama'?"),
    (["train.foo=1"], "train has no key 'foo'; known: batch_size"),
    (["train.max_step=5"], "did you mean 'max_steps'?"),
    (["+train.foo=1"], "train: unknown key(s) foo"),
    (["method.optimizer.lrr=1e-3"], "did you mean 'lr'?"),
    (["seed=0,1"], "seed=0,1 lists several values: add -m"),
    (["seed=[0"], "seed=[0:"),
    # wrong types, named by their override path
    (["method.optimizer.lr=abc"], "method.optimizer.lr='abc' must be a number"),
    (["method.optimizer.eps=true"], "method.optimizer.eps=true must be a number"),
    (["train.max_steps=null"], "train.max_steps=null must be an integer"),
    (["train.max_steps=2.5"], "train.max_steps=2.5 must be an integer"),
    (["train.batch_size=abc"], "train.batch_size='abc' must be an integer"),
    (["train.keep_best=maybe"], "train.keep_best='maybe' must be true or false"),
    (["method.adapter.rank=2.5"], "method.adapter.rank=2.5 must be an integer"),
    (["data.num_train=many"], "data.num_train='many' must be an integer"),
    (["divergence.factor=high"], "divergence.factor='high' must be a number"),
    (["wandb.tags=abc"], "wandb.tags='abc' must be a list or null"),
    (["model.max_length=1e3"], "model.max_length=1000.0 must be an integer"),
    # values out of range
    (["seed=-1"], "seed=-1 must be an integer in [0, 2**32 - 1]"),
    (["seed=1e20"], "must be an integer in [0, 2**32 - 1]"),
    (["seed=abc"], "seed='abc' must be an integer"),
    (["method.optimizer.lr=-1"], "method.optimizer.lr=-1.0 must be >= 0"),
    (["method.optimizer.eps=0"], "method.optimizer.eps=0.0 must be > 0"),
    (["method.optimizer.reduction=median"], "method.optimizer.reduction='median' must be one of mean, sum"),
    (["method.optimizer.estimator=forward"], "method.optimizer.estimator='forward' must be one of"),
    (["method.optimizer.query_chunk=0"], "method.optimizer.query_chunk=0 must be an int >= 1"),
    (["train.max_steps=0"], "train.max_steps=0 must be >= 1"),
    (["train.batch_size=6", "train.grad_accum=4"], "not divisible by train.grad_accum=4"),
    (["train.checkpoint_every=0"], "train.checkpoint_every=0 must be >= 1 or null"),
    (["train.max_forward_passes=0"], "train.max_forward_passes=0 must be >= 1 or null"),
    (["divergence.factor=1.0"], "divergence.factor=1.0 must be > 1"),
    (["divergence.rule=worst"], "divergence.rule='worst' is not one of best, initial"),
    (["divergence.collapse_fraction=0"], "divergence.collapse_fraction=0.0 must be in (0, 1]"),
    (["wandb.mode=sometimes"], "wandb.mode='sometimes' is not one of auto, online, offline, disabled"),
    (["method.adapter.rank=0"], "method.adapter.rank=0 must be >= 1"),
    (["method.adapter.init=zeros"], "method.adapter.init='zeros' is unknown"),
    (["method.adapter.placement=everywhere"], "method.adapter.placement='everywhere' is unknown"),
    (["method=sparse_mezo", "method.optimizer.sparsity=1.0"], "method.optimizer.sparsity=1.0 must be in [0, 1)"),
    (["method=sparse_mezo", "method.optimizer.mask=top"], "method.optimizer.mask='top' must be one of"),
    (["method=sparse_mezo", "method.optimizer.weight_decay=0.1"], "Sparse-MeZO moves only masked entries"),
    (["method=lora", "method.adapter.r=0"], "method.adapter.r=0 must be >= 1"),
    (["method=lora", "+method.optimizer.betas=[0.9]"], "method.optimizer.betas=[0.9] must be two values"),
    (["method=icl", "method.demonstrations.k=0"], "method.demonstrations.k=0 must be >= 1"),
    (["schedule=constant", "schedule.q=0"], "schedule.q=0 must be"),
    # data that is not there, found before any model loads
    (["data.dir=/nonexistent/data"], "data file not found: /nonexistent/data/superglue/RTE/train.jsonl"),
]


def run_cli(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *args])
    monkeypatch.setattr(cli, "FAILED", [])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(overrides, message, fixture_data, tmp_path, monkeypatch, capsys):
    args = [*tiny_overrides(fixture_data), *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("adazeta-run: error: "), err
    assert message in lines[0], lines[0]
    assert not (tmp_path / "run" / "result.json").exists()  # nothing ran, nothing recorded


def test_a_sweep_runs_its_valid_points_and_sums_up_the_rest(fixture_data, tmp_path, monkeypatch, capsys):
    args = ["-m", *tiny_overrides(fixture_data, "train.max_steps=1"), "method=mezo_lora,adazet,lora",
            f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${method.name}"]
    code, err = run_cli(monkeypatch, capsys, args)
    assert code == 2, err
    assert "adazeta-run: error: method=adazet: method has no option 'adazet'" in err
    assert "1 sweep point(s) did not run to a result:" in err
    assert (tmp_path / "mezo_lora" / "result.json").is_file() and (tmp_path / "lora" / "result.json").is_file()


def test_a_sweep_whose_point_fails_exits_non_zero(fixture_data, tmp_path, monkeypatch, capsys):
    args = ["-m", *tiny_overrides(fixture_data, "train.max_steps=1"), "method=mezo_lora",
            "method.optimizer.lr=1e-3,-1", f"hydra.sweep.dir={tmp_path}"]
    code, err = run_cli(monkeypatch, capsys, args)
    assert code != 0
    assert "sweep point(s) did not run to a result" in err and "must be >= 0" in err
