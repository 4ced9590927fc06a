"""tools/displacement: the step-0 trainable set is rebuilt exactly, so a run's displacement is what its rule did.

ZO-SGD-Sign moves every entry by exactly +-lr a step, so after 3 steps each entry has moved by lr or 3 lr: any
error in the rebuilt start (another seed, another draw order, the saved tensors aliasing the start) breaks it."""

import math
import subprocess
import sys

import pytest
import torch

from adazeta.errors import ConfigError
from adazeta.tools import displacement

LR = 1e-3


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from helpers import write_fixture_data

    return write_fixture_data(tmp_path_factory.mktemp("data"))


def sign_run(data_dir, tmp_path, method, *extra):
    from adazeta.run import run
    from helpers import compose_cfg, tiny_overrides

    overrides = tiny_overrides(data_dir, f"method={method}", "optimizer@method.optimizer=zo_sign",
                               f"method.optimizer.lr={LR}", "schedule=constant", "train.max_steps=3",
                               "data.num_train=8", "data.num_dev=8", "data.num_eval=8", "seed=3", *extra)
    record = run(compose_cfg(overrides), tmp_path / "run", overrides=overrides)
    assert record["status"] == "finished", record.get("reason")
    return tmp_path / "run"


def zero_at_start(method, names):
    """The parameters a method's init sets to zero: the identity TT init's last ``up`` core and ``up`` bias,
    LoRA's B."""
    if method == "mezo_lora":
        return {n for n in names if "lora_B" in n}
    up_cores = [n for n in names if ".adapter.up.cores." in n]
    last = {n for n in up_cores if int(n.rsplit(".", 1)[1]) == max(int(m.rsplit(".", 1)[1]) for m in up_cores)}
    return last | {n for n in names if n.endswith(".adapter.up.bias")}


@pytest.mark.parametrize("method", ["adazeta", "mezo_lora"])
def test_each_entry_moved_by_one_or_three_sign_steps(method, data_dir, tmp_path):
    extra = ("method.adapter.init=identity",) if method == "adazeta" else ()
    run_dir = sign_run(data_dir, tmp_path, method, "train.keep_best=false", *extra)
    start, saved, steps = displacement.start_and_saved(run_dir)
    assert steps == 3 and start.keys() == saved.keys() and start
    moves = torch.cat([(saved[n].double() - start[n].double()).abs().flatten() / LR for n in start])
    torch.testing.assert_close(moves, moves.round(), atol=1e-3, rtol=0)  # whole sign steps
    assert set(moves.round().unique().tolist()) <= {1.0, 3.0}
    zero = {n for n, t in start.items() if float(t.abs().max()) == 0.0}
    assert zero == zero_at_start(method, start) and zero != set(start)
    for g in displacement.groups(start, saved):
        assert LR <= g.rms_displacement <= 3 * LR + 1e-9, g
        assert (g.rms_start == 0.0) == any(displacement.group_name(n) == g.name for n in zero), g


def test_the_tested_state_is_measured_at_its_best_dev_step(data_dir, tmp_path):
    run_dir = sign_run(data_dir, tmp_path, "adazeta", "train.eval_every=1")
    import json

    best = json.loads((run_dir / "result.json").read_text())["best_step"]
    start, saved, steps = displacement.start_and_saved(run_dir)
    assert steps == best
    moves = torch.cat([(saved[n] - start[n]).abs().flatten() / LR for n in start]).double()
    assert set(moves.round().unique().tolist()) <= ({0.0} if best == 0 else set(range(best % 2, best + 1, 2)) - {0})


def test_groups_and_total_add_up():
    start = {"model.layers.0.a.w": torch.zeros(4), "model.layers.1.a.w": torch.ones(4), "b": torch.full((2,), 2.0)}
    saved = {"model.layers.0.a.w": torch.ones(4), "model.layers.1.a.w": torch.ones(4), "b": torch.full((2,), 2.0)}
    rows = displacement.groups(start, saved)
    assert [g.name for g in rows] == ["model.layers.*.a.w", "b"]
    layer = rows[0]
    assert layer.entries == 8 and math.isclose(layer.rms_start, math.sqrt(0.5))
    assert math.isclose(layer.rms_saved, 1.0) and math.isclose(layer.rms_displacement, math.sqrt(0.5))
    everything = displacement.total(rows)
    assert everything.entries == 10 and math.isclose(everything.rms_displacement, math.sqrt(4 / 10))
    assert displacement.per_sqrt_step(layer, 0) is None
    pooled = displacement.groups(start, saved, last=2)
    assert [(g.name, g.entries) for g in pooled] == [("a.w", 8), ("b", 2)]
    assert math.isclose(displacement.per_sqrt_step(layer, 2), 0.5)


def test_a_backbone_run_or_a_folder_without_adapters_is_one_line(data_dir, tmp_path):
    run_dir = sign_run(data_dir, tmp_path, "mezo")
    with pytest.raises(ConfigError, match="trains the backbone"):
        displacement.start_and_saved(run_dir)
    lora = sign_run(data_dir, tmp_path / "lora", "mezo_lora")
    with pytest.raises(ConfigError, match="no saved adapters"):
        displacement.start_and_saved(lora, "adapter_last")
    # every folder is checked before the first model loads: a good run first, then a bad one, prints no table
    out = subprocess.run([sys.executable, "-m", "adazeta.tools.displacement", str(lora), str(tmp_path / "nothing")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no .hydra/config.yaml" in out.stderr
    assert out.stdout == ""


def test_the_command_prints_a_table_and_writes_the_csv(data_dir, tmp_path):
    import csv

    run_dir = sign_run(data_dir, tmp_path, "mezo_lora", "train.keep_best=false")
    out = subprocess.run([sys.executable, "-m", "adazeta.tools.displacement", str(run_dir), "--out",
                          str(tmp_path / "d.csv")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| all |" in out.stdout and "(adapter, step 3)" in out.stdout
    with open(tmp_path / "d.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[-1]["group"] == "all" and all(r["steps"] == "3" for r in rows)
    assert all(LR <= float(r["rms_displacement"]) <= 3 * LR + 1e-9 for r in rows)
    assert b"\r" not in (tmp_path / "d.csv").read_bytes()  # \n line ends, as every CSV the project writes
