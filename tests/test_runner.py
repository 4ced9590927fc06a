"""End-to-end runs on tiny random models with fixture data: files, determinism, divergence, trainable sets."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from adazeta.run import execute, run
from adazeta.settings import parse
from adazeta.tracking import EVAL_COLUMNS, STEP_COLUMNS
from helpers import compose_cfg, tiny_overrides, write_fixture_data

RESULT_KEYS = {
    "method", "task", "model", "seed", "status", "dev_accuracy", "test_accuracy", "best_step", "total_params",
    "trainable_params", "peak_mem_mb", "wall_time_s", "config", "git", "packages", "device",
}


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def run_tiny(data: Path, out: Path, *extra: str) -> dict:
    return run(compose_cfg(tiny_overrides(data, *extra)), out)


@pytest.mark.parametrize("method", ["adazeta", "mezo", "mezo_lora", "ft", "zero_shot"])
def test_each_method_runs_and_writes_its_files(method, fixture_data, tmp_path):
    record = run_tiny(fixture_data, tmp_path, f"method={method}")
    assert record["status"] == "finished"
    metrics = read_csv(tmp_path / "metrics.csv")
    evals = read_csv(tmp_path / "eval.csv")
    assert list(metrics[0].keys()) == STEP_COLUMNS if metrics else True
    assert list(evals[0].keys()) == EVAL_COLUMNS
    steps = 0 if method == "zero_shot" else 4
    assert len(metrics) == steps
    assert [r["split"] for r in evals].count("test") == 1
    saved = json.loads((tmp_path / "result.json").read_text())
    assert RESULT_KEYS <= set(saved)
    assert 0.0 <= saved["test_accuracy"] <= 1.0 and saved["config"]["method"]["name"] == method
    # the CPU it ran on, with the instruction sets its speed turns on (one model name can hide two CPUs)
    from adazeta.runs.results import CPU_FEATURES, cpu_label
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())
    assert saved["device"]["cpu_features"] == [f for f in CPU_FEATURES if f in flags]
    assert cpu_label(saved["device"]).endswith("(AMX)" if "amx_bf16" in flags else "(no AMX)")
    assert cpu_label({"type": "cpu", "name": "AMD EPYC"}) == "AMD EPYC"  # an older record: the name alone
    if method in ("adazeta", "mezo", "mezo_lora"):
        # central differences: 2 forwards per query, cumulative
        assert [int(r["forward_passes"]) for r in metrics] == [2, 4, 6, 8]
        assert all(int(r["n_queries"]) == 1 for r in metrics)
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0]
    assert header.split(",") == STEP_COLUMNS
    for name in ("metrics.csv", "eval.csv"):  # plain \n line ends, not the csv module's CRLF
        assert b"\r" not in (tmp_path / name).read_bytes()


def test_same_seed_gives_identical_losses(fixture_data, tmp_path):
    run_tiny(fixture_data, tmp_path / "a", "method=adazeta", "seed=3")
    run_tiny(fixture_data, tmp_path / "b", "method=adazeta", "seed=3")
    run_tiny(fixture_data, tmp_path / "c", "method=adazeta", "seed=4")
    losses = {k: [r["loss"] for r in read_csv(tmp_path / k / "metrics.csv")] for k in "abc"}
    assert losses["a"] == losses["b"]
    assert losses["a"] != losses["c"]


def test_adaptive_schedule_raises_queries_with_epochs(fixture_data, tmp_path):
    # 8 examples at batch 4 = 2 steps an epoch; alpha 2, beta 1: Q = 1, 2, 4 over epochs 0, 1, 2.
    run_tiny(fixture_data, tmp_path, "method=adazeta", "data.num_train=8", "train.max_steps=6",
             "schedule.alpha=2", "schedule.beta=1")
    metrics = read_csv(tmp_path / "metrics.csv")
    assert [int(r["n_queries"]) for r in metrics] == [1, 1, 2, 2, 4, 4]
    assert [int(r["forward_passes"]) for r in metrics] == [2, 4, 8, 12, 20, 28]


def test_a_diverging_run_is_a_result(fixture_data, tmp_path):
    # An absurd learning rate overflows the weights: the loss turns NaN within a few steps.
    record = run_tiny(fixture_data, tmp_path, "method=mezo", "method.optimizer.lr=1e38", "train.max_steps=20")
    assert record["status"] == "diverged" and "non-finite" in record["reason"]
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["status"] == "diverged"
    assert math.isfinite(saved["test_loss"])  # tested on the best (pre-divergence) state
    evals = read_csv(tmp_path / "eval.csv")
    assert evals[-1]["split"] == "test"
    assert len(read_csv(tmp_path / "metrics.csv")) < 20


def test_adazeta_trains_only_adapters_and_leaves_the_backbone_bitwise_unchanged(fixture_data, tmp_path):
    from adazeta.adapters import ADAPTERS
    from adazeta.models import load_model

    s = parse(compose_cfg(tiny_overrides(fixture_data, "method=adazeta")))
    loaded = load_model(s.model, seed=0)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    model = ADAPTERS.get("tt").builder(loaded.model, s.adapter.config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".adapter." in n for n in trainable)
    assert not any("norm" in n or "lm_head" in n or "embed" in n for n in trainable)
    # one ZO step through the real pieces
    from adazeta.optim import OPTIMIZERS
    from adazeta.scoring import Scorer
    from adazeta.tasks.loaders import load_task

    data = load_task(s.bound_task(), s.data, 0)
    scorer = Scorer.of(model, loaded.tokenizer)
    batch = scorer.collate(scorer.encode(data.train[:4], 256))
    opt = OPTIMIZERS.get("zo_sgd").builder([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                                           s.optimizer.config, 0)
    adapter_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(3):
        opt.step(lambda: scorer.loss(batch))
    after = dict(model.named_parameters())
    for name, value in before.items():
        wrapped = name.replace("mlp.gate_proj.", "mlp.gate_proj.base.").replace("mlp.up_proj.", "mlp.up_proj.base.")
        wrapped = wrapped.replace("mlp.down_proj.", "mlp.down_proj.base.")
        assert torch.equal(after[wrapped], value), name
    assert any(not torch.equal(after[n], v) for n, v in adapter_before.items())


def test_wandb_offline_writes_local_files(fixture_data, tmp_path):
    run_tiny(fixture_data, tmp_path, "method=adazeta", "wandb.mode=offline")
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_missing_data_fails_before_the_model_loads(tmp_path):
    from adazeta.errors import ConfigError

    with pytest.raises(ConfigError, match="data file not found"):
        run(compose_cfg(tiny_overrides(tmp_path / "nowhere")), tmp_path / "run")
    assert not (tmp_path / "run" / "result.json").exists()


def test_zero_shot_needs_only_the_evaluation_split(fixture_data, tmp_path):
    (fixture_data / "superglue" / "RTE" / "train.jsonl").unlink()
    record = run_tiny(fixture_data, tmp_path / "alone", "method=zero_shot")
    assert record["status"] == "finished" and (record["num_train"], record["num_dev"], record["num_eval"]) == (0, 0, 16)
    assert record["dev_accuracy"] is None and record["dev_loss"] is None
    assert [r["split"] for r in read_csv(tmp_path / "alone" / "eval.csv")] == ["test"]
    # The test draw does not depend on the train split: with it, zero-shot scores the same test set (and a dev set).
    with_train = run_tiny(write_fixture_data(tmp_path / "full"), tmp_path / "with", "method=zero_shot")
    assert with_train["num_dev"] == 16 and with_train["dev_accuracy"] is not None
    assert (with_train["test_loss"], with_train["test_accuracy"]) == (record["test_loss"], record["test_accuracy"])


@pytest.mark.parametrize(
    "method,use", [("icl", "for its demonstrations"), ("lp", "to fit its probe"), ("mezo", "to train"), ("ft", "to train")]
)
def test_a_method_that_uses_the_train_split_names_it_before_the_model_loads(method, use, fixture_data, tmp_path):
    from adazeta.errors import ConfigError

    train = fixture_data / "superglue" / "RTE" / "train.jsonl"
    train.unlink()
    with pytest.raises(ConfigError) as err:
        run_tiny(fixture_data, tmp_path / "run", f"method={method}")
    message = str(err.value)
    assert message.startswith(f"method '{method}' needs the train split {use}: data file not found: {train}; ")
    assert "\n" not in message and "ADAZETA_DATA_DIR" in message  # one line, with the way out
    assert not (tmp_path / "run" / "result.json").exists()  # stopped in the start-up checks, before any model


def test_a_crash_is_recorded_as_failed(fixture_data, tmp_path, monkeypatch):
    import adazeta.run as run_module

    def boom(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(run_module, "train", boom)
    s = parse(compose_cfg(tiny_overrides(fixture_data, "method=adazeta")))
    with pytest.raises(RuntimeError):
        execute(s, tmp_path)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["status"] == "failed" and "simulated" in saved["reason"]


def test_tt_adapters_on_tiny_roberta(fixture_data, tmp_path):
    from adazeta.adapters import ADAPTERS
    from adazeta.adapters.tt import count_adapters
    from adazeta.models import count_parameters, load_model

    s = parse(compose_cfg(tiny_overrides(fixture_data, "model=tiny-roberta", "method=adazeta")))
    model = ADAPTERS.get("tt").builder(load_model(s.model).model, s.adapter.config)
    assert count_adapters(model) == 2 * 2  # two layers: after attention-output dense and FFN-output dense
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("attention.output.dense.adapter" in n or "output.dense.adapter" in n for n in names)
    _, trainable = count_parameters(model)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if ".adapter." in n)


def test_masked_model_trains_end_to_end(fixture_data, tmp_path):
    record = run_tiny(fixture_data, tmp_path, "model=tiny-roberta", "task=sst2", "method=adazeta")
    assert record["status"] == "finished" and record["trainable_params"] > 0


@pytest.mark.parametrize("rule", ["best", "initial"])  # on this curve the best loss is the initial one
def test_divergence_monitor_counts_consecutive_strikes(rule):
    from adazeta.tracking import DivergenceConfig, DivergenceMonitor

    monitor = DivergenceMonitor(DivergenceConfig(rule=rule, factor=2.0, patience=2))
    assert monitor.update(1.0) is None  # the reference
    assert monitor.update(2.5) is None  # one strike
    assert monitor.update(1.5) is None  # reset
    assert monitor.update(2.5) is None
    assert "2 evaluations" in monitor.update(3.0)
    assert "non-finite" in DivergenceMonitor(DivergenceConfig()).update(float("nan"))


def test_the_main_metric_names_the_record_keys():
    """result.json's score keys carry the task's metric: accuracy for classification, f1 for generation tasks,
    and a checkpoint of an earlier release (which called the score accuracy) still restores."""
    from adazeta.scoring.evaluate import EvalResult
    from adazeta.runs.record import RunRecord, main_score

    record = RunRecord("mezo", "squad", 1, "m", 0, None, metric="f1", dev_score=0.4, test_score=0.5,
                       initial_dev_score=0.1)
    saved = record.as_dict()
    assert (saved["initial_dev_f1"], saved["dev_f1"], saved["test_f1"]) == (0.1, 0.4, 0.5)
    assert not any(k.endswith("_accuracy") or k.endswith("_score") for k in saved)
    assert main_score(saved, "test") == 0.5 and main_score({"test_accuracy": 0.7}, "test") == 0.7
    old = {"loss": 0.5, "accuracy": 0.75, "n": 8, "metrics": {}, "tied": 0.0}
    assert EvalResult.restore(old) == EvalResult(0.5, 0.75, 8)
