"""ZO inside a Hugging Face Trainer: a user's Trainer script switches to ZO-SGD with a query schedule and AdaZeta's
TT adapters, trains a few steps on a datasets.Dataset, and its saved output loads with adazeta.load_adapters."""

from __future__ import annotations

import datasets
import pytest
import torch
import transformers
from transformers import TrainingArguments

import adazeta
from adazeta.errors import ConfigError
from adazeta.hf import ZOTrainer, add_adapters


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4)
    return transformers.LlamaForCausalLM(config)


def dataset(n: int = 32, length: int = 12):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, length), generator=gen).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def args(tmp_path, **kw):
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3,
                  logging_steps=1, report_to=[], save_strategy="no", use_cpu=True)
    return TrainingArguments(**{**values, **kw})


def test_a_trainer_script_trains_tt_adapters_with_zo_and_saves_them(tmp_path):
    model = add_adapters(tiny_model(), "tt", bottleneck=8, rank=2, num_factors=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer = ZOTrainer(model=model, args=args(tmp_path), train_dataset=dataset(), zo={"eps": 1e-3},
                        schedule="constant", schedule_config={"q": 2})
    trainer.train()
    zo = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert zo.state_step == 4 and zo.forward_passes == 4 * 2 * 2  # 4 steps x Q 2 x (+eps, -eps)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h]  # logged like any Trainer run
    # no grad_norm (transformers 4.x logs the clipped norm of gradients a ZO step never made: 0), the ZO size instead
    assert not any("grad_norm" in h for h in trainer.state.log_history)
    assert all(h["zo_projected_grad"] > 0 for h in trainer.state.log_history if "loss" in h)
    trainer.save_model()
    reloaded = adazeta.load_adapters(tiny_model(), tmp_path / "out")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_the_adaptive_schedule_raises_q_with_the_epoch(tmp_path):
    model = add_adapters(tiny_model(), "tt", bottleneck=8, rank=2, num_factors=2)
    trainer = ZOTrainer(model=model, args=args(tmp_path, max_steps=16), train_dataset=dataset(16),
                        schedule="adaptive", schedule_config={"alpha": 1.0, "beta": 1.0, "q_max": 4})
    trainer.train()  # 4 steps an epoch: Q = min(max(floor(1 x epoch^1), 1), 4) = 1, 1, 2, 3 over epochs 0-3
    zo = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert zo.forward_passes == 2 * 4 * (1 + 1 + 2 + 3)


def test_lora_through_the_trainer_saves_in_peft_format(tmp_path):
    from peft import PeftModel

    model = add_adapters(tiny_model(), "lora", r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = ZOTrainer(model=model, args=args(tmp_path), train_dataset=dataset(), zo={"lr": 1e-2})
    trainer.train()
    trainer.save_model()
    again = PeftModel.from_pretrained(tiny_model(), str(tmp_path / "out"))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)


def test_gradient_accumulation_is_refused(tmp_path):
    model = add_adapters(tiny_model(), "tt", bottleneck=8, rank=2, num_factors=2)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps must be 1"):
        ZOTrainer(model=model, args=args(tmp_path, gradient_accumulation_steps=2), train_dataset=dataset())


@pytest.mark.parametrize("zo,learning_rate", [({"lr": 0.0}, 1e-4), ({}, 0.0), ({"lr": -1e-3}, 1e-4)])
def test_a_learning_rate_that_never_moves_a_weight_is_refused(zo, learning_rate, tmp_path):
    """As a run's settings refuse method.optimizer.lr <= 0: from zo's lr, else TrainingArguments'."""
    model = add_adapters(tiny_model(), "tt", bottleneck=8, rank=2, num_factors=2)
    with pytest.raises(ConfigError, match=r"ZOTrainer: lr=.* must be > 0"):
        ZOTrainer(model=model, args=args(tmp_path, learning_rate=learning_rate), train_dataset=dataset(), zo=zo)
