"""Zeroth-order training inside a Hugging Face ``Trainer``: keep your own ``Trainer`` script, switch to ZO-SGD.

    from adazeta.hf import ZOTrainer, add_adapters

    model = add_adapters(model, "tt", bottleneck=8, rank=5)       # AdaZeta's TT adapters (or "lora", "bottleneck")
    trainer = ZOTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                        zo={"lr": 1e-4, "eps": 1e-3}, schedule="adaptive")   # any query schedule
    trainer.train()
    trainer.save_model()                                           # adapters, loadable with adazeta.load_adapters

Each training step is one ZO-SGD step (``adazeta.optim.zo_sgd``) on the batch the Trainer hands over: Q queries
(from the schedule, by epoch), the loss the model returns for ``inputs`` (its ``labels``), no backward pass. The
Trainer's learning-rate scheduler, logging, evaluation and checkpoints work as usual: a checkpoint holds the
adapters (as ``save_model`` writes them) and the ZO step count, so ``resume_from_checkpoint`` continues the same
directions and ``load_best_model_at_end`` reloads the best adapters, TT and bottleneck ones included. Gradient
accumulation and clipping do not apply (there is no gradient): no ``grad_norm`` is logged, and each training log
has ``zo_projected_grad`` instead, the mean |projected gradient| (each query's finite-difference estimate of the
gradient along its direction) over the steps since the last log.

A model read from a GGUF file (``from_pretrained(..., gguf_file=...)``) is dequantised to float weights by
transformers but still marked quantised, which the Trainer refuses; ``add_adapters`` and ``ZOTrainer`` clear that
mark (``adazeta.models.plain_gguf_model_``), so it trains and saves as the float model it is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from adazeta.errors import ConfigError
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig


class TrainerZOSGD(ZOSGD):
    """ZO-SGD whose step is taken in ``ZOTrainer.training_step``; the Trainer's own ``optimizer.step()`` after it
    (no closure) has nothing left to do."""

    def step(self, closure: Any = None, n_queries: int | None = None, plan: Any = None) -> Any:  # type: ignore[override]
        if closure is None:
            return None
        return super().step(closure, n_queries=n_queries, plan=plan)


def add_adapters(model: nn.Module, kind: str = "tt", **config: Any) -> nn.Module:
    """Attach the project's adapters (``tt``, ``bottleneck``, ``lora``) to a ``transformers`` model; only they train."""
    from adazeta.adapters import ADAPTERS
    from adazeta.registry import make_config

    from adazeta.models import plain_gguf_model_

    if kind not in ("tt", "bottleneck", "lora"):
        raise ConfigError(f"add_adapters(kind={kind!r}): one of tt, bottleneck, lora")
    plain_gguf_model_(model)  # read from a GGUF file: its dequantised weights, no longer marked quantised
    entry = ADAPTERS.get(kind)
    cfg = make_config(entry.config_cls, dict(config), where=f"add_adapters({kind!r})")
    if kind == "tt" and cfg.init == "reference" and "init" not in config:
        cfg.init = "identity"  # start exactly at the backbone (the reference init moves its activations)
    model = entry.builder(model, cfg)
    model._adazeta_adapter = (kind, cfg)  # what ZOTrainer.save_model writes
    return model


class ZOTrainer(Trainer):
    """A ``transformers.Trainer`` whose steps are zeroth-order (``zo``: ``ZOSGDConfig`` fields; ``schedule``: a
    query schedule's name, ``schedule_config`` its fields). The trainable parameters are those with
    ``requires_grad`` (after ``add_adapters``: the adapters)."""

    def __init__(self, *args: Any, zo: dict[str, Any] | None = None, schedule: str = "constant",
                 schedule_config: dict[str, Any] | None = None, seed: int = 0, **kwargs: Any):
        from adazeta.models import plain_gguf_model_
        from adazeta.registry import make_config
        from adazeta.schedules import SCHEDULES

        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, nn.Module):
            plain_gguf_model_(model)  # the Trainer refuses a model marked quantised, as a GGUF file's model is
        super().__init__(*args, **kwargs)
        self._zo_grad_sum: torch.Tensor | float = 0.0  # mean |projected gradient| of each step since the last log
        self._zo_grad_steps = 0
        self.zo_values = dict(zo or {})  # the step size: zo's lr, else TrainingArguments.learning_rate
        self.zo_config = make_config(ZOSGDConfig, {"lr": self.args.learning_rate, **self.zo_values}, where="ZOTrainer zo")
        if self.zo_config.lr <= 0:  # a run's settings refuse it too (adazeta.settings); no weight would ever move
            raise ConfigError(f"ZOTrainer: lr={self.zo_config.lr!r} must be > 0: a learning rate of "
                              f"{self.zo_config.lr!r} never moves a weight; set zo={{'lr': 1e-4}} or "
                              "TrainingArguments(learning_rate=1e-4)")
        self.schedule_name, self.schedule_values, self.zo_seed = schedule, dict(schedule_config or {}), seed
        self._schedule = None
        SCHEDULES.config(schedule, self.schedule_values)  # a bad name or value fails here, before training
        if self.args.gradient_accumulation_steps != 1:
            raise ConfigError("ZOTrainer: gradient_accumulation_steps must be 1 (a ZO step has no gradient to "
                              "accumulate); raise per_device_train_batch_size instead")

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            if not trainable:
                raise ConfigError("ZOTrainer: the model has no trainable parameters (add_adapters, or requires_grad)")
            self.optimizer = TrainerZOSGD(trainable, self.zo_config, seed=self.zo_seed)
        return self.optimizer

    def _queries(self) -> int:
        from adazeta.schedules import SCHEDULES

        if self._schedule is None:
            epochs = self.args.num_train_epochs if self.args.max_steps <= 0 else max(
                1.0, self.args.max_steps / max(1, len(self.get_train_dataloader())))
            self._schedule = SCHEDULES.get(self.schedule_name).builder(
                SCHEDULES.config(self.schedule_name, self.schedule_values), float(epochs))
        epoch = int(math.floor(self.state.epoch or 0.0))
        return self._schedule(epoch)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        model.eval()  # no dropout between a query's two forwards: both must see the same function
        inputs = self._prepare_inputs(inputs)

        def closure() -> torch.Tensor:
            return model(**inputs).loss

        zo = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps the optimizer
        with torch.no_grad():
            loss = zo.step(closure, n_queries=self._queries())
        grads = getattr(zo, "last_projected_grads", None)
        if grads is not None:  # summed on the device: read once per log, not once per step
            self._zo_grad_sum = self._zo_grad_sum + grads.detach().abs().mean()
            self._zo_grad_steps += 1
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # a ZO step has no gradient to clip (the Trainer's max_grad_norm does not apply)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # no gradient norm: the Trainer would log 0 for the gradients that were never computed

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with ``zo_projected_grad`` (mean |projected gradient| since the last log) beside a
        training loss, and no ``grad_norm`` (0 for gradients that were never computed)."""
        logs.pop("grad_norm", None)  # transformers 4.x clips (and logs the norm of) gradients a ZO step never made
        if "loss" in logs and self._zo_grad_steps:
            logs["zo_projected_grad"] = float(self._zo_grad_sum) / self._zo_grad_steps
            self._zo_grad_sum, self._zo_grad_steps = 0.0, 0
        if start_time is None:  # older Trainers take no start_time
            super().log(logs)
        else:
            super().log(logs, start_time)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """TT and bottleneck adapters come back from the checkpoint's ``adapter_model.safetensors``; LoRA and other
        models as the Trainer loads them."""
        if not self._load_adapters_from(resume_from_checkpoint, model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if not self._load_adapters_from(self.state.best_model_checkpoint):
            super()._load_best_model()

    def _load_adapters_from(self, checkpoint: str | None, model: nn.Module | None = None) -> bool:
        """Load the adapters ``save_model`` wrote to ``checkpoint`` into the model, if it carries TT or bottleneck
        adapters from ``add_adapters``; False (nothing done) for LoRA and other models."""
        from adazeta.runs.saving import load_adapter_state_

        model = model if model is not None else self.model
        attached = getattr(model, "_adazeta_adapter", None)
        if attached is None or attached[0] == "lora" or checkpoint is None:
            return False
        load_adapter_state_(model, checkpoint)
        return True

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Adapters attached with ``add_adapters`` are written as ``adazeta.save_adapters`` writes them (peft's format
        for LoRA); any other model as the Trainer saves it."""
        from adazeta.runs.saving import save_adapters

        attached = getattr(self.model, "_adazeta_adapter", None)
        if attached is None:
            return super().save_model(output_dir, _internal_call)
        kind, cfg = attached
        out = output_dir or self.args.output_dir
        name = getattr(getattr(self.model, "config", None), "_name_or_path", "") or "unknown"
        base = {"name": name}
        gguf_file = next((m.gguf_file for m in self.model.modules() if getattr(m, "gguf_file", None)), None)
        if gguf_file:  # provenance: trained on the dequantised weights of that file
            base["gguf_file"] = gguf_file
        save_adapters(self.model, out, kind, cfg, base)
        return None
