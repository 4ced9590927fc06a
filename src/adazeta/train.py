"""The training loop: minibatches over epochs, a ZO or first-order step, dev evaluation, best-dev checkpoint.

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
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from adazeta.distributed import Spread, all_sum_, signals_by_rank
from adazeta.errors import ConfigError
from adazeta.evaluate import EvalResult, evaluate
from adazeta.guards import GuardConfig, UpdateGuard, ranks_agree
from adazeta.optim import zeroth_order
from adazeta.optim.batched import ReplicaClosure
from adazeta.rundir import Interrupted
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
    # that a killed run resumes from it; null: only when the run is interrupted (SIGTERM / SIGINT).
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
    # What a run keeps of what it trained (adazeta.saving): its adapters at the tested best-dev state (`best`), at
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


class Checkpoints:
    """Where the loop saves its state and how to ask whether it should stop (both optional for ``train``).

    ``save(state)`` writes the loop's state (a dict of tensors and plain values) atomically; ``resume`` is the
    state a previous, interrupted run saved, or None; ``stop()`` returns the reason to stop (a signal's name)
    or None. The loop checks ``stop()`` once per step, after the step's records are written, and once more
    before the test evaluation. ``at(phase, where)`` tells the signal handling what the loop is doing
    (``adazeta.rundir.PHASES``: a training step, or the final evaluation).
    """

    def __init__(self, save: Callable[[dict], None], resume: dict | None = None,
                 stop: Callable[[], str | None] = lambda: None,
                 at: Callable[[str, str], None] = lambda phase, where: None):
        self.save, self.resume, self.stop, self.at = save, resume, stop, at


@dataclass(frozen=True)
class RunLength:
    """How long a run is, decided once (``adazeta.run.run_length``) and handed to the query schedule, the
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

    ``schedule``: Q per epoch (ZO methods); ``length``: the run's length as ``adazeta.run.run_length`` decided it
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
    decisions.
    """
    model, device, obj = scorer.model, scorer.device, scorer.objective
    tracker, monitor, spread, length, guard = loop.tracker, loop.monitor, loop.spread, loop.length, loop.guard
    ckpt = loop.checkpoints or Checkpoints(save=lambda state: None)
    if obj.zo_loss is not None and optimizer is not None and not zeroth_order(optimizer):
        raise ConfigError(
            "task.f1_objective=true trains on the F1 of generated answers, which has no gradient: "
            "use a zeroth-order method, or set task.f1_objective=false"
        )

    def dev_eval(step: int) -> EvalResult:
        # A training run stops at the next step boundary; a training-free one finishes its evaluations first.
        ckpt.at("step" if optimizer is not None else "final", f"the dev evaluation at step {step}")
        result = evaluate(scorer, splits.dev, obj.dev_generation, desc=f"dev@{step}", keep=True)
        if result.n:  # a training-free run without a train split has no dev set
            tracker.log_eval(step, "dev", result.loss, result.score, result.tied)
        return result

    save: Callable[..., None] | None = None  # the loop's state to a checkpoint (a run that trains)

    def final_test(tested_step: int) -> EvalResult:
        """The test evaluation, as the last thing the run does: a first signal lets it finish; a second stops at
        once, after a checkpoint of the trained state (the same command then runs the test alone)."""
        ckpt.at("final", "the final test evaluation")
        try:
            result = evaluate(scorer, splits.test, obj.test_generation, desc="test", keep=True)
            tracker.log_eval(tested_step, "test", result.loss, result.score, result.tied)
        except Interrupted:
            if save is not None:
                save(step, done=(status, reason))
            raise
        ckpt.at("save", "the run's record")
        return result

    resume = ckpt.resume
    status, reason, step = "finished", None, 0
    if resume is None:
        initial = best = dev_eval(0)
        reason = monitor.update(initial.loss, initial.tied) if initial.n else None
        if reason is not None:  # e.g. an adapter init that already overflows: nothing to train from
            status = "diverged"
            return Outcome(status, reason, 0, 0, initial, initial, final_test(0), 0)
        best_step, best_state = 0, (trainable_state(model) if cfg.keep_best and optimizer else None)
    else:
        initial, best = EvalResult.restore(resume["initial"]), EvalResult.restore(resume["best"])
        best_step, best_state = resume["best_step"], resume["best_state"]
        monitor.load_state_dict(resume["monitor"])
    forward_passes = 0

    if optimizer is not None:
        zo = zeroth_order(optimizer)
        if length is None:
            length = RunLength(steps_per_epoch(len(splits.train), cfg.batch_size), cfg.max_steps,
                               cfg.max_forward_passes, 0.0)
        per_epoch, max_steps, budget = length.steps_per_epoch, length.max_steps, length.max_forward_passes
        order_gen = torch.Generator().manual_seed(loop.seed)  # data order only; perturbations have their own
        order = torch.randperm(len(splits.train), generator=order_gen)
        trainable = [p for group in optimizer.param_groups for p in group["params"]]
        updates = UpdateGuard(trainable, guard, loop.seed)  # measured updates, the stall stop (adazeta.guards)
        last_eval_forwards, first_step = 0, 1
        if resume is not None:
            load_trainable_state_(model, resume["trainable"])
            optimizer.load_state_dict(resume["optimizer"])
            order_gen.set_state(resume["order_gen"])
            order = resume["order"]
            set_rng_state(resume["rng"])
            step = resume["step"]
            first_step, forward_passes, last_eval_forwards = step + 1, resume["forward_passes"], resume["last_eval_forwards"]
            updates.load_state_dict(resume.get("stalls", []))
        done = resume.get("done") if resume is not None else None
        if done is not None:  # the checkpoint of a trained run, written before its test evaluation: test it
            status, reason = done

        def save(at_step: int, done: tuple[str, str | None] | None = None) -> None:
            """``done``: training ended (status, reason) and only the test evaluation is left."""
            ckpt.save({
                "step": at_step, "forward_passes": forward_passes, "last_eval_forwards": last_eval_forwards,
                "trainable": trainable_state(model), "optimizer": optimizer.state_dict(),
                "order_gen": order_gen.get_state(), "order": order, "rng": rng_state(),
                "initial": dataclasses.asdict(initial), "best": dataclasses.asdict(best), "best_step": best_step,
                "best_state": best_state, "monitor": monitor.state_dict(), "done": done,
                "stalls": updates.state_dict(),
            })

        ddp = None
        if spread is not None and not zo:  # gradients averaged over the ranks' shards
            ddp = DistributedDataParallel(LossModule(scorer), device_ids=[device.index] if device.type == "cuda" else None,
                                          broadcast_buffers=False)
        progress = Progress(max_steps, initial=first_step - 1, budget=budget, initial_forwards=forward_passes,
                            select_on=cfg.select_on)
        if resume is not None:
            progress.evaluated(best_step, best.score, best.metric, best.loss, best_step)
        for step in range(first_step, (max_steps if done is None else step) + 1):
            ckpt.at("step", f"step {step}")
            epoch, slot = divmod(step - 1, per_epoch)
            if slot == 0 and step > 1:
                order = torch.randperm(len(splits.train), generator=order_gen)
            chosen = [splits.train[i] for i in order[slot * cfg.batch_size : (slot + 1) * cfg.batch_size].tolist()]
            if obj.trains_on_gold_only:
                chosen = gold_only(chosen)
            measured = updates.before(step)
            start = time.perf_counter()
            if zo:
                n_queries = loop.schedule(epoch)
                plan = spread.plan(n_queries, len(chosen)) if spread is not None else None
                mine = plan.items(chosen) if plan is not None else chosen  # this rank's shard (all: one process)
                if not mine:  # more ranks than examples: this rank adds nothing to the step's losses
                    closure = _no_examples
                elif obj.zo_loss is not None:
                    closure = functools.partial(obj.zo_loss, model, mine)
                else:
                    # A ReplicaClosure also lets a batched_queries optimizer score all perturbations at once.
                    batch = scorer.collate(mine)
                    closure = ReplicaClosure(model, functools.partial(scorer.replica_losses, batch), batch)
                loss = optimizer.step(closure, n_queries=n_queries, **({"plan": plan} if plan is not None else {}))
                forward_passes = optimizer.forward_passes
            else:
                n_queries = 0
                loss = first_order_step(scorer, optimizer, chosen, cfg.grad_accum, ddp=ddp, spread=spread)
                forward_passes += cfg.grad_accum
            loss_value = float(loss)  # one host sync per step, never per query
            sync(device)
            step_time = time.perf_counter() - start
            norm = float(param_norm(trainable))
            check = updates.after(optimizer, step) if measured else None
            tracker.log_step(
                {
                    "step": step,
                    "epoch": epoch,
                    "loss": loss_value,
                    "n_queries": n_queries,
                    "forward_passes": forward_passes,
                    "lr": optimizer.param_groups[0]["lr"],
                    "step_time_s": round(step_time, 4),
                    "peak_mem_mb": round(peak_memory_mb(device), 1),
                    "param_norm": round(norm, 6),
                    **UpdateGuard.columns(check),
                }
            )
            progress.step(step, loss_value, n_queries, forward_passes)
            if spread is not None and guard.checksum_every and step % guard.checksum_every == 0 \
                    and not ranks_agree(trainable):
                raise RuntimeError(f"the processes' trainable weights differ at step {step} (checksum over "
                                   f"{len(trainable)} tensors): the ranks no longer train one model")
            reason = monitor.non_finite(loss_value)
            if reason is None and check is not None and (reason := updates.stalled(optimizer)) is not None:
                status = "stalled"
                break
            out_of_budget = budget is not None and forward_passes >= budget
            if cfg.eval_every_forwards is None:
                due = step % cfg.eval_every == 0
            else:
                due = forward_passes // cfg.eval_every_forwards > last_eval_forwards // cfg.eval_every_forwards
            if reason is None and (due or step == max_steps or out_of_budget):
                last_eval_forwards = forward_passes
                result = dev_eval(step)
                # A collapsed model's loss (exactly ln #candidates) can be below a high start: never keep it.
                if step >= cfg.select_from and not monitor.collapsed(result.tied) and (
                        best_step < cfg.select_from or better(result, best, cfg.select_on)):
                    best, best_step = result, step
                    best_state = trainable_state(model) if cfg.keep_best else None
                progress.evaluated(step, result.score, result.metric, result.loss, best_step)
                reason = monitor.update(result.loss, result.tied)
            if reason is not None:
                status = "diverged"
                break
            if out_of_budget:
                break
            stop = _stop_request(ckpt, spread, device)  # every rank stops at the same step
            if stop is not None:
                save(step)
                progress.close()
                return Outcome("interrupted", f"{stop[1]} at step {step}", step, best_step, initial, best, None,
                               forward_passes, stop[0])
            if cfg.checkpoint_every is not None and step % cfg.checkpoint_every == 0 and step < max_steps:
                save(step)
        progress.close()
        ckpt.at("step", "the end of training")
        # A signal after the loop's last check (a divergence or the forward budget ended it): checkpoint the
        # trained run and stop before its test evaluation, as at the last step.
        stop = _stop_request(ckpt, spread, device)
        if stop is not None:
            save(step, done=(status, reason))
            return Outcome("interrupted", f"{stop[1]} at step {step}, before the test evaluation", step, best_step,
                           initial, best, None, forward_passes, stop[0])
        if cfg.checkpoint_every is not None:  # a run killed during its test evaluation resumes to the test alone
            save(step, done=(status, reason))
        last_state = trainable_state(model) if cfg.save in ("last", "both") else None
        if cfg.keep_best and best_state is not None:
            load_trainable_state_(model, best_state)
        elif not cfg.keep_best:
            best_step = step

    return Outcome(status, reason, step, best_step, initial, best, final_test(best_step), forward_passes,
                   last_state=last_state if optimizer is not None else None)


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
