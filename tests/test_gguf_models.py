"""The ecosystem paths on a model read from a GGUF file (a tiny one the tests write, Q8_0): it loads as a plain float
model that saves and trains; export, method=eval and ZOTrainer (train, evaluate, save, resume_from_checkpoint,
load_best_model_at_end) work on it for TT adapters and LoRA; a failed export leaves no folder; a slow test does the
same on the real SmolLM2 GGUF file."""

from __future__ import annotations

import datasets
import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainingArguments

import adazeta
from adazeta.build import build
from adazeta.errors import ConfigError
from adazeta.export import export
from adazeta.hf import ZOTrainer, add_adapters
from adazeta.models import load_model
from adazeta.run import run
from adazeta.settings import parse
from helpers import (SHARED_MODELS, TINY_GGUF, compose_cfg, gguf_overrides, needs_shared_model, tiny_overrides,
                     write_tiny_gguf)

IDS = torch.tensor([[1, 5, 9, 13, 2, 7]])
METHODS = {"tt": "method=adazeta", "lora": "method=mezo_lora"}


@pytest.fixture
def gguf_path(tmp_path):
    return write_tiny_gguf(tmp_path / "gguf")


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def from_gguf(path):
    """The model as a user reads it: transformers' own from_pretrained, which leaves it marked quantised."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def test_the_tiny_gguf_file_reads_back_as_a_quantised_marked_model(gguf_path):
    """The fixture is what the bug needs: transformers reads the file, dequantises it, and marks it gguf-quantised
    (so save_pretrained refuses it); the tokenizer comes from the file too."""
    model = from_gguf(gguf_path)
    assert model.is_quantized and model.hf_quantizer is not None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="quantized with gguf"):
        model.save_pretrained("unused")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert len(tokenizer) == model.get_input_embeddings().num_embeddings
    assert len(tokenizer(" great").input_ids) == 1


def test_a_model_loaded_from_gguf_is_a_plain_float_model_that_saves(fixture_data, gguf_path, tmp_path):
    """model.path=<file>.gguf loads the file's dequantised weights without the quantised mark, remembers the file's
    name, and saves and reloads as an ordinary model with the same outputs."""
    loaded = load_model(parse(compose_cfg(gguf_overrides(fixture_data, gguf_path))).model)
    model = loaded.model
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    assert not hasattr(model.config, "quantization_config") and model.gguf_file == TINY_GGUF
    torch.testing.assert_close(logits(model), logits(from_gguf(gguf_path)), rtol=0, atol=0)
    model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in (tmp_path / "saved" / "config.json").read_text()
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "saved")), logits(model))


def test_a_user_loaded_gguf_model_is_cleared_and_one_still_packed_is_refused(gguf_path):
    """plain_gguf_model_ clears the mark transformers leaves on a dequantised GGUF model; weights still in GGUF
    blocks (integers) are refused in one line instead."""
    from adazeta.models import plain_gguf_model_

    model = plain_gguf_model_(from_gguf(gguf_path))
    assert not model.is_quantized and getattr(model, "hf_quantizer", None) is None and model.gguf_file == TINY_GGUF
    packed = from_gguf(gguf_path)
    packed.model.norm.weight = torch.nn.Parameter(torch.zeros(32, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(ConfigError, match="keeps 1 of its weights in GGUF blocks .*GgufConfig\\(dequantize=True\\)"):
        plain_gguf_model_(packed)


@pytest.mark.parametrize("kind", ["tt", "lora"])
def test_a_run_on_a_gguf_file_exports_and_evaluates(kind, fixture_data, gguf_path, tmp_path):
    """A TT or LoRA run on the GGUF file exports (TT: base + adapters; LoRA: merged), its README says the weights
    are the file's dequantised ones, and the export gives the outputs method=eval eval.from=<run> rebuilds."""
    record = run(compose_cfg(gguf_overrides(fixture_data, gguf_path, METHODS[kind], "method.optimizer.lr=1e-2",
                                            "train.keep_best=false")), tmp_path / "run")
    assert record["status"] == "finished" and record["model_source"]["gguf_file"] == TINY_GGUF
    export(tmp_path / "run", tmp_path / "out")
    readme = (tmp_path / "out" / "README.md").read_text()
    assert f"GGUF file `{TINY_GGUF}` (Q8_0 quantisation)" in readme
    assert "quantization_config" not in (tmp_path / "out" / "config.json").read_text()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    exported = adazeta.load_adapters(plain, tmp_path / "out" / "adapter") if kind == "tt" else plain
    evaluated = run(compose_cfg(gguf_overrides(fixture_data, gguf_path, "method=eval",
                                               f"eval.from={tmp_path / 'run'}")), tmp_path / "eval")
    assert evaluated["status"] == "finished" and evaluated["test_accuracy"] == record["test_accuracy"]
    trained = build(parse(compose_cfg(gguf_overrides(fixture_data, gguf_path, "method=eval",
                                                     f"eval.from={tmp_path / 'run'}")))).model
    assert not torch.allclose(logits(trained), logits(from_gguf(gguf_path)))  # the trained state is not the base
    torch.testing.assert_close(logits(exported), logits(trained), rtol=1e-4, atol=1e-5)


def test_a_failed_export_leaves_no_folder(fixture_data, gguf_path, tmp_path, monkeypatch):
    """An export that fails after writing the weights (here: the tokenizer cannot be written) leaves neither the
    output folder nor its partial sibling; so does one whose base file is gone."""
    run(compose_cfg(gguf_overrides(fixture_data, gguf_path, "method=adazeta")), tmp_path / "run")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", disk_full)
        with pytest.raises(OSError, match="No space left"):
            export(tmp_path / "run", tmp_path / "exports" / "out")
    assert list((tmp_path / "exports").iterdir()) == []
    gguf_path.unlink()
    with pytest.raises(ConfigError, match="is neither a .gguf file"):
        export(tmp_path / "run", tmp_path / "exports" / "out")
    assert list((tmp_path / "exports").iterdir()) == []


def dataset(n: int = 16, length: int = 10):
    ids = torch.randint(5, 449, (n, length), generator=torch.Generator().manual_seed(1)).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


ADAPTERS = {"tt": dict(bottleneck=8, rank=2, num_factors=2),
            "lora": dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"])}


def trainer(kind, gguf_path, out, **kw):
    """A ZOTrainer on the GGUF model as a user loads it: 4 steps, a checkpoint and an evaluation every 2 steps."""
    model = add_adapters(from_gguf(gguf_path), kind, **ADAPTERS[kind])
    values = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                  logging_steps=1, report_to=[], use_cpu=True, save_strategy="steps", save_steps=2,
                  eval_strategy="steps", eval_steps=2, seed=0)
    return ZOTrainer(model=model, args=TrainingArguments(**{**values, **kw}), train_dataset=dataset(),
                     eval_dataset=dataset(8), zo={"eps": 1e-3}, schedule="constant", schedule_config={"q": 2})


def trained(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def adapter_file(checkpoint):
    return load_file(str(checkpoint / "adapter_model.safetensors"))


@pytest.mark.parametrize("kind", ["tt", "lora"])
def test_zo_trainer_trains_saves_and_resumes_a_gguf_model(kind, gguf_path, tmp_path):
    """On the GGUF model: training moves the adapters and logs no grad_norm but the projected-gradient size;
    evaluate and save_model work; a run resumed from its step-2 checkpoint ends where the uninterrupted run ends."""
    whole = trainer(kind, gguf_path, tmp_path / "whole")
    whole.train()
    logged = [h for h in whole.state.log_history if "loss" in h]
    assert len(logged) == 4 and not any("grad_norm" in h for h in whole.state.log_history)
    assert all(h["zo_projected_grad"] > 0 for h in logged)
    assert whole.evaluate()["eval_loss"] > 0
    whole.save_model()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    base = from_gguf(gguf_path)
    reloaded = adazeta.load_adapters(base, tmp_path / "whole")
    torch.testing.assert_close(logits(reloaded, ids), logits(whole.model, ids))
    assert not torch.allclose(logits(from_gguf(gguf_path), ids), logits(whole.model, ids))

    resumed = trainer(kind, gguf_path, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    zo = getattr(resumed.optimizer, "optimizer", resumed.optimizer)
    assert zo.state_step == 4  # the step count came back with the checkpoint: the same directions follow
    ends, again = trained(whole.model), trained(resumed.model)
    assert ends.keys() == again.keys()
    for name in ends:
        torch.testing.assert_close(again[name], ends[name], rtol=0, atol=1e-7)


@pytest.mark.parametrize("kind", ["tt", "lora"])
def test_zo_trainer_loads_the_best_checkpoint_at_the_end(kind, gguf_path, tmp_path):
    """load_best_model_at_end brings back the adapters of the best checkpoint (here, by a metric that prefers the
    earlier one: step 2), not those of the last step."""
    order = {}

    def earlier_is_better(_):
        return {"earliness": -order["trainer"].state.global_step}

    t = trainer(kind, gguf_path, tmp_path / "out", load_best_model_at_end=True, metric_for_best_model="earliness",
                greater_is_better=True)
    t.compute_metrics = earlier_is_better
    order["trainer"] = t
    t.train()
    assert t.state.best_model_checkpoint.endswith("checkpoint-2")
    best, last = adapter_file(tmp_path / "out" / "checkpoint-2"), adapter_file(tmp_path / "out" / "checkpoint-4")
    assert any(not torch.equal(best[n], last[n]) for n in best)
    now = {n: p.detach() for n, p in t.model.named_parameters() if p.requires_grad}
    if kind == "lora":  # peft's file names drop the adapter name
        now = {n.replace(".default", ""): p for n, p in now.items()}
    assert now.keys() == best.keys()
    for name in best:
        torch.testing.assert_close(now[name], best[name], rtol=0, atol=0)


@pytest.mark.slow
@needs_shared_model
def test_the_real_smollm2_gguf_file_exports_and_trains_in_a_zo_trainer(fixture_data, tmp_path):
    """SmolLM2-135M from its GGUF file: a one-step LoRA run exports as a merged float model, and one ZOTrainer step
    with TT adapters trains and saves."""
    folder = SHARED_MODELS / "SmolLM2-135M-Instruct"
    overrides = tiny_overrides(fixture_data, "method=mezo_lora", "train.max_steps=1", "train.eval_every=1",
                               "data.num_dev=4", "data.num_eval=4")[1:]
    run(compose_cfg(["model=smollm2-135m", f"model.model_dir={SHARED_MODELS}", *overrides]), tmp_path / "run")
    export(tmp_path / "run", tmp_path / "out")
    assert "(Q4_1 quantisation)" in (tmp_path / "out" / "README.md").read_text()
    assert (tmp_path / "out" / "model.safetensors").is_file()

    gguf = next(folder.glob("*.gguf"))
    model = add_adapters(AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32), "tt")
    ids = torch.randint(100, 40000, (4, 12), generator=torch.Generator().manual_seed(0)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path / "zo"), per_device_train_batch_size=4, max_steps=1,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    zo = ZOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}))
    zo.train()
    assert [h for h in zo.state.log_history if "loss" in h][0]["zo_projected_grad"] > 0
    zo.save_model()
    assert (tmp_path / "zo" / "adapter_model.safetensors").is_file()
