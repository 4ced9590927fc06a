"""Calibrated zero-shot / ICL: contextual calibration (Zhao et al. 2021) and a dev-fitted class-prior bias."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from adazeta.scoring.calibration import CONTENT_FREE, content_free_examples, contextual_bias, prior_bias
from adazeta.errors import ConfigError
from adazeta.run import run
from adazeta.settings import parse
from helpers import compose_cfg, tiny_overrides


def test_contextual_bias_is_minus_log_of_the_mean_content_free_distribution():
    scores = torch.tensor([[-1.0, -3.0], [-2.0, -2.5], [0.0, -0.1]])
    # Zhao et al.: p_cf = mean over content-free inputs of the softmax over the label words; W = diag(p_cf)^-1
    p = [[math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b))] for a, b in scores.tolist()]
    p_cf = [sum(r[j] for r in p) / 3 for j in range(2)]
    bias = contextual_bias(scores)
    calibrated = torch.softmax(scores + bias, dim=1)
    by_hand = [[r[j] / p_cf[j] / sum(r[k] / p_cf[k] for k in range(2)) for j in range(2)] for r in p]
    assert calibrated.flatten().tolist() == pytest.approx([v for r in by_hand for v in r], abs=1e-6)
    assert float(bias.sum()) == pytest.approx(0.0, abs=1e-6)


def test_prior_bias_meets_the_optimality_condition_of_a_bias_only_logistic_fit():
    gen = torch.Generator().manual_seed(0)
    gold = torch.randint(0, 3, (200,), generator=gen)
    scores = torch.randn(200, 3, generator=gen) + 2.0 * torch.nn.functional.one_hot(gold, 3) + torch.tensor([1.5, 0.0, -1.0])
    bias = prior_bias(scores, gold)
    # At the minimum of the mean cross-entropy over a per-class bias, the predicted class shares equal the gold ones.
    predicted = torch.softmax(scores.double() + bias.double(), dim=1).mean(dim=0)
    observed = torch.bincount(gold, minlength=3).double() / len(gold)
    assert predicted.tolist() == pytest.approx(observed.tolist(), abs=1e-5)
    assert float(bias[0] - bias[2]) < -1.5  # it undoes most of the built-in preference for candidate 0 over 2


def load_task(name: str):
    return parse(compose_cfg(["model=tiny-llama", f"task={name}"])).bound_task()


def test_content_free_prompts_fill_every_input_field():
    examples = content_free_examples(load_task("rte"))
    assert len(examples) == len(CONTENT_FREE)
    assert "N/A" in examples[0].prompt and examples[0].candidates == examples[1].candidates
    with pytest.raises(ConfigError, match="fixed candidate set"):
        content_free_examples(load_task("copa"))


def read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("kind", ["contextual", "prior"])
def test_a_calibrated_zero_shot_run_adds_its_recorded_bias_to_the_raw_scores(kind, fixture_data, tmp_path):
    raw = run(compose_cfg(tiny_overrides(fixture_data, "method=zero_shot")), tmp_path / "raw")
    cal = run(compose_cfg(tiny_overrides(fixture_data, "method=zero_shot", f"method.calibration={kind}")), tmp_path / "cal")
    assert raw["status"] == cal["status"] == "finished"
    saved = json.loads((tmp_path / "cal" / "result.json").read_text())["calibration"]
    assert saved["kind"] == kind and len(saved["bias"]) == 2
    bias = torch.tensor(saved["bias"])
    for split in ("dev", "test"):
        before, after = read(tmp_path / "raw" / "predictions" / f"{split}.csv"), read(tmp_path / "cal" / "predictions" / f"{split}.csv")
        for a, b in zip(before, after):
            shifted = torch.tensor([float(a["score_0"]), float(a["score_1"])]) + bias
            assert [float(b["score_0"]), float(b["score_1"])] == pytest.approx(shifted.tolist(), abs=1e-6)
        accuracy = sum(int(r["correct"]) for r in after) / len(after)
        assert accuracy == pytest.approx(cal["dev_accuracy" if split == "dev" else "test_accuracy"])


def test_calibration_is_refused_for_a_training_method(fixture_data):
    cfg = compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "+method.calibration=prior"))
    with pytest.raises(ConfigError, match="training-free"):
        parse(cfg)
    cfg = compose_cfg(tiny_overrides(fixture_data, "method=zero_shot", "method.calibration=platt"))
    with pytest.raises(ConfigError, match="not one of none, contextual, prior"):
        parse(cfg)
