"""Keep what a run trains: adapter/ holds the tested state in a loadable format, `method=eval eval.from=<run>`
scores it again in a fresh process bit for bit, peft loads LoRA folders itself, a mismatched base model and a
save_pretrained of an adapted model are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from adazeta.errors import ConfigError
from adazeta.build import build
from adazeta.run import run
from adazeta.settings import parse
from adazeta.runs.saving import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapters
from helpers import ROOT, SHARED_MODELS, compose_cfg, needs_shared_model, tiny_overrides


def cli(*args: str) -> subprocess.CompletedProcess:
    """adazeta-run in a fresh process (nothing shared with the run that saved)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "adazeta.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def result(run_dir):
    return json.loads((run_dir / "result.json").read_text())


@pytest.mark.parametrize("method", ["adazeta", "adapter", "mezo_lora"])
def test_a_saved_run_scores_the_same_in_a_fresh_process(method, fixture_data, tmp_path):
    trained = tmp_path / "trained"
    record = run(compose_cfg(tiny_overrides(fixture_data, f"method={method}")), trained)
    saved = trained / "adapter"
    assert (saved / "README.md").is_file() and "Command: `adazeta-run" in (saved / "README.md").read_text()
    if method == "mezo_lora":
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in saved.iterdir()}
    else:
        assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= {p.name for p in saved.iterdir()}
    done = cli(*tiny_overrides(fixture_data, "method=eval", f"eval.from={trained}"),
               f"hydra.run.dir={tmp_path / 'again'}")
    assert done.returncode == 0, done.stderr[-2000:]
    again = result(tmp_path / "again")
    assert again["config"]["method"]["adapter"]["source"] == str(trained)  # the result names its source
    assert (again["test_loss"], again["test_accuracy"]) == (record["test_loss"], record["test_accuracy"])
    assert (tmp_path / "again" / "predictions" / "test.csv").read_text() == \
        (trained / "predictions" / "test.csv").read_text()


def test_peft_loads_a_saved_lora_folder_itself(fixture_data, tmp_path):
    from peft import PeftModel

    run(compose_cfg(tiny_overrides(fixture_data, "method=mezo_lora")), tmp_path / "trained")
    s = parse(compose_cfg(tiny_overrides(fixture_data, "method=zero_shot")))
    base = build(s).model  # the plain tiny model, as the run drew it
    trained = build(parse(compose_cfg(tiny_overrides(fixture_data, "method=eval",
                                                     f"eval.from={tmp_path / 'trained'}")))).model
    wrapped = PeftModel.from_pretrained(base, str(tmp_path / "trained" / "adapter"))
    mine = {n: p for n, p in trained.named_parameters() if "lora_B" in n}
    theirs = {n: p for n, p in wrapped.named_parameters() if "lora_B" in n}
    assert mine.keys() == theirs.keys() and mine
    assert all(torch.equal(mine[n], theirs[n]) for n in mine) and any(bool(p.abs().sum()) for p in mine.values())


def test_a_different_base_model_is_refused_in_one_line(fixture_data, tmp_path):
    run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta")), tmp_path / "trained")
    done = cli(*tiny_overrides(fixture_data, "method=eval", f"eval.from={tmp_path / 'trained'}",
                               "model.architecture.num_hidden_layers=1"), f"hydra.run.dir={tmp_path / 'again'}")
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "another architecture than this model's (num_hidden_layers 2 -> 1)" in lines[0]


@pytest.mark.parametrize("source,message", [
    (None, "method=eval needs eval.from="),
    ("missing", "no such folder"),
    ("empty", "holds no saved adapters"),
])
def test_eval_without_saved_adapters_is_one_line_before_any_model_loads(source, message, fixture_data, tmp_path,
                                                                         monkeypatch, capsys):
    from test_bad_input import run_cli

    (tmp_path / "empty").mkdir()
    extra = [] if source is None else [f"eval.from={tmp_path / source}"]
    code, err = run_cli(monkeypatch, capsys, [*tiny_overrides(fixture_data, "method=eval", *extra),
                                               f"hydra.run.dir={tmp_path / 'run'}"])
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "run" / "result.json").exists()


def test_save_pretrained_of_an_adapted_model_is_refused(fixture_data, tmp_path):
    model = build(parse(compose_cfg(tiny_overrides(fixture_data, "method=adazeta")))).model
    with pytest.raises(ConfigError, match="save the adapters with adazeta.save_adapters"):
        model.save_pretrained(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_load_adapters_onto_a_plain_model_gives_the_trained_forward(fixture_data, tmp_path):
    run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta")), tmp_path / "trained")
    s = parse(compose_cfg(tiny_overrides(fixture_data, "method=zero_shot")))
    plain = build(s).model
    loaded = load_adapters(plain, tmp_path / "trained" / "adapter")
    evaluated = build(parse(compose_cfg(tiny_overrides(fixture_data, "method=eval",
                                                       f"eval.from={tmp_path / 'trained'}")))).model
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, evaluated(ids).logits)


def test_save_last_and_none(fixture_data, tmp_path):
    run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "train.save=both", "train.max_steps=6",
                                   "train.eval_every=3")), tmp_path / "both")
    assert (tmp_path / "both" / "adapter").is_dir() and (tmp_path / "both" / "adapter_last").is_dir()
    run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "train.save=none")), tmp_path / "none")
    assert not (tmp_path / "none" / "adapter").exists()
    with pytest.raises(ConfigError, match="train.save='every' is not one of best, last, both, none"):
        parse(compose_cfg(tiny_overrides(fixture_data, "train.save=every")))


def test_full_parameter_methods_write_the_model_only_on_request(fixture_data, tmp_path):
    from transformers import AutoModelForCausalLM

    run(compose_cfg(tiny_overrides(fixture_data, "method=mezo")), tmp_path / "plain")
    assert not (tmp_path / "plain" / "model").exists() and not (tmp_path / "plain" / "adapter").exists()
    run(compose_cfg(tiny_overrides(fixture_data, "method=mezo", "train.save_model=true")), tmp_path / "kept")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "kept" / "model")
    assert (tmp_path / "kept" / "model" / "README.md").is_file()
    assert sum(p.numel() for p in reloaded.parameters()) > 0


def test_a_dry_run_of_eval_counts_the_saved_adapters(fixture_data, tmp_path, capsys):
    run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta")), tmp_path / "trained")
    run(compose_cfg(tiny_overrides(fixture_data, "method=eval", f"eval.from={tmp_path / 'trained'}",
                                   "dry_run=true")), tmp_path / "dry")
    out = capsys.readouterr().out
    assert "adapter: saved" in out and "adapters         6" in out


def test_another_model_of_the_same_architecture_loads_with_a_warning(fixture_data, tmp_path, caplog):
    import json as _json

    run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta")), tmp_path / "trained")
    meta_path = tmp_path / "trained" / "adapter" / ADAPTER_CONFIG
    meta = _json.loads(meta_path.read_text())
    meta["base_model"]["hub_id"] = "org/some-model"
    meta_path.write_text(_json.dumps(meta))
    plain = build(parse(compose_cfg(tiny_overrides(fixture_data, "method=zero_shot")))).model
    plain.config._name_or_path = "org/another-model"
    with caplog.at_level("WARNING", logger="adazeta"):
        load_adapters(plain, tmp_path / "trained" / "adapter")
    assert "were trained on org/some-model; this model is org/another-model" in caplog.text


def test_eval_takes_task_data_seed_and_model_from_the_saved_run(fixture_data, tmp_path):
    """``method=eval eval.from=<run>`` alone scores what the run scored (its task, split sizes, seed, model), not
    the defaults (SST-2's 872 test sentences on SmolLM2), and says so; the command line still wins."""
    trained = tmp_path / "trained"
    record = run(compose_cfg(tiny_overrides(fixture_data, "method=adazeta", "seed=3", "data.num_eval=12")), trained)
    where = [f"data.dir={fixture_data}", "wandb.mode=disabled"]
    done = cli("method=eval", f"eval.from={trained}", *where, f"hydra.run.dir={tmp_path / 'again'}")
    assert done.returncode == 0, done.stderr[-2000:]
    again = result(tmp_path / "again")
    assert (again["task"], again["model"], again["seed"], again["num_train"], again["num_dev"], again["num_eval"]) == \
        ("rte", "tiny-llama", 3, 32, 16, 12)
    assert (again["test_loss"], again["test_accuracy"]) == (record["test_loss"], record["test_accuracy"])
    assert f"method=eval: scoring the adapters of {trained} (adazeta on rte, seed 3) on task rte with model " \
           "tiny-llama, seed 3, data.num_train=32, num_dev=16, num_eval=12" in done.stdout
    assert "from the command: nothing" in done.stdout
    # What the command line sets is the command's: here a smaller test split of the same task.
    done = cli("method=eval", f"eval.from={trained / 'adapter'}", "data.num_eval=8", *where,
               f"hydra.run.dir={tmp_path / 'fewer'}")
    assert done.returncode == 0, done.stderr[-2000:]
    fewer = result(tmp_path / "fewer")
    assert (fewer["task"], fewer["seed"], fewer["num_eval"]) == ("rte", 3, 8)
    assert "from the command: data.num_eval" in done.stdout


def saved_base(folder) -> None:
    """A tiny llama and its tokenizer as a save_pretrained folder: a base model the card's snippet can load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from adazeta.models import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=len(tokenizer),
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("method", ["mezo_lora", "adazeta"])
def test_the_model_card_has_hub_metadata_and_its_snippet_loads_the_adapters(method, fixture_data, tmp_path):
    from huggingface_hub import ModelCard

    saved_base(tmp_path / "base")
    extra = ["method.adapter.bottleneck=8", "method.adapter.rank=2"] if method == "adazeta" else []
    run(compose_cfg(tiny_overrides(fixture_data, "model=hf", f"model.path={tmp_path / 'base'}", f"method={method}",
                                   *extra)), tmp_path / "trained")
    folder = tmp_path / "trained" / "adapter"
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == ("peft" if method == "mezo_lora" else "adazeta")
    assert {"adazeta", "zeroth-order", f"method:{method}", "task:rte"} <= set(card.data.tags)
    assert card.data.pipeline_tag == "text-generation" and card.data.base_model is None  # no Hub id: no local path
    assert f"# {method} on rte (hf)" in card.text
    if method == "mezo_lora":  # peft's card is merged into, not replaced: its tags and text are still there
        assert "lora" in card.data.tags and "### Framework versions" in card.text
        peft_config = json.loads((folder / "adapter_config.json").read_text())
        assert peft_config["base_model_name_or_path"] == "base"  # the folder's name, not its absolute path
    snippet = card.text.split("```python\n", 1)[1].split("```", 1)[0]
    names: dict = {}
    exec(compile(snippet, "README.md", "exec"), names)  # as written: every name it uses, it defines
    ids = torch.tensor([[5, 6, 7, 8]])
    from adazeta.runs.saving import load_adapters
    from transformers import AutoModelForCausalLM

    expected = load_adapters(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), folder)
    assert torch.equal(names["model"](ids).logits, expected(ids).logits)


def test_the_model_card_says_when_the_base_came_from_a_gguf_file(tmp_path):
    from huggingface_hub import ModelCard

    from adazeta.runs.saving import model_card

    record = {"method": "adazeta", "task": "sst2", "model": "smollm2-135m", "seed": 0, "status": "finished",
              "steps": 10, "best_step": 10, "model_source": {"kind": "hub", "path": "org/Model-GGUF",
                                                                "gguf_file": "Model.Q4_1.gguf"}}
    base = {"name": "smollm2-135m", "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "family": "causal"}
    card = ModelCard(model_card(record, ["method=adazeta"], "tt", base, tmp_path))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and "gguf" in card.data.tags
    assert "read from the GGUF file `Model.Q4_1.gguf`" in card.text and "dequantises" in card.text
    snippet = card.text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "BASE = 'org/Model-GGUF'" in snippet and "GGUF = 'Model.Q4_1.gguf'" in snippet
    assert "from_pretrained(BASE, gguf_file=GGUF)" in snippet


@needs_shared_model
def test_a_gguf_files_quantisation_is_read_from_its_metadata():
    from adazeta.runs.saving import gguf_quantisation

    assert gguf_quantisation(str(SHARED_MODELS / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")) == "Q4_1"
