"""The `adazeta-run` command as a user meets it: help, printed config, dry runs, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adazeta import cli
from helpers import ROOT, compose_cfg, tiny_overrides

# Only offline variables: the command must never need the network.
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("ADAZETA_", "WANDB_"))}
ENV.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


def adazeta_run(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adazeta.cli", *args],
        cwd=cwd,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def group_blocks(page: str) -> dict[str, str]:
    """The help page's config groups: each group's name -> its options' text (the lines indented under it)."""
    section = page.split("== Config groups ==")[1].split("\n\n")[0]
    blocks: dict[str, str] = {}
    group = None
    for line in section.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            group = line.split()[0]
            blocks[group] = ""
        elif group is not None and line.startswith(" " * 14):
            blocks[group] += " " + line.strip()
    return blocks


def test_help_lists_every_option_of_every_config_group():
    """Every folder of option files in conf/ (bar the internal experiment_method/ and hydra/) is a group on the
    page, under its own name, with every one of its options: the page is read from the tree, not a list kept by
    hand."""
    res = adazeta_run("--help")
    assert res.returncode == 0, res.stderr
    blocks = group_blocks(res.stdout)
    groups = {p.name for p in (ROOT / "conf").iterdir() if p.is_dir() and any(p.glob("*.yaml"))}
    groups -= {"experiment_method", "hydra"}
    assert {"model", "task", "method", "schedule", "experiment", "adapter", "optimizer"} <= groups
    assert set(blocks) == groups, sorted(set(blocks) ^ groups)
    for group in groups:
        listed = set(blocks[group].replace(",", " ").replace("*", "").split())
        options = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
        assert options <= listed, f"{group}: {sorted(options - listed)} not on the page"


def test_help_lists_a_group_no_command_names_yet(tmp_path):
    """A group the tree gains (here in a --config-dir) is listed with its options, the chosen one starred; the
    internal groups stay off the page."""
    from adazeta.helppage import groups_text
    from adazeta.overrides import Source
    from adazeta.paths import config_dir

    for name in ("short", "long"):
        (tmp_path / "prompt").mkdir(exist_ok=True)
        (tmp_path / "prompt" / f"{name}.yaml").write_text(f"name: {name}\n")
    text = groups_text(Source(config_dir=str(config_dir()), extra_dir=str(tmp_path)), {"prompt": "long"})
    blocks = group_blocks("== Config groups ==\n" + text)
    assert blocks["prompt"].split() == ["*long,", "short"]
    assert "method" in blocks and "experiment_method" not in blocks and "hydra" not in blocks


def test_cfg_job_prints_the_composed_config():
    out = adazeta_run("--cfg", "job", "method=adazeta", "task=rte").stdout
    assert "name: adaptive" in out and "kind: tt" in out and "name: rte" in out


@pytest.mark.parametrize(
    "model,trainable,adapters",
    [("llama2-7b", "610,560", "96"), ("roberta-large", "136,704", "48"), ("smollm2-135m", "179,100", "90")],
)
def test_dry_run_counts_without_download(model, trainable, adapters, tmp_path):
    res = adazeta_run(f"model={model}", "method=adazeta", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr
    assert f"trainable params {trainable}" in res.stdout
    assert f"adapters         {adapters}" in res.stdout
    assert "memory estimate" in res.stdout


def test_unknown_option_lists_the_choices(tmp_path):
    res = adazeta_run("method=adazta", f"hydra.run.dir={tmp_path}")
    assert res.returncode != 0
    assert "adazeta" in res.stderr and "mezo_lora" in res.stderr  # Hydra's list of available options


@pytest.mark.parametrize(
    "args,needle",
    [
        (["method.optimizer.eps=-1"], "optimizer.eps"),
        (["method=adazeta", "schedule.q_max=0"], "schedule.q_max"),
        (["train.batch_size=0"], "train.batch_size"),
        (["method.adapter.shape_down=[8,8,9,4,4,2]"], "adapter.shape_down"),
        (["data.dir=/nonexistent/data"], "/nonexistent/data/glue/SST-2"),
        (["model.model_dir=/nonexistent/models"], "/nonexistent/models/SmolLM2-135M-Instruct"),
    ],
)
def test_user_mistakes_get_one_line_and_no_traceback(args, needle, tmp_path):
    res = adazeta_run(*args, f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("adazeta-run: error:") and needle in lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "result.json").exists()  # nothing heavy happened, nothing was written


def test_a_tiny_run_from_the_command_line(tmp_path, fixture_data):
    res = adazeta_run(
        "model=tiny-llama", "task=sst2", "method=adazeta", "train.max_steps=3", "train.eval_every=3",
        "data.num_train=16", "data.num_dev=8", "data.num_eval=8", "train.batch_size=4",
        f"hydra.run.dir={tmp_path}/run", env={"ADAZETA_DATA_DIR": str(fixture_data)},
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "run" / "result.json").is_file()


def test_dry_run_of_any_model_from_a_folder_holding_only_its_config(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=300).save_pretrained(tmp_path / "gemma")
    res = adazeta_run("model=hf", f"model.path={tmp_path / 'gemma'}", "method=adazeta", "method.adapter.bottleneck=8",
                      "method.adapter.rank=2", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr
    assert "model            hf (causal, fp32)" in res.stdout
    assert "architecture     model_type gemma3_text, hidden_size 32, intermediate_size 64" in res.stdout
    assert "trainable params 888" in res.stdout  # 6 MLP sites found from the structure x 148
    assert "adapters         6" in res.stdout


# --- the pre-check hands its settings to the run ----------------------------------------------------------------


def test_a_run_parses_its_settings_once_the_pre_check_hands_them_over(fixture_data, tmp_path, monkeypatch):
    """``adazeta-run`` composes (once) and parses the command line before Hydra runs it (``adazeta.overrides.check``);
    the run takes those settings instead of parsing Hydra's composition again, and they are the very ones it records.
    A caller without a pre-check (``adazeta.run.run`` alone) parses; a config that differs from the pre-checked one
    is parsed, never replaced."""
    from omegaconf import OmegaConf

    import adazeta.settings as settings_module

    parsed, real_parse = [], settings_module.parse

    def counted(cfg):
        parsed.append(cfg)
        return real_parse(cfg)

    monkeypatch.setattr(settings_module, "parse", counted)
    import hydra

    composed, real_compose = [], hydra.compose

    def counted_compose(*args, **kwargs):
        composed.append(kwargs.get("overrides"))
        return real_compose(*args, **kwargs)

    monkeypatch.setattr(hydra, "compose", counted_compose)  # the pre-check's compositions (Hydra's job has its own)
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *tiny_overrides(fixture_data, "train.max_steps=1"),
                                      f"hydra.run.dir={run_dir}"])
    cli.main()
    assert len(parsed) == 1 and len(composed) == 1
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"

    checked = real_parse(compose_cfg(tiny_overrides(fixture_data)))
    other = compose_cfg(tiny_overrides(fixture_data, "seed=7"))
    assert settings_module.parse_once(compose_cfg(tiny_overrides(fixture_data)), checked) is checked
    assert settings_module.parse_once(other, checked).seed == 7  # not this config's: parsed
    assert settings_module.parse_once(other, None).raw == OmegaConf.to_container(other, resolve=True)
