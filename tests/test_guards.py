"""Numerical guards: the update a step applies against the one it meant, a run whose updates change nothing stops
as `stalled`, the +-eps perturbation restores the weights exactly (small sets) or within its rounding bound (large
sets, bf16), and processes holding different weights are caught by their checksum."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from adazeta.errors import ConfigError
from adazeta.guards import GuardConfig, UpdateProbe, checksum, ranks_agree, stall_reason
from adazeta.optim.spsa import directions, query_seed
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig
from adazeta.run import run
from helpers import compose_cfg, tiny_overrides


def quadratic(params, target):
    return lambda: sum(((p.float() - t) ** 2).sum() for p, t in zip(params, target))


def make(dtype=torch.float32, n=(300, 40), seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(k, generator=gen).mul_(0.02).to(dtype) for k in n]
    target = [torch.randn(k, generator=gen) for k in n]
    return params, target


# --- the measured update against the intended one --------------------------------------------------------------


@pytest.mark.parametrize("sample", [10_000, 50], ids=["all-entries", "sampled"])
def test_intended_update_is_the_formula_and_fp32_applies_it(sample):
    params, target = make()
    opt = ZOSGD(params, ZOSGDConfig(lr=1e-2, eps=1e-3, weight_decay=0.1), seed=3, n_queries=3)
    probe = UpdateProbe(params, sample, seed=1)
    before = [p.double().clone() for p in params]
    probe.before()
    opt.step(quadratic(params, target))
    check = probe.after(opt.intended_update)
    # The formula, written out: w <- w - lr (g + wd w), g = (1/Q) sum_q grad_q z_q, z_q from the step's seeds.
    grads = opt.last_projected_grads.double()
    g = [torch.zeros_like(b) for b in before]
    for q in range(3):
        for i, z in enumerate(directions(params, query_seed(3, 0, q))):
            g[i] += grads[q] * z.double() / 3
    meant = [-1e-2 * (gi + 0.1 * b) for gi, b in zip(g, before)]
    got = opt.intended_update(probe.index, [b if i is None else b[i] for b, i in zip(before, probe.index)])
    for m, x, i in zip(meant, got, probe.index):
        torch.testing.assert_close(x, m if i is None else m[i], rtol=1e-12, atol=1e-15)
    assert check.entries == (340 if sample > 340 else pytest.approx(sample, abs=2))
    assert check.changed > 0.99 and check.cosine > 1 - 1e-6  # fp32 rounding only


def test_bf16_drops_a_small_update_and_the_probe_says_so():
    params, target = make(torch.bfloat16)
    opt = ZOSGD(params, ZOSGDConfig(lr=1e-6, eps=1e-2), seed=0)
    probe = UpdateProbe(params, 10_000)
    probe.before()
    opt.step(quadratic(params, target))
    check = probe.after(opt.intended_update)
    # |lr g| ~ 1e-6 x 10 against a bf16 resolution of ~1e-4 at 0.02: most entries keep their value.
    assert check.changed < 0.5 and check.cosine < 0.9 and check.intended_norm > 0


def test_an_optimizer_without_an_intended_update_still_gets_the_changed_share():
    params, target = make()
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.SGD(params, lr=0.1)
    probe = UpdateProbe(params, 10_000)
    probe.before()
    quadratic(params, target)().backward()
    opt.step()
    check = probe.after(None)
    assert check.changed == 1.0 and math.isnan(check.cosine)


# --- restoring the perturbation -----------------------------------------------------------------------------------


def test_a_small_trainable_set_is_restored_exactly_in_fp32(monkeypatch):
    params, target = make()
    start = [p.clone() for p in params]
    opt = ZOSGD(params, ZOSGDConfig(lr=0.0, eps=1e-3), seed=0, n_queries=4)  # lr 0: the step must leave w as it was
    opt.step(quadratic(params, target))
    assert all(torch.equal(p, s) for p, s in zip(params, start))
    # The control: restored by the opposite perturbation (a large set's way), fp32 rounding moves some entries.
    monkeypatch.setattr(ZOSGD, "KEEP_WEIGHTS_BYTES", 0)
    opt = ZOSGD(params, ZOSGDConfig(lr=0.0, eps=1e-3), seed=0, n_queries=4)
    opt.step(quadratic(params, target))
    assert not all(torch.equal(p, s) for p, s in zip(params, start))


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at |x| (8 significant bits)."""
    x = x.abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(x)) - 7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_large_sets_perturbation_drift_in_bf16_is_within_its_rounding_bound(monkeypatch, seed):
    monkeypatch.setattr(ZOSGD, "KEEP_WEIGHTS_BYTES", 0)
    params, target = make(torch.bfloat16, n=(5000,), seed=seed)
    w0 = params[0].double().clone()
    eps = 1e-3
    opt = ZOSGD(params, ZOSGDConfig(lr=0.0, eps=eps), seed=seed)
    opt.step(quadratic(params, target))
    z = directions(params, query_seed(seed, 0, 0))[0].double()
    drift = (params[0].double() - w0).abs()
    # Three in-place additions (+eps z, -2 eps z, +eps z), each rounding to half an ulp of its result:
    bound = 1.5 * ulp_bf16(w0.abs() + 2 * eps * z.abs())
    assert bool((drift <= bound).all()), float((drift / bound).max())
    assert 0 < float((drift > 0).double().mean()) < 1  # it is measured: some entries drift, not all


# --- runs -----------------------------------------------------------------------------------------------------------


def read_metrics(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_a_run_whose_updates_change_nothing_stops_as_stalled(fixture_data, tmp_path):
    record = run(compose_cfg(tiny_overrides(fixture_data, "method=mezo_lora", "method.optimizer.eps=1e-30",
                                            "train.max_steps=20", "guard.every=2", "guard.stall_checks=3")), tmp_path)
    assert record["status"] == "stalled" and record["steps"] == 6
    assert "changed none of" in record["reason"] and "raise eps" in record["reason"]
    assert record["test_accuracy"] is not None  # a result: its best-dev state was tested
    rows = read_metrics(tmp_path)
    assert [r["update_changed"] for r in rows] == ["", "0.0", "", "0.0", "", "0.0"]
    assert not (tmp_path / "checkpoint.pt").exists()


def test_an_lr_below_the_weights_resolution_stalls_with_that_reason(fixture_data, tmp_path):
    record = run(compose_cfg(tiny_overrides(fixture_data, "method=mezo", "model.dtype=bf16",
                                            "method.optimizer.lr=1e-15", "train.max_steps=8", "guard.every=2",
                                            "guard.stall_checks=2")), tmp_path)
    assert record["status"] == "stalled", record["reason"]
    assert "below the weights' resolution" in record["reason"] and "bfloat16" in record["reason"]


def test_a_training_run_logs_its_update_measurements(fixture_data, tmp_path):
    record = run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "guard.every=2")), tmp_path)
    assert record["status"] == "finished"
    rows = read_metrics(tmp_path)
    measured = [r for r in rows if r["update_changed"]]
    assert [int(r["step"]) for r in measured] == [2, 4]
    assert all(float(r["update_changed"]) > 0.9 and float(r["update_cosine"]) > 0.9999 for r in measured)


def test_stall_reasons_name_the_cause():
    from adazeta.guards import UpdateCheck

    zero = UpdateCheck(0.0, math.nan, 100, 0.0, 0.0)
    small = UpdateCheck(0.0, math.nan, 100, 1e-9, 0.0)
    assert "raise eps" in stall_reason([zero] * 3, torch.float32, 1e-30)
    assert "below the weights' resolution" in stall_reason([small] * 3, torch.bfloat16, 1e-3)


@pytest.mark.parametrize("key,value", [("every", -1), ("sample", 0), ("stall_checks", -2), ("checksum_every", -1),
                                       ("stall_share", 1.0), ("stall_share", float("nan"))])
def test_guard_settings_are_checked(key, value):
    with pytest.raises(ConfigError, match=f"guard.{key}"):
        GuardConfig(**{key: value})


# --- several processes ------------------------------------------------------------------------------------------------


def test_the_checksum_sees_one_changed_entry():
    params, _ = make()
    before = checksum(params)
    params[1][7] += 2.0 ** -20
    assert not torch.equal(before, checksum(params))
    assert ranks_agree(params)  # one process agrees with itself


def _checksum_worker(rank: int, store_path: str, differ: bool, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    params, _ = make()
    if differ and rank == 1:
        params[0][0] += 1e-6
    agree = ranks_agree(params)
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(agree))
    dist.destroy_process_group()


@pytest.mark.parametrize("differ", [False, True])
def test_processes_with_different_weights_disagree_on_every_rank(differ, tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "agree")
    mp.spawn(_checksum_worker, args=(str(tmp_path / "store"), differ, out), nprocs=2, join=True)
    answers = {open(f"{out}.{r}").read() for r in range(2)}
    assert answers == {str(not differ)}


@pytest.mark.parametrize("method", ["mezo", "ft"])
def test_torchrun_ranks_compare_their_weights_every_step_and_agree(method, fixture_data, tmp_path):
    """The checksum runs inside real two-process runs (ZO: every rank applies the whole update; FO: DDP) without a
    false alarm; the disagreeing case is the spawned test above."""
    from test_distributed import launch

    overrides = tiny_overrides(fixture_data, f"method={method}", "guard.checksum_every=1", "guard.every=1")
    done = launch(2, *overrides, f"hydra.run.dir={tmp_path / 'two'}", module=True)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "two" / "result.json").read_text())
    assert record["status"] == "finished" and record["world_size"] == 2
    assert all(r["update_changed"] for r in read_metrics(tmp_path / "two"))
