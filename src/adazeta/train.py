"""The training loop: minibatches over epochs, a ZO or first-order step, dev evaluation, best-dev checkpoint.
Over 400 lines: the loop's named pieces (how it ends, data order, evaluation schedule, the kept state, the position,
a resume, one step, checkpoints, observers) sit beside the short ``train()`` that reads them, in the order they
run; ``train()`` has one exit and leaves every ending to the piece that sees it.

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
    decisions. The pieces (``LoopState`` and what it holds: the kept state, the position, a resume) are below, in
    the order they run; each ``Ending`` is decided by the piece that saw it.
    """
    t = LoopState(scorer, optimizer, splits, cfg, loop)
    ending = t.begin()  # the initial dev evaluation (a resumed run's, restored); an init already diverged ends here
    if ending is None and optimizer is not None:
        ending = t.start_training()  # None, or the ending of a resumed run whose training had ended (test left)
        for step in t.steps():
            if (ending := t.advance(step)) is not None:
                break
    return t.finish(ending)


@dataclass(frozen=True)
class Ending:
    """How training ended, decided where it was seen: ``diverged`` or ``stalled`` (the guard's reason),
    ``finished`` (the last step or the forward budget), or ``interrupted`` by a stop signal at a step boundary
    (checkpointed; the run resumes instead of being tested)."""

    status: str
    reason: str | None = None
    signal: str | None = None  # interrupted: the stop signal (the lowest rank's, when several processes got one)

    @staticmethod
    def interrupted(stop: tuple[str, str], where: str) -> "Ending":
        return Ending("interrupted", f"{stop[1]} at {where}", stop[0])

    @property
    def done(self) -> tuple[str, str | None]:
        """How a checkpoint written after training records it (the test is what is left)."""
        return self.status, self.reason


FINISHED = Ending("finished")


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


class Kept:
    """The best-state keeper: the initial and the best dev evaluation, the step of the best and the trainable state
    kept in memory for it (``train.keep_best``). An evaluation replaces the best from ``train.select_from`` on, by
    ``better``'s rule, when the divergence monitor calls it keepable (not collapsed)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.initial: EvalResult | None = None
        self.best: EvalResult | None = None
        self.step = 0
        self.state: dict[str, torch.Tensor] | None = None

    def start(self, initial: EvalResult) -> None:
        self.initial = self.best = initial

    def keep_initial(self, model: nn.Module) -> None:
        self.state = trainable_state(model) if self.cfg.keep_best else None

    def offer(self, step: int, result: EvalResult, monitor: DivergenceMonitor, model: nn.Module) -> None:
        cfg = self.cfg
        if step >= cfg.select_from and monitor.keepable(result.tied, result.dependence) and (
                self.step < cfg.select_from or better(result, self.best, cfg.select_on)):
            self.best, self.step = result, step
            self.state = trainable_state(model) if cfg.keep_best else None

    def put_back_(self, model: nn.Module, last_step: int) -> None:
        """After training: the kept state into the model (``train.keep_best``), else the last step is the kept one."""
        if self.cfg.keep_best and self.state is not None:
            load_trainable_state_(model, self.state)
        elif not self.cfg.keep_best:
            self.step = last_step

    def state_dict(self) -> dict[str, Any]:
        return {"initial": dataclasses.asdict(self.initial), "best": dataclasses.asdict(self.best),
                "best_step": self.step, "best_state": self.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial, self.best = EvalResult.restore(state["initial"]), EvalResult.restore(state["best"])
        self.step, self.state = state["best_step"], state["best_state"]


class Position:
    """Where training is: the step (1-based; 0 before the first), the forward passes spent, the last step to take
    and the forward budget."""

    def __init__(self, max_steps: int, budget: int | None):
        self.max_steps, self.budget = max_steps, budget
        self.step, self.forward_passes = 0, 0

    @property
    def out_of_budget(self) -> bool:
        return self.budget is not None and self.forward_passes >= self.budget

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "forward_passes": self.forward_passes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.forward_passes = state["step"], state["forward_passes"]


class Resume:
    """The checkpoint an interrupted run left (``LoopState.save`` wrote it), read back piece by piece: the
    evaluations before training starts, the rest (weights, optimizer, data order, generators, position, update
    guard) when it does. ``ending``: training had ended when it was written; only the test is left."""

    def __init__(self, state: dict[str, Any]):
        self.state = state
        done = state.get("done")
        self.ending = Ending(*done) if done is not None else None

    def restore_evaluations(self, kept: Kept, monitor: DivergenceMonitor) -> None:
        kept.load_state_dict(self.state)
        monitor.load_state_dict(self.state["monitor"])

    def restore_training(self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: "Batches",
                         position: Position, evals: "EvalSchedule", updates: UpdateGuard) -> None:
        s = self.state
        load_trainable_state_(model, s["trainable"])
        optimizer.load_state_dict(s["optimizer"])
        batches.load_state_dict(s)
        set_rng_state(s["rng"])
        position.load_state_dict(s)
        evals.last_forwards = s["last_eval_forwards"]
        updates.load_state_dict(s.get("stalls", []))


class LoopState:
    """The training loop's pieces and what they share: the run's inputs, the kept state (``Kept``), the position
    (``Position``), a resume (``Resume``), and the parts built when training starts (data order, evaluation
    schedule, update guard, progress)."""

    def __init__(self, scorer: Scorer, optimizer: torch.optim.Optimizer | None, splits: Splits, cfg: TrainConfig,
                 loop: Loop):
        self.scorer, self.optimizer, self.splits, self.cfg, self.loop = scorer, optimizer, splits, cfg, loop
        self.model, self.device, self.obj = scorer.model, scorer.device, scorer.objective
        self.monitor, self.spread = loop.monitor, loop.spread
        self.ckpt = loop.checkpoints or Checkpoints(save=lambda state: None)
        self.resume = Resume(self.ckpt.resume) if self.ckpt.resume is not None else None
        if self.obj.zo_loss is not None and optimizer is not None and not zeroth_order(optimizer):
            raise ConfigError(
                "task.f1_objective=true trains on the F1 of generated answers, which has no gradient: "
                "use a zeroth-order method, or set task.f1_objective=false"
            )
        self.kept = Kept(cfg)
        self.position = Position(cfg.max_steps, cfg.max_forward_passes)  # start_training() sets the run's length
        self.training = False  # start_training() ran: the state can be checkpointed
        for observer in loop.observers:
            observer.on_start(scorer, optimizer)

    # --- evaluations -------------------------------------------------------------------------------------------

    def begin(self) -> Ending | None:
        """The initial dev evaluation and the divergence rule's first verdict; a resumed run's, restored."""
        if self.resume is not None:
            self.resume.restore_evaluations(self.kept, self.monitor)
            return None
        initial = self.dev_eval(0)
        self.kept.start(initial)
        reason = self.monitor.update(initial.loss, initial.tied, initial.dependence) if initial.n else None
        if reason is not None:  # e.g. an adapter init that already overflows: nothing to train from
            return Ending("diverged", reason)
        if self.optimizer is not None:
            self.kept.keep_initial(self.model)
        return None

    def dev_eval(self, step: int) -> EvalResult:
        # A training run stops at the next step boundary; a training-free one finishes its evaluations first.
        self.ckpt.at("step" if self.optimizer is not None else "final", f"the dev evaluation at step {step}")
        result = evaluate(self.scorer, self.splits.dev, self.obj.dev_generation, desc=f"dev@{step}", keep=True)
        if result.n:  # a training-free run without a train split has no dev set
            self.loop.tracker.log_eval(step, "dev", result.loss, result.score, result.tied)
            for observer in self.loop.observers:
                observer.on_eval(step, "dev", result)
        return result

    def final_test(self, tested_step: int, ending: Ending) -> EvalResult:
        """The test evaluation, as the last thing the run does: a first signal lets it finish; a second stops at
        once, after a checkpoint of the trained state (the same command then runs the test alone)."""
        self.ckpt.at("final", "the final test evaluation")
        try:
            result = evaluate(self.scorer, self.splits.test, self.obj.test_generation, desc="test", keep=True)
            self.loop.tracker.log_eval(tested_step, "test", result.loss, result.score, result.tied)
        except Interrupted:
            if self.training:  # a run that trains: keep what it trained, the test alone is left
                self.save(done=ending.done)
            raise
        for observer in self.loop.observers:
            observer.on_eval(tested_step, "test", result)
        self.ckpt.at("save", "the run's record")
        return result

    def evaluate(self, step: int) -> str | None:
        """Dev at ``step``: offered to the keeper; the divergence rule's verdict."""
        self.evals.last_forwards = self.position.forward_passes
        result = self.dev_eval(step)
        self.kept.offer(step, result, self.monitor, self.model)
        self.progress.evaluated(step, result.score, result.metric, result.loss, self.kept.step)
        return self.monitor.update(result.loss, result.tied, result.dependence)

    # --- training ----------------------------------------------------------------------------------------------

    def start_training(self) -> Ending | None:
        """The parts training needs (data order, update guard, evaluation schedule, progress; the run's length);
        a resumed run's weights, optimizer, generators and position. Returns the ending of a resumed run whose
        training had ended (its test is left), else None."""
        cfg, loop, optimizer = self.cfg, self.loop, self.optimizer
        self.training, self.zo = True, zeroth_order(optimizer)
        length = loop.length or RunLength(steps_per_epoch(len(self.splits.train), cfg.batch_size), cfg.max_steps,
                                          cfg.max_forward_passes, 0.0)
        self.position = Position(length.max_steps, length.max_forward_passes)
        self.batches = Batches(len(self.splits.train), cfg.batch_size, length.steps_per_epoch, loop.seed)
        self.trainable = [p for group in optimizer.param_groups for p in group["params"]]
        self.updates = UpdateGuard(self.trainable, loop.guard, loop.seed)  # measured updates, the stall stop
        self.evals = EvalSchedule(cfg, length.max_steps)
        if self.resume is not None:
            self.resume.restore_training(self.model, optimizer, self.batches, self.position, self.evals,
                                         self.updates)
        self.ddp = None
        if self.spread is not None and not self.zo:  # gradients averaged over the ranks' shards
            self.ddp = DistributedDataParallel(
                LossModule(self.scorer), device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False)
        p = self.position
        self.progress = Progress(p.max_steps, initial=p.step, budget=p.budget, initial_forwards=p.forward_passes,
                                 select_on=cfg.select_on)
        if self.resume is not None:
            kept = self.kept
            self.progress.evaluated(kept.step, kept.best.score, kept.best.metric, kept.best.loss, kept.step)
            return self.resume.ending
        return None

    def steps(self) -> Iterator[int]:
        """The steps left to take (none when a resumed run had finished training), each announced to the signal
        handling."""
        p = self.position
        last = p.max_steps if self.resume is None or self.resume.ending is None else p.step
        for step in range(p.step + 1, last + 1):
            p.step = step
            self.ckpt.at("step", f"step {step}")
            yield step

    def advance(self, step: int) -> Ending | None:
        """One step and what follows it: the guards' verdicts, a due evaluation, the forward budget, a stop signal
        (checkpoint, then end) and the periodic checkpoint. The ending, if this step ends training."""
        epoch, chosen = self.batches.at(step, self.splits.train)
        loss, n_queries, check = self.take_step(step, epoch, chosen)
        reason = self.monitor.non_finite(loss)
        if reason is None and check is not None and (stalled := self.updates.stalled(self.optimizer)) is not None:
            return Ending("stalled", stalled)
        out_of_budget = self.position.out_of_budget
        if reason is None and self.evals.due(step, self.position.forward_passes, out_of_budget):
            reason = self.evaluate(step)
        if reason is not None:
            return Ending("diverged", reason)
        if out_of_budget:
            return FINISHED
        stop = _stop_request(self.ckpt, self.spread, self.device)  # every rank stops at the same step
        if stop is not None:
            self.save()
            return Ending.interrupted(stop, f"step {step}")
        if self.cfg.checkpoint_every is not None and step % self.cfg.checkpoint_every == 0 \
                and step < self.position.max_steps:
            self.save()
        return None

    def take_step(self, step: int, epoch: int, chosen: list[Encoded]) -> tuple[float, int, UpdateCheck | None]:
        """One optimizer step on ``chosen``, its record (metrics.csv, wandb, observers) and its checks: (loss,
        queries, the update guard's measurement or None)."""
        optimizer, loop, p = self.optimizer, self.loop, self.position
        if self.obj.trains_on_gold_only:
            chosen = gold_only(chosen)
        measured = self.updates.before(step)
        start = time.perf_counter()
        if self.zo:
            n_queries = loop.schedule(epoch)
            closure, plan = step_closure(self.scorer, chosen, n_queries, self.spread)
            loss = optimizer.step(closure, n_queries=n_queries, **({"plan": plan} if plan is not None else {}))
            p.forward_passes = optimizer.forward_passes
        else:
            n_queries = 0
            loss = first_order_step(self.scorer, optimizer, chosen, self.cfg.grad_accum, ddp=self.ddp,
                                    spread=self.spread)
            p.forward_passes += self.cfg.grad_accum
        loss_value = float(loss)  # one host sync per step, never per query
        sync(self.device)
        step_time = time.perf_counter() - start
        check = self.updates.after(optimizer, step) if measured else None
        row = {
            "step": step,
            "epoch": epoch,
            "loss": loss_value,
            "n_queries": n_queries,
            "forward_passes": p.forward_passes,
            "lr": optimizer.param_groups[0]["lr"],
            "step_time_s": round(step_time, 4),
            "peak_mem_mb": round(peak_memory_mb(self.device), 1),
            "param_norm": round(float(param_norm(self.trainable)), 6),
            **UpdateGuard.columns(check),
        }
        loop.tracker.log_step(row)
        for observer in loop.observers:
            observer.on_step(step, row, optimizer)
        self.progress.step(step, loss_value, n_queries, p.forward_passes)
        guard = loop.guard
        if self.spread is not None and guard.checksum_every and step % guard.checksum_every == 0 \
                and not ranks_agree(self.trainable):
            raise RuntimeError(f"the processes' trainable weights differ at step {step} (checksum over "
                               f"{len(self.trainable)} tensors): the ranks no longer train one model")
        return loss_value, n_queries, check

    # --- checkpoints and the end of a run ----------------------------------------------------------------------

    def save(self, done: tuple[str, str | None] | None = None) -> None:
        """The loop's state at the current step to a checkpoint; ``done``: training ended (status, reason), only
        the test is left."""
        self.ckpt.save({
            **self.position.state_dict(), "last_eval_forwards": self.evals.last_forwards,
            "trainable": trainable_state(self.model), "optimizer": self.optimizer.state_dict(),
            **self.batches.state_dict(), "rng": rng_state(),
            **self.kept.state_dict(), "monitor": self.monitor.state_dict(),
            "done": done, "stalls": self.updates.state_dict(),
        })

    def finish(self, ending: Ending | None) -> Outcome:
        """The run's one exit. A run that did not train (training-free, or an initial state that had already
        diverged) is tested as it is. A trained run: a last stop check (a signal after the loop's last check
        checkpoints it and stops before the test), the closing checkpoint, the kept state back, the test."""
        ending = ending or FINISHED
        kept, p = self.kept, self.position
        if not self.training:
            return Outcome(ending.status, ending.reason, 0, 0, kept.initial, kept.best, self.final_test(0, ending), 0)
        self.progress.close()
        if ending.status != "interrupted":
            self.ckpt.at("step", "the end of training")
            stop = _stop_request(self.ckpt, self.spread, self.device)
            if stop is not None:
                self.save(done=ending.done)
                ending = Ending.interrupted(stop, f"step {p.step}, before the test evaluation")
        if ending.status == "interrupted":  # checkpointed: the run resumes instead of being tested
            return Outcome(ending.status, ending.reason, p.step, kept.step, kept.initial, kept.best, None,
                           p.forward_passes, ending.signal)
        if self.cfg.checkpoint_every is not None:  # a run killed during its test evaluation resumes to the test
            self.save(done=ending.done)
        last_state = trainable_state(self.model) if self.cfg.save in ("last", "both") else None
        kept.put_back_(self.model, p.step)
        return Outcome(ending.status, ending.reason, p.step, kept.step, kept.initial, kept.best,
                       self.final_test(kept.step, ending), p.forward_passes, last_state=last_state)


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
