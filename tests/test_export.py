"""python -m adazeta.export: a LoRA run merged into a plain save_pretrained folder, a TT run as base model plus
adapters, both giving the trained model's outputs; bad folders are one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import adazeta
from adazeta.errors import ConfigError
from adazeta.export import export
from adazeta.build import build
from adazeta.run import run
from adazeta.settings import parse
from helpers import compose_cfg, tiny_overrides

IDS = torch.tensor([[1, 5, 9, 13, 2, 7]])


def trained_model(fixture_data, run_dir):
    """The model a run tested, rebuilt from its saved adapters (method=eval)."""
    return build(parse(compose_cfg(tiny_overrides(fixture_data, "method=eval", f"eval.from={run_dir}")))).model


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_a_lora_run_exports_as_one_merged_model(fixture_data, tmp_path):
    run(compose_cfg(tiny_overrides(fixture_data, "method=mezo_lora", "train.keep_best=false",
                                   "method.optimizer.lr=1e-2")), tmp_path / "run")
    export(tmp_path / "run", tmp_path / "out")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected = logits(trained_model(fixture_data, tmp_path / "run"))
    base = logits(build(parse(compose_cfg(tiny_overrides(fixture_data, "method=zero_shot")))).model)
    assert not torch.allclose(expected, base)  # the LoRA state is not the untouched model's
    torch.testing.assert_close(logits(merged), expected, rtol=1e-4, atol=1e-5)
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_a_tt_run_exports_as_base_model_and_adapters(fixture_data, tmp_path):
    run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta")), tmp_path / "run")
    export(tmp_path / "run", tmp_path / "out")
    assert "adazeta.load_adapters" in (tmp_path / "out" / "README.md").read_text()
    model = adazeta.load_adapters(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), tmp_path / "out" / "adapter")
    assert torch.equal(logits(model), logits(trained_model(fixture_data, tmp_path / "run")))


def test_bad_export_folders_are_one_line(fixture_data, tmp_path):
    with pytest.raises(ConfigError, match="holds no result.json"):
        export(tmp_path, tmp_path / "out")
    run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "train.save=none")), tmp_path / "run")
    with pytest.raises(ConfigError, match="kept no trained state"):
        export(tmp_path / "run", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export(tmp_path / "run", tmp_path / "full")
