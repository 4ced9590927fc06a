"""The training loop: minibatches over epochs, a ZO or first-order step, dev evaluation, best-dev checkpoint.
Over 400 lines: the loop's named pieces (data order, evaluation schedule, one step, checkpoints, observers) sit
beside the short ``train()`` that reads them, in the order they run.

Read top to bottom. Everything it needs arrives as typed arguments; it never sees the Hydra config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from adazeta.distributed import Spread, all_sum_, signals_by_rank
from adazeta.errors import ConfigError
from adazeta.scoring.evaluate import EvalResult, evaluate
from adazeta.guards import GuardConfig, UpdateCheck, UpdateGuard, ranks_agree
from adazeta.optim import zeroth_order
from adazeta.optim.batched import ReplicaClosure
from adazeta.runs.rundir import Interrupted
from adazeta.scoring import Batch, Encoded, Scorer
from adazeta.tasks.objectives import gold_only
from adazeta.tracking import DivergenceMonitor, Progress, Tracker, peak_memory_mb, sync


SELECT_ON = ("loss", "metric")
SAVE = ("best", "last", "both", "none")


@dataclass
class TrainConfig:
    max_steps: int = 10000  # optimizer steps (10,000 in AdaZeta's Llama-2-7B runs)
    batch_size: int = 16  # examples per step (the AdaZeta paper's 16; 64 also reported)
    eval_every: int = 200  # dev evaluation period in steps (200 in AdaZeta's Llama-2-7B runs)
    eval_batch_size: int = 32  # examples per evaluation forward; memory only, never changes results
    grad_accum: int = 1  # first-order only: micro-batches per step (gradients summed over all of them)
    # First-order only: recompute each layer's activations in the backward pass instead of keeping them from the
    # forward (activation checkpointing): the same updates up to rounding for far less activation memory and about
    # one more forward per micro-batch (not counted in forward_passes: it is the same step); evaluation unchanged.
    gradient_checkpointing: bool = False
    keep_best: bool = True  # restore the best-dev-loss trainable state before the test evaluation
    max_forward_passes: int | None = None  # stop once this many forwards were spent (equal-compute comparisons)
    # Evaluate dev each time this many more forward passes were spent, instead of every `eval_every` steps: equal
    # spacing in compute for methods whose steps cost different numbers of forwards (AdaZeta's Q grows).
    eval_every_forwards: int | None = None
    # Write a checkpoint (trainable and optimizer state, data order, RNG, best-dev state) every this many steps, so
    # that a killed run resumes from it; null: only when a stop signal interrupts the run (TERM, INT, HUP, USR1, USR2).
    checkpoint_every: int | None = None
    # Which dev evaluation's state is kept for test: the lowest dev `loss` (the project's default; MeZO's large-model
    # trainer), or the best task `metric` (accuracy / F1: LM-BFF's and MeZO's RoBERTa trainers; ties keep the
    # earlier evaluation).
    select_on: str = "loss"
    # Evaluations before this step are logged but never kept as the best state (the reference trainers evaluate
    # from their first `eval_steps` on: the untrained model is never their "best" checkpoint); 0 keeps step 0 too.
    select_from: int = 0
    # The LM loss (COPA, ReCoRD, SQuAD, DROP): each example's mean token loss averaged over examples (`example`), or
    # the mean over all gold tokens of the batch (`token`: MeZO's CrossEntropyLoss over every option token).
    lm_reduction: str = "example"
    # What a run keeps of what it trained (adazeta.runs.saving): its adapters at the tested best-dev state (`best`), at
    # the last step (`last`), both, or nothing; full-parameter methods write the whole model only with save_model.
    save: str = "best"
    save_model: bool = False

    def __post_init__(self) -> None:
        if self.save not in SAVE:
            raise ConfigError(f"train.save={self.save!r} is not one of {', '.join(SAVE)}")
        if self.lm_reduction not in ("example", "token"):
            raise ConfigError(f"train.lm_reduction={self.lm_reduction!r} is not one of example, token")
        if self.select_on not in SELECT_ON:
            raise ConfigError(f"train.select_on={self.select_on!r} is not one of {', '.join(SELECT_ON)}")
        if self.select_from < 0:
            raise ConfigError(f"train.select_from={self.select_from} must be >= 0")
        if self.keep_best and self.select_from > self.max_steps:
            # No evaluation could be kept: the test would silently score the untrained model.
            raise ConfigError(f"train.select_from={self.select_from} is after the last step (train.max_steps="
                              f"{self.max_steps}): no dev evaluation could be kept for the test; lower "
                              "train.select_from (or set train.keep_best=false to test the final state)")
        if self.max_forward_passes is not None and self.max_forward_passes < 1:
            raise ConfigError(f"train.max_forward_passes={self.max_forward_passes} must be >= 1 or null")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"train.checkpoint_every={self.checkpoint_every} must be >= 1 or null")
        if self.eval_every_forwards is not None and self.eval_every_forwards < 1:
            raise ConfigError(f"train.eval_every_forwards={self.eval_every_forwards} must be >= 1 or null")
        for name in ("max_steps", "batch_size", "eval_every", "eval_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"train.batch_size={self.batch_size} is not divisible by train.grad_accum={self.grad_accum}"
            )


@dataclass
class Outcome:
    status: str  # finished | diverged | stalled | interrupted
    reason: str | None
    steps: int
    best_step: int
    initial_dev: EvalResult
    best_dev: EvalResult
    test: EvalResult | None  # None when interrupted: the run resumes instead of being tested
    forward_passes: int
    signal: str | None = None  # interrupted: the stop signal (the lowest rank's, when several processes got one)
    last_state: dict[str, torch.Tensor] | None = None  # train.save=last|both: the trainable state at the end

    def record_fields(self) -> dict[str, Any]:
        """What happened, as the run record's fields (``adazeta.runs.record.RunRecord``): how it ended, the kept state's
        dev result and, unless it was interrupted (it resumes instead of being tested), its test result."""
        fields: dict[str, Any] = {"status": self.status, "reason": self.reason, "steps": self.steps,
                                  "best_step": self.best_step, "forward_passes": self.forward_passes,
                                  "dev_metrics": dict(self.best_dev.metrics)}  # f1, em
        if self.best_dev.n:
            fields.update(initial_dev_loss=self.initial_dev.loss, initial_dev_score=self.initial_dev.score,
                          dev_loss=self.best_dev.loss, dev_score=self.best_dev.score)
            if self.best_dev.dependence is not None:  # how much the kept state's answers depend on the input
                fields["dev_dependence"] = dataclasses.asdict(self.best_dev.dependence)
        else:  # no dev set (training-free, without a train split): null, not NaN
            fields.update(initial_dev_loss=None, initial_dev_score=None, dev_loss=None, dev_score=None)
        if self.status == "interrupted":  # at a step boundary, checkpointed
            fields["signal"] = self.signal
        else:
            fields.update(test_loss=self.test.loss, test_score=self.test.score, test_metrics=dict(self.test.metrics))
            if self.test.dependence is not None:
                fields["test_dependence"] = dataclasses.asdict(self.test.dependence)
        return fields


class Checkpoints:
    """Where the loop saves its state and how to ask whether it should stop (both optional for ``train``).

    ``save(state)`` writes the loop's state (a dict of tensors and plain values) atomically; ``resume`` is the
    state a previous, interrupted run saved, or None; ``stop()`` returns the reason to stop (a signal's name)
    or None. The loop checks ``stop()`` once per step, after the step's records are written, and once more
    before the test evaluation. ``at(phase, where)`` tells the signal handling what the loop is doing
    (``adazeta.runs.rundir.PHASES``: a training step, or the final evaluation).
    """

    def __init__(self, save: Callable[[dict], None], resume: dict | None = None,
                 stop: Callable[[], str | None] = lambda: None,
                 at: Callable[[str, str], None] = lambda phase, where: None):
        self.save, self.resume, self.stop, self.at = save, resume, stop, at


@dataclass(frozen=True)
class RunLength:
    """How long a run is, decided once (``adazeta.build.run_length``) and handed to the query schedule, the
    record's mean-Q estimate and the training loop."""

    steps_per_epoch: int  # minibatches per pass over the train split (the last one may be short)
    max_steps: int
    max_forward_passes: int | None  # the forward-pass budget, or None
    schedule_epochs: float  # E, the epochs the query schedule is built for
    budget_steps: int | None = None  # the steps the forward budget reaches, when it decided E (adaptive_official)

    @property
    def planned_steps(self) -> int:
        """The steps the run is planned to take: the budget's when it decided E, else the step limit."""
        return self.budget_steps if self.budget_steps is not None else self.max_steps


def steps_per_epoch(num_train: int, batch_size: int) -> int:
    return math.ceil(num_train / batch_size)


@dataclass
class Splits:
    """The examples a run trains on (encoded, batched per step by the loop) and evaluates on (batched once)."""

    train: Sequence[Encoded]
    dev: Sequence[Batch]
    test: Sequence[Batch]


@dataclass
class Loop:
    """What steers the training loop besides its config and what it reports to.

    ``schedule``: Q per epoch (ZO methods); ``length``: the run's length as ``adazeta.build.run_length`` decided it
    (default: from the config and the data); ``checkpoints``: save the loop's state every
    ``train.checkpoint_every`` steps and when ``stop()`` says so (then the run ends ``interrupted``, untested), and
    continue from ``checkpoints.resume``: every number logged after a resume is the one the uninterrupted run logs;
    ``spread``: the run's processes (``adazeta.distributed``) when it runs on several: ZO steps divide their
    queries and minibatch over them, first-order steps train through DistributedDataParallel on data shards.
    """

    tracker: Tracker
    monitor: DivergenceMonitor
    seed: int  # the data order's; perturbations have their own streams
    schedule: Callable[[int], int] = lambda epoch: 1
    length: RunLength | None = None
    checkpoints: Checkpoints | None = None
    spread: Spread | None = None
    guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)  # update measurements, stall stop, checksum
    observers: Sequence["Observer"] = ()  # tools watching the run (``Observer``); they change no number


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the trainable parameters (the best-dev checkpoint, kept in memory)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable_state_(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, value in state.items():
        params[name].copy_(value)


def rng_state() -> dict:
    """Every global generator a step may draw from (dropout in first-order steps), to restore on resume."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@torch.no_grad()
def param_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``params`` together, on their device: one multi-tensor kernel, not one per tensor."""
    norms = torch._foreach_norm(list(params))
    return torch.linalg.vector_norm(torch.stack([n.float().to(norms[0].device) for n in norms]))


def train(scorer: Scorer, optimizer: torch.optim.Optimizer | None, splits: Splits, cfg: TrainConfig,
          loop: Loop) -> Outcome:
    """Train for ``loop.length.max_steps`` steps (none when ``optimizer`` is None) and evaluate the best-dev state.

    ``scorer.objective`` is the task's: classification by default; the LM loss (COPA, ReCoRD); generation
    (SQuAD, DROP: scored by F1 of greedy generations, optionally trained on -F1 by ZO methods).
    Every rank of a run on several processes (``loop.spread``) runs this loop on the same data and takes the same
    decisions. The pieces (``LoopState``: evaluations, the step, checkpoints) are below, in the order they run.
    """
    t = LoopState(scorer, optimizer, splits, cfg, loop)
    if t.resume is None:
        t.initial = t.best = t.dev_eval(0)
        reason = t.monitor.update(t.initial.loss, t.initial.tied, t.initial.dependence) if t.initial.n else None
        if reason is not None:  # e.g. an adapter init that already overflows: nothing to train from
            t.status, t.reason = "diverged", reason
            return Outcome(t.status, reason, 0, 0, t.initial, t.initial, t.final_test(0), 0)
        t.best_state = trainable_state(t.model) if cfg.keep_best and optimizer else None
    else:
        t.restore_evaluations()
    if optimizer is None:
        return Outcome(t.status, t.reason, 0, 0, t.initial, t.best, t.final_test(0), 0)

    t.start_training()  # data order, update guard, progress; a resumed run's weights, optimizer and generators
    for step in t.steps():
        epoch, chosen = t.batches.at(step, splits.train)
        loss, n_queries, check = t.take_step(step, epoch, chosen)
        reason = t.monitor.non_finite(loss)
        if reason is None and check is not None and (reason := t.updates.stalled(optimizer)) is not None:
            t.status, t.reason = "stalled", reason
            break
        out_of_budget = t.budget is not None and t.forward_passes >= t.budget
        if reason is None and t.evals.due(step, t.forward_passes, out_of_budget):
            reason = t.evaluate(step)
        if reason is not None:
            t.status, t.reason = "diverged", reason
            break
        if out_of_budget:
            break
        stop = _stop_request(t.ckpt, t.spread, t.device)  # every rank stops at the same step
        if stop is not None:
            t.save(step)
            t.progress.close()
            return t.outcome_interrupted(stop, f"{stop[1]} at step {step}")
        if cfg.checkpoint_every is not None and step % cfg.checkpoint_every == 0 and step < t.max_steps:
            t.save(step)
    return t.finish()


class Observer:
    """Watches a real run from the loop (diagnostics, benches) instead of copying it: ``on_start`` before the
    first evaluation (hooks go on the model here), ``on_step`` after each step's record (``row``: the metrics.csv
    row), ``on_eval`` after each evaluation. Must not change the model, the optimizer or any generator: the run's
    numbers are the same with or without observers."""

    def on_start(self, scorer: Scorer, optimizer: torch.optim.Optimizer | None) -> None:
        pass

    def on_step(self, step: int, row: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        pass

    def on_eval(self, step: int, split: str, result: EvalResult) -> None:
        pass


class Batches:
    """The training minibatches: a permutation of the train split per epoch from one seeded generator (the data
    order only; ZO perturbations have their own streams), resumable from its state."""

    def __init__(self, n: int, batch_size: int, per_epoch: int, seed: int):
        self.n, self.batch_size, self.per_epoch = n, batch_size, per_epoch
        self.gen = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(n, generator=self.gen)

    def at(self, step: int, train: Sequence[Encoded]) -> tuple[int, list[Encoded]]:
        """(epoch, the examples of ``step``), 1-based steps; a new permutation at each epoch's first step."""
        epoch, slot = divmod(step - 1, self.per_epoch)
        if slot == 0 and step > 1:
            self.order = torch.randperm(self.n, generator=self.gen)
        return epoch, [train[i] for i in self.order[slot * self.batch_size : (slot + 1) * self.batch_size].tolist()]

    def state_dict(self) -> dict[str, Any]:
        return {"order_gen": self.gen.get_state(), "order": self.order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen.set_state(state["order_gen"])
        self.order = state["order"]


class EvalSchedule:
    """When dev is evaluated: every ``eval_every`` steps, or each time ``eval_every_forwards`` more forward passes
    were spent; and always at the last step and when the forward budget runs out."""

    def __init__(self, cfg: TrainConfig, max_steps: int, last_forwards: int = 0):
        self.every, self.every_forwards, self.max_steps = cfg.eval_every, cfg.eval_every_forwards, max_steps
        self.last_forwards = last_forwards  # forward passes at the last evaluation

    def due(self, step: int, forwards: int, out_of_budget: bool) -> bool:
        if self.every_forwards is None:
            due = step % self.every == 0
        else:
            due = forwards // self.every_forwards > self.last_forwards // self.every_forwards
        return due or step == self.max_steps or out_of_budget


class LoopState:
    """The training loop's state and its named pieces: evaluations, one step, checkpoints, the end of a run."""

    def __init__(self, scorer: Scorer, optimizer: torch.optim.Optimizer | None, splits: Splits, cfg: TrainConfig,
                 loop: Loop):
        self.scorer, self.optimizer, self.splits, self.cfg, self.loop = scorer, optimizer, splits, cfg, loop
        self.model, self.device, self.obj = scorer.model, scorer.device, scorer.objective
        self.monitor, self.spread = loop.monitor, loop.spread
        self.ckpt = loop.checkpoints or Checkpoints(save=lambda state: None)
        self.resume = self.ckpt.resume
        if self.obj.zo_loss is not None and optimizer is not None and not zeroth_order(optimizer):
            raise ConfigError(
                "task.f1_objective=true trains on the F1 of generated answers, which has no gradient: "
                "use a zeroth-order method, or set task.f1_objective=false"
            )
        self.status, self.reason, self.step = "finished", None, 0
        self.best_step, self.best_state, self.forward_passes = 0, None, 0
        self.done: tuple[str, str | None] | None = None  # a resumed run whose training had ended: test only
        self.training = False  # start_training() ran: the state can be checkpointed
        for observer in loop.observers:
            observer.on_start(scorer, optimizer)

    # --- evaluations -------------------------------------------------------------------------------------------

    def dev_eval(self, step: int) -> EvalResult:
        # A training run stops at the next step boundary; a training-free one finishes its evaluations first.
        self.ckpt.at("step" if self.optimizer is not None else "final", f"the dev evaluation at step {step}")
        result = evaluate(self.scorer, self.splits.dev, self.obj.dev_generation, desc=f"dev@{step}", keep=True)
        if result.n:  # a training-free run without a train split has no dev set
            self.loop.tracker.log_eval(step, "dev", result.loss, result.score, result.tied)
            for observer in self.loop.observers:
                observer.on_eval(step, "dev", result)
        return result

    def final_test(self, tested_step: int) -> EvalResult:
        """The test evaluation, as the last thing the run does: a first signal lets it finish; a second stops at
        once, after a checkpoint of the trained state (the same command then runs the test alone)."""
        self.ckpt.at("final", "the final test evaluation")
        try:
            result = evaluate(self.scorer, self.splits.test, self.obj.test_generation, desc="test", keep=True)
            self.loop.tracker.log_eval(tested_step, "test", result.loss, result.score, result.tied)
        except Interrupted:
            if self.training:  # a run that trains: keep what it trained, the test alone is left
                self.save(self.step, done=(self.status, self.reason))
            raise
        for observer in self.loop.observers:
            observer.on_eval(tested_step, "test", result)
        self.ckpt.at("save", "the run's record")
        return result

    def restore_evaluations(self) -> None:
        r = self.resume
        self.initial, self.best = EvalResult.restore(r["initial"]), EvalResult.restore(r["best"])
        self.best_step, self.best_state = r["best_step"], r["best_state"]
        self.monitor.load_state_dict(r["monitor"])

    def evaluate(self, step: int) -> str | None:
        """Dev at ``step``: keep the state if it is the best so far; the divergence rule's verdict."""
        self.evals.last_forwards = self.forward_passes
        result = self.dev_eval(step)
        cfg = self.cfg
        if step >= cfg.select_from and self.monitor.keepable(result.tied, result.dependence) and (
                self.best_step < cfg.select_from or better(result, self.best, cfg.select_on)):
            self.best, self.best_step = result, step
            self.best_state = trainable_state(self.model) if cfg.keep_best else None
        self.progress.evaluated(step, result.score, result.metric, result.loss, self.best_step)
        return self.monitor.update(result.loss, result.tied, result.dependence)

    # --- training ----------------------------------------------------------------------------------------------

    def start_training(self) -> None:
        cfg, loop, optimizer, resume = self.cfg, self.loop, self.optimizer, self.resume
        self.training, self.zo = True, zeroth_order(optimizer)
        length = loop.length or RunLength(steps_per_epoch(len(self.splits.train), cfg.batch_size), cfg.max_steps,
                                          cfg.max_forward_passes, 0.0)
        self.max_steps, self.budget = length.max_steps, length.max_forward_passes
        self.batches = Batches(len(self.splits.train), cfg.batch_size, length.steps_per_epoch, loop.seed)
        self.trainable = [p for group in optimizer.param_groups for p in group["params"]]
        self.updates = UpdateGuard(self.trainable, loop.guard, loop.seed)  # measured updates, the stall stop
        self.evals, first_step = EvalSchedule(cfg, self.max_steps), 1
        if resume is not None:
            load_trainable_state_(self.model, resume["trainable"])
            optimizer.load_state_dict(resume["optimizer"])
            self.batches.load_state_dict(resume)
            set_rng_state(resume["rng"])
            self.step = resume["step"]
            first_step, self.forward_passes = self.step + 1, resume["forward_passes"]
            self.evals.last_forwards = resume["last_eval_forwards"]
            self.updates.load_state_dict(resume.get("stalls", []))
            self.done = resume.get("done")
            if self.done is not None:  # the checkpoint of a trained run, written before its test evaluation
                self.status, self.reason = self.done
        self.first_step = first_step
        self.ddp = None
        if self.spread is not None and not self.zo:  # gradients averaged over the ranks' shards
            self.ddp = DistributedDataParallel(
                LossModule(self.scorer), device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False)
        self.progress = Progress(self.max_steps, initial=first_step - 1, budget=self.budget,
                                 initial_forwards=self.forward_passes, select_on=cfg.select_on)
        if resume is not None:
            self.progress.evaluated(self.best_step, self.best.score, self.best.metric, self.best.loss, self.best_step)

    def steps(self) -> Iterator[int]:
        """The steps left to take (none when a resumed run had finished training), each announced to the signal
        handling."""
        last = self.max_steps if self.done is None else self.step
        for step in range(self.first_step, last + 1):
            self.step = step
            self.ckpt.at("step", f"step {step}")
            yield step

    def take_step(self, step: int, epoch: int, chosen: list[Encoded]) -> tuple[float, int, UpdateCheck | None]:
        """One optimizer step on ``chosen``, its record (metrics.csv, wandb, observers) and its checks: (loss,
        queries, the update guard's measurement or None)."""
        optimizer, loop = self.optimizer, self.loop
        if self.obj.trains_on_gold_only:
            chosen = gold_only(chosen)
        measured = self.updates.before(step)
        start = time.perf_counter()
        if self.zo:
            n_queries = loop.schedule(epoch)
            closure, plan = step_closure(self.scorer, chosen, n_queries, self.spread)
            loss = optimizer.step(closure, n_queries=n_queries, **({"plan": plan} if plan is not None else {}))
            self.forward_passes = optimizer.forward_passes
        else:
            n_queries = 0
            loss = first_order_step(self.scorer, optimizer, chosen, self.cfg.grad_accum, ddp=self.ddp,
                                    spread=self.spread)
            self.forward_passes += self.cfg.grad_accum
        loss_value = float(loss)  # one host sync per step, never per query
        sync(self.device)
        step_time = time.perf_counter() - start
        check = self.updates.after(optimizer, step) if measured else None
        row = {
            "step": step,
            "epoch": epoch,
            "loss": loss_value,
            "n_queries": n_queries,
            "forward_passes": self.forward_passes,
            "lr": optimizer.param_groups[0]["lr"],
            "step_time_s": round(step_time, 4),
            "peak_mem_mb": round(peak_memory_mb(self.device), 1),
            "param_norm": round(float(param_norm(self.trainable)), 6),
            **UpdateGuard.columns(check),
        }
        loop.tracker.log_step(row)
        for observer in loop.observers:
            observer.on_step(step, row, optimizer)
        self.progress.step(step, loss_value, n_queries, self.forward_passes)
        guard = loop.guard
        if self.spread is not None and guard.checksum_every and step % guard.checksum_every == 0 \
                and not ranks_agree(self.trainable):
            raise RuntimeError(f"the processes' trainable weights differ at step {step} (checksum over "
                               f"{len(self.trainable)} tensors): the ranks no longer train one model")
        return loss_value, n_queries, check

    # --- checkpoints and the end of a run ----------------------------------------------------------------------

    def save(self, at_step: int, done: tuple[str, str | None] | None = None) -> None:
        """The loop's state to a checkpoint; ``done``: training ended (status, reason), only the test is left."""
        self.ckpt.save({
            "step": at_step, "forward_passes": self.forward_passes, "last_eval_forwards": self.evals.last_forwards,
            "trainable": trainable_state(self.model), "optimizer": self.optimizer.state_dict(),
            **self.batches.state_dict(), "rng": rng_state(),
            "initial": dataclasses.asdict(self.initial), "best": dataclasses.asdict(self.best),
            "best_step": self.best_step, "best_state": self.best_state, "monitor": self.monitor.state_dict(),
            "done": done, "stalls": self.updates.state_dict(),
        })

    def outcome_interrupted(self, stop: tuple[str, str], reason: str) -> Outcome:
        return Outcome("interrupted", reason, self.step, self.best_step, self.initial, self.best, None,
                       self.forward_passes, stop[0])

    def finish(self) -> Outcome:
        """After the last step: a last stop check, the closing checkpoint, the best-dev state back, the test."""
        self.progress.close()
        self.ckpt.at("step", "the end of training")
        # A signal after the loop's last check (a divergence or the forward budget ended it): checkpoint the
        # trained run and stop before its test evaluation, as at the last step.
        stop = _stop_request(self.ckpt, self.spread, self.device)
        if stop is not None:
            self.save(self.step, done=(self.status, self.reason))
            return self.outcome_interrupted(stop, f"{stop[1]} at step {self.step}, before the test evaluation")
        if self.cfg.checkpoint_every is not None:  # a run killed during its test evaluation resumes to the test
            self.save(self.step, done=(self.status, self.reason))
        last_state = trainable_state(self.model) if self.cfg.save in ("last", "both") else None
        if self.cfg.keep_best and self.best_state is not None:
            load_trainable_state_(self.model, self.best_state)
        elif not self.cfg.keep_best:
            self.best_step = self.step
        return Outcome(self.status, self.reason, self.step, self.best_step, self.initial, self.best,
                       self.final_test(self.best_step), self.forward_passes, last_state=last_state)


def step_closure(scorer: Scorer, chosen: list[Encoded], n_queries: int,
                 spread: Spread | None) -> tuple[Callable[[], torch.Tensor], Any]:
    """A ZO step's closure over this rank's share of ``chosen`` (all of it on one process), and the rank's plan."""
    plan = spread.plan(n_queries, len(chosen)) if spread is not None else None
    mine = plan.items(chosen) if plan is not None else chosen  # this rank's shard (all: one process)
    obj = scorer.objective
    if not mine:  # more ranks than examples: this rank adds nothing to the step's losses
        return _no_examples, plan
    if obj.zo_loss is not None:
        return functools.partial(obj.zo_loss, scorer.model, mine), plan
    # A ReplicaClosure also lets a batched_queries optimizer score all perturbations at once.
    batch = scorer.collate(mine)
    return ReplicaClosure(scorer.model, functools.partial(scorer.replica_losses, batch), batch), plan


def _stop_request(ckpt: Checkpoints, spread: Spread | None, device: torch.device) -> tuple[str, str] | None:
    """(the signal, how the record names it) when a stop signal asked the run to stop, on any rank; else None."""
    name = ckpt.stop()
    if spread is None:
        return (name, name) if name is not None else None
    got = signals_by_rank(name, device)
    if not got:
        return None
    first = got[min(got)]
    return first, f"{first} ({'rank' if len(got) == 1 else 'ranks'} {', '.join(str(r) for r in sorted(got))})"


def better(result: EvalResult, best: EvalResult, select_on: str) -> bool:
    """Whether ``result`` replaces ``best`` as the kept state: a strictly lower dev loss, or a strictly higher
    task metric (ties keep the earlier evaluation, as LM-BFF's and MeZO's trainers do)."""
    return result.score > best.score if select_on == "metric" else result.loss < best.loss


def _no_examples() -> torch.Tensor:
    raise RuntimeError("a rank with an empty shard has no loss to evaluate")  # its plan's weight is 0: never called


class LossModule(nn.Module):
    """The minibatch loss as a module's forward, so that DistributedDataParallel can wrap the scoring."""

    def __init__(self, scorer: Scorer):
        super().__init__()
        self.model, self.scorer = scorer.model, scorer  # the model as a submodule: DDP finds its parameters

    def forward(self, batch: Batch | None) -> torch.Tensor:
        if batch is None:  # an empty shard: zero, but through every trainable parameter
            return sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
        return self.scorer.loss(batch)


def first_order_step(
    scorer: Scorer,
    optimizer: torch.optim.Optimizer,
    items: Sequence[Encoded],
    grad_accum: int = 1,
    ddp: DistributedDataParallel | None = None,
    spread: Spread | None = None,
) -> torch.Tensor:
    """One AdamW step; gradients of all ``grad_accum`` micro-batches are summed (each scaled by its share).

    With ``ddp`` (several processes), each rank scores its shard of ``items`` and DDP averages the gradients
    over the ranks; each shard's loss is scaled by N x its share, so that the average is the whole minibatch's.
    """
    model = scorer.model
    model.train()
    optimizer.zero_grad(set_to_none=True)
    whole, scale = len(items), 1.0
    if ddp is not None and spread is not None:
        items = Spread(spread.rank, spread.world_size, "data").plan(1, whole).items(items)
        scale = float(spread.world_size)
    total = torch.zeros((), device=scorer.device)
    if ddp is not None and not items:  # more ranks than examples: a zero loss still joins the gradient average
        ddp(None).backward()
    size = math.ceil(len(items) / grad_accum) if items else 1
    for start in range(0, len(items), size):
        micro = items[start : start + size]
        batch = scorer.collate(micro)
        share = len(micro) / whole * scale
        if ddp is None:
            loss = scorer.loss(batch) * share
            loss.backward()
        else:  # only the last micro-batch's backward all-reduces the summed gradients
            with ddp.no_sync() if start + size < len(items) else contextlib.nullcontext():
                loss = ddp(batch) * share
                loss.backward()
        total += loss.detach() / scale
    if ddp is not None:
        all_sum_(total.reshape(1))
    optimizer.step()  # clips first when the method sets grad_clip (optim.first_order.AdamW)
    model.eval()
    return total
