"""Where a run's numbers go: CSV files (flushed every row, so a crash loses nothing), wandb, and the console.

Over 400 lines: every place a run's numbers go (CSV, wandb, progress lines, predictions) and its monitors.

Also the two run-health instruments: peak memory and divergence detection.
"""

from __future__ import annotations

import csv
import functools
import logging
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adazeta.errors import ConfigError
from adazeta.scoring.evaluate import Dependence
from adazeta.runs.rundir import atomic_write_text

log = logging.getLogger("adazeta")

# param_norm: L2 norm of the trainable set after the step. Under ZO-SGD it climbs as a random walk (each step
# adds lr * g * z, ||z|| ~ sqrt(d)); its growth is the early sign of the drift that ends in a collapse.
STEP_COLUMNS = ["step", "epoch", "loss", "n_queries", "forward_passes", "lr", "step_time_s", "peak_mem_mb", "param_norm",
                "update_changed", "update_cosine"]  # the last two on guard.every steps only (adazeta.guards)

def eval_columns(metric: str = "accuracy") -> list[str]:
    """eval.csv's columns: the score column is named by the task's main metric (accuracy, or f1)."""
    return ["step", "split", "loss", metric, "tied"]


EVAL_COLUMNS = eval_columns()  # a classification task's
WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto: online when credentials exist, else offline files in the run directory
    project: str = "adazeta"
    entity: str | None = None
    group: str | None = None  # defaults to the experiment / sweep name
    tags: list[str] | None = None

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ConfigError(f"wandb.mode={self.mode!r} is not one of {', '.join(WANDB_MODES)}")


DIVERGENCE_RULES = ("best", "initial", "none")
INDEPENDENT = ("warn", "stop", "off")


@dataclass
class DivergenceConfig:
    """When a run has diverged: a non-finite loss at once; a collapsed evaluation at once (``collapse``); or a
    dev loss above ``factor`` x a reference for ``patience`` evaluations in a row.

    rule ``best``: the reference is the best dev loss seen so far, so a run that learned and then climbs back
    (Figure 1's MeZO-LoRA: 0.36 -> 0.7) is caught; ``initial``: the first dev loss (the older, laxer rule: a
    run that starts high can fall and climb back to its start unnoticed); ``none``: no dev-loss rule, as the
    reference trainers (a run trains every step; a non-finite loss still ends it, and a collapse unless
    ``collapse`` is off).

    Input-independent answers (``independent``; ``adazeta.scoring.evaluate.Dependence``): a dev evaluation of at least
    ``independent_min_examples`` examples where ``independent_answer_share`` of them or more give one answer that
    fewer of their gold labels are, or whose score gap varies across examples less than
    ``independent_gap_ratio`` x as much as at the first evaluation. Measured at every evaluation and written to
    result.json (``dev_dependence``, ``test_dependence``); ``warn`` logs it, ``stop`` also ends the run as
    diverged and never keeps such an evaluation, unless the first evaluation (the untrained model) already answered
    that way: a biased pretrained model is not a collapse.
    """

    rule: str = "best"
    factor: float = 1.5
    patience: int = 3
    # A dev evaluation where most examples' candidates all score the same (the residual stream overflowed and
    # the final norm returned zeros) ends the run: its finite loss, ln(#candidates), would look like progress.
    # Off: no such stop, and a collapsed evaluation can be the kept state (the reference trainers').
    collapse: bool = True
    collapse_fraction: float = 0.5  # share of tied examples that counts as collapsed
    independent: str = "warn"  # input-independent answers: warn (log and record) | stop (end the run) | off
    independent_answer_share: float = 0.98  # one answer for this share of dev examples or more ...
    independent_gap_ratio: float = 0.1  # or a score-gap spread below this x the first evaluation's
    # Fewer dev examples are never judged: 16 balanced examples all answered alike happen by chance.
    independent_min_examples: int = 50

    def __post_init__(self) -> None:
        if self.rule not in DIVERGENCE_RULES:
            raise ConfigError(f"divergence.rule={self.rule!r} is not one of {', '.join(DIVERGENCE_RULES)}")
        if self.independent not in INDEPENDENT:
            raise ConfigError(f"divergence.independent={self.independent!r} is not one of {', '.join(INDEPENDENT)}")
        if not 0.5 < self.independent_answer_share <= 1.0:
            raise ConfigError(f"divergence.independent_answer_share={self.independent_answer_share} must be in "
                              "(0.5, 1]")
        if not 0.0 <= self.independent_gap_ratio < 1.0:
            raise ConfigError(f"divergence.independent_gap_ratio={self.independent_gap_ratio} must be in [0, 1)")
        if self.independent_min_examples < 2:
            raise ConfigError(f"divergence.independent_min_examples={self.independent_min_examples} must be >= 2")
        if self.factor <= 1.0:
            raise ConfigError(f"divergence.factor={self.factor} must be > 1")
        if self.patience < 1:
            raise ConfigError(f"divergence.patience={self.patience} must be >= 1")
        if not 0.0 < self.collapse_fraction <= 1.0:
            raise ConfigError(f"divergence.collapse_fraction={self.collapse_fraction} must be in (0, 1]")


class DivergenceMonitor:
    """Tracks the dev loss; ``update`` returns a reason string once the run has diverged, else None."""

    def __init__(self, cfg: DivergenceConfig):
        self.cfg = cfg
        self.initial: float | None = None
        self.best: float | None = None
        self.strikes = 0
        self.first_gap: float | None = None  # the first evaluation's score-gap spread: the gap rule's reference
        self.born_independent = False  # the first evaluation's answers were already input-independent
        self.warned = False

    def state_dict(self) -> dict[str, Any]:
        return {"initial": self.initial, "best": self.best, "strikes": self.strikes, "first_gap": self.first_gap,
                "born_independent": self.born_independent, "warned": self.warned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial, self.best, self.strikes = state["initial"], state["best"], state["strikes"]
        self.first_gap = state.get("first_gap")  # checkpoints written before the rule: no reference
        self.born_independent, self.warned = state.get("born_independent", False), state.get("warned", False)

    def independent(self, d: Dependence | None) -> str | None:
        """What makes an evaluation's answers input-independent (``Dependence``), or None: never judged below
        ``independent_min_examples`` examples, nor with ``independent=off``."""
        cfg = self.cfg
        if cfg.independent == "off" or d is None or d.examples < cfg.independent_min_examples:
            return None
        if d.answer_share >= cfg.independent_answer_share and d.gold_share < cfg.independent_answer_share:
            return (f"{d.answer_share:.1%} of {d.examples} dev examples answer candidate {d.answer} "
                    f"({d.gold_share:.1%} of their gold labels are it)")
        if self.first_gap and d.gap_std < cfg.independent_gap_ratio * self.first_gap:
            return (f"the score gap varies by {d.gap_std:.3g} (std) across {d.examples} dev examples, "
                    f"{d.gap_std / self.first_gap:.1%} of its {self.first_gap:.3g} at the first evaluation")
        return None

    def stops_independent(self, d: Dependence | None) -> bool:
        """Whether the input-independence rule ends the run at (and never keeps) an evaluation with ``d``."""
        return self.cfg.independent == "stop" and not self.born_independent and self.independent(d) is not None

    @staticmethod
    def non_finite(loss: float) -> str | None:
        return None if math.isfinite(loss) else f"non-finite training loss ({loss})"

    def collapsed(self, tied: float) -> bool:
        """Whether an evaluation with this tied fraction is a collapsed model (see DivergenceConfig.collapse)."""
        return tied >= self.cfg.collapse_fraction

    def keepable(self, tied: float, dependence: Dependence | None = None) -> bool:
        """Whether an evaluation may become the kept state. With ``collapse`` on, a collapsed one never does: its
        loss (exactly ln #candidates) can be below a high start. With it off, any evaluation can, as in the reference
        trainers, which keep the best dev loss or metric whatever the scores look like. An evaluation that the
        ``independent: stop`` rule ends the run on is never kept either."""
        return not (self.cfg.collapse and self.collapsed(tied)) and not self.stops_independent(dependence)

    def update(self, dev_loss: float, tied: float = 0.0, dependence: Dependence | None = None) -> str | None:
        if not math.isfinite(dev_loss):
            return f"non-finite dev loss ({dev_loss})"
        if self.cfg.collapse and self.collapsed(tied):
            # Only what this evaluation measured: why the scores tie (in the one run diagnosed, the residual stream
            # overflowed float32: README) is not measured here.
            return f"collapsed: {tied:.0%} of dev examples score all candidates the same (dev loss {dev_loss:.6f})"
        reason = self._independence(dev_loss, dependence)
        if reason is not None:
            return reason
        if self.initial is None:
            self.initial = self.best = dev_loss
            return None
        if self.cfg.rule == "none":
            self.best = min(self.best, dev_loss)
            return None
        reference = self.best if self.cfg.rule == "best" else self.initial
        if dev_loss > self.cfg.factor * reference:
            self.strikes += 1
        else:
            self.strikes = 0
        self.best = min(self.best, dev_loss)
        if self.strikes >= self.cfg.patience:
            what = "the best" if self.cfg.rule == "best" else "the initial"
            return (
                f"dev loss {dev_loss:.4f} above {self.cfg.factor} x {what} dev loss {reference:.4f} "
                f"for {self.strikes} evaluations in a row"
            )
        return None

    def _independence(self, dev_loss: float, d: Dependence | None) -> str | None:
        """The input-independence rule at one evaluation: the first one sets its reference (and whether the
        untrained model already answered that way); later ones are logged once, and end the run with ``stop``."""
        first = self.initial is None
        why = self.independent(d)
        if first:
            self.first_gap = d.gap_std if d is not None else None
            self.born_independent = why is not None
        if why is None:
            return None
        if not self.warned:
            self.warned = True
            log.warning("the dev answers do not depend on the input%s: %s (divergence.independent=%s)",
                        " before any training" if first else "", why, self.cfg.independent)
        if self.stops_independent(d):
            return f"collapsed: the answers no longer depend on the input: {why} (dev loss {dev_loss:.6f})"
        return None


def peak_memory_mb(device: torch.device) -> float:
    """CUDA peak allocated on a GPU; the process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def sync(device: torch.device) -> None:
    """Wait for queued device work, so that wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PLAIN_PROGRESS_ENV = "ADAZETA_PLAIN_PROGRESS"  # set by the CLI in a sweep: log lines, not bars


def show_progress() -> bool:
    """Bars on a terminal; plain log lines under CI, in a sweep, or when stderr is a file or a pipe."""
    return (sys.stderr.isatty() and not os.environ.get("CI") and not os.environ.get(PLAIN_PROGRESS_ENV)
            and os.environ.get("RANK", "0") == "0")  # several processes: rank 0 shows the run's progress


# Warnings the libraries below a run raise about their own internals, which a user of adazeta cannot act on (the
# call that triggers them is ours or another library's): (category, message regex, warning module regex). Shown
# with verbose=true; add one here, at its source, rather than filtering warnings anywhere else.
THIRD_PARTY_WARNINGS = (
    # transformers 4.5x renamed it; peft up to 0.21 (LoRA) asks for the old name on every run.
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated", r"transformers(\.|$)"),
    # peft sets fan_in_fan_out itself for the module types that need it, and says so.
    (UserWarning, r"fan_in_fan_out is set to", r"peft(\.|$)"),
)


def quiet_warnings(verbose: bool) -> None:
    """The ``THIRD_PARTY_WARNINGS`` filters: ignored, or shown (Python's default: once per place) if verbose."""
    for category, message, module in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("default" if verbose else "ignore", message=message, category=category,
                                module=module)


def quiet_third_party(verbose: bool) -> None:
    """Progress bars, chatter and internal warnings of transformers (GGUF conversion, downloads), peft and
    datasets: on only if verbose."""
    import datasets
    from transformers.utils import logging as hf_logging

    quiet_warnings(verbose)

    if verbose:
        hf_logging.enable_progress_bar()
        datasets.enable_progress_bars()
    else:
        hf_logging.disable_progress_bar()
        datasets.disable_progress_bars()
        hf_logging.set_verbosity_error()
    _quiet_gguf_conversion(not verbose)


def _quiet_gguf_conversion(quiet: bool) -> None:
    """transformers' GGUF loader draws its conversion bar with plain ``tqdm``, past its own progress-bar switch:
    give that module a bar that honours ours."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support: nothing to quiet
        return
    from tqdm.auto import tqdm

    gguf_utils.tqdm = functools.partial(tqdm, disable=True) if quiet else tqdm


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """The training loop's progress: step, loss, Q, forward passes, dev loss and score at the last evaluation, the
    best state's step (and what chose it: ``select_on``), ETA.

    A tqdm bar on a terminal; otherwise one log line every ``every_s`` seconds (and at the last step), so that
    a log file or a sweep's output shows the run moving without a bar's carriage returns.
    """

    def __init__(self, total: int, initial: int = 0, every_s: float = 30.0, desc: str = "train",
                 budget: int | None = None, initial_forwards: int = 0, select_on: str = "loss"):
        from tqdm.auto import tqdm

        # ``total``: the step limit; ``budget``: the forward-pass budget, when one ends the run (the bar and the ETA
        # then follow forward passes: a run whose Q grows spends them faster than it takes steps).
        self.total, self.initial, self.every_s, self.select_on = total, initial, every_s, select_on
        self.budget, self.initial_forwards, self.forwards = budget, initial_forwards, initial_forwards
        bar_total, bar_initial = (budget, initial_forwards) if budget is not None else (total, initial)
        self.bar = (tqdm(total=bar_total, initial=bar_initial, desc=desc, dynamic_ncols=True,
                         unit="fwd" if budget is not None else "it")
                    if show_progress() else None)
        self.dev: tuple[int, float, str] | None = None
        self.dev_loss: float | None = None
        self.best_step: int | None = None
        self.last: tuple[int, float, int, int] | None = None  # the last step's (step, loss, Q, forward passes)
        self.started = self.last_line = time.monotonic()

    def evaluated(self, step: int, score: float, metric: str = "accuracy", loss: float | None = None,
                  best_step: int | None = None) -> None:
        """The last dev evaluation: its step, score (accuracy, or F1 for generation tasks) and loss, and the step
        of the state kept so far. A bar shows it at once, not one step later."""
        self.dev, self.dev_loss, self.best_step = (step, score, metric), loss, best_step
        if self.bar is not None and self.last is not None:
            self.bar.set_postfix(self._postfix(self.fields(*self.last)), refresh=True)

    def eta(self, step: int, forward_passes: int) -> float:
        """Seconds left at the rate so far: to the step limit, or to the forward budget if that comes first."""
        elapsed = time.monotonic() - self.started
        etas = []
        if step > self.initial:
            etas.append(elapsed / (step - self.initial) * max(0, self.total - step))
        if self.budget is not None and forward_passes > self.initial_forwards:
            etas.append(elapsed / (forward_passes - self.initial_forwards) * max(0, self.budget - forward_passes))
        return min(etas) if etas else float("nan")

    def fields(self, step: int, loss: float, n_queries: int, forward_passes: int) -> dict[str, str]:
        eta = self.eta(step, forward_passes)
        fwd = str(forward_passes) if self.budget is None else f"{forward_passes}/{self.budget}"
        out = {"loss": f"{loss:.4f}", "Q": str(n_queries), "fwd": fwd}
        if self.dev is not None:
            at, score, metric = self.dev
            short = "acc" if metric == "accuracy" else metric
            if self.dev_loss is not None:
                out["dev_loss"] = f"{self.dev_loss:.4f}"
            out[f"dev_{short}"] = f"{score:.3f}@{at}"
            if self.best_step is not None:  # the state the test will use, and the dev number that chose it
                out["best"] = f"{'loss' if self.select_on == 'loss' else short}@{self.best_step}"
        out["eta"] = _duration(eta) if eta == eta else "?"
        return out

    @staticmethod
    def _postfix(values: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in values.items() if k != "eta"}  # tqdm shows its own ETA

    def step(self, step: int, loss: float, n_queries: int, forward_passes: int) -> None:
        self.last = (step, loss, n_queries, forward_passes)
        values = self.fields(step, loss, n_queries, forward_passes)
        if self.bar is not None:
            # The fields first: ``update`` redraws the line, and fields set after it would show one step late.
            self.bar.set_postfix(self._postfix(values), refresh=False)
            self.bar.update(forward_passes - self.forwards if self.budget is not None else 1)
            self.forwards = forward_passes
            return
        self.forwards = forward_passes
        now = time.monotonic()
        last = step == self.total or (self.budget is not None and forward_passes >= self.budget)
        if now - self.last_line >= self.every_s or last:
            self.last_line = now
            where = f"step {step}/{self.total}" if self.budget is None else f"step {step}"
            log.info("%s  %s", where, "  ".join(f"{k} {v}" for k, v in values.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _elapsed(seconds: float) -> str:
    """A short duration for a log line: 0.4s, 12.3s, 2m31s, 1h05m."""
    return f"{seconds:.1f}s" if seconds < 60 else _duration(seconds)


EVAL_LINES_EVERY_S = 30.0  # an evaluation's progress lines in a log: this far apart at most


class EvalProgress:
    """An evaluation's log lines where no bar is drawn (a log file, CI, a sweep): one when it starts, one every
    ``every_s`` seconds while it runs (so a long evaluation is never minutes of silence; a short one gets none),
    and one when it ends, with its time and result."""

    def __init__(self, desc: str, examples: int, batches: int, every_s: float | None = None):
        self.desc, self.examples, self.batches = desc, examples, batches
        self.every_s = EVAL_LINES_EVERY_S if every_s is None else every_s
        self.started = self.last_line = time.monotonic()
        log.info("%s: evaluating %d examples (%d batch%s)", desc, examples, batches, "" if batches == 1 else "es")

    def batch(self, done_batches: int, done_examples: int) -> None:
        """After each batch: a line when ``every_s`` passed since the last one, with the time it should still take."""
        now = time.monotonic()
        if now - self.last_line < self.every_s or done_batches >= self.batches:
            return
        self.last_line = now
        elapsed = now - self.started
        left = elapsed / done_batches * (self.batches - done_batches)
        log.info("%s: %d/%d examples after %s, about %s left", self.desc, done_examples, self.examples,
                 _elapsed(elapsed), _elapsed(left))

    def generating(self) -> None:
        """Generation tasks: the greedy answers come after the scoring, and take longer than it."""
        log.info("%s: scored %d examples in %s; generating answers", self.desc, self.examples,
                 _elapsed(time.monotonic() - self.started))

    def done(self, loss: float, score: float, metric: str) -> None:
        log.info("%s: %d examples in %s: loss %.4f, %s %.4f", self.desc, self.examples,
                 _elapsed(time.monotonic() - self.started), loss, metric, score)


def _wandb_host() -> str:
    from urllib.parse import urlparse

    return urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"


def wandb_has_credentials() -> bool:
    """An API key in the environment, or a ``wandb login`` entry for the W&B host in the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return _wandb_host() in netrc.read_text()
    except OSError:
        return False


def check_wandb(cfg: WandbConfig) -> None:
    """Before the model loads: a run that must log online has credentials (wandb would refuse only after it)."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    online = cfg.mode == "online" or (cfg.mode == "auto" and env == "online")
    if online and not wandb_has_credentials():
        how = "wandb.mode=online" if cfg.mode == "online" else "WANDB_MODE=online"
        raise ConfigError(f"{how} needs W&B credentials and none were found (WANDB_API_KEY, or {_wandb_host()} in "
                          "~/.netrc); run `wandb login`, or log to files with wandb.mode=offline (wandb sync later) "
                          "or not at all with wandb.mode=disabled")


def missing_rows(path: Path, columns: list[str], keep_rows: int) -> str | None:
    """Why the CSV at ``path`` cannot be continued after its first ``keep_rows`` rows (a resumed run), or None."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return "the file is missing"
    except (OSError, UnicodeDecodeError) as err:
        return f"the file is unreadable ({getattr(err, 'strerror', None) or err})"
    if not lines or lines[0] != ",".join(columns) + "\n":
        return f"its header is not {','.join(columns)}"
    if len(lines) - 1 < keep_rows:
        return f"it holds {len(lines) - 1} of the {keep_rows} rows the checkpoint continues"
    return None


class CsvSink:
    """Append-only CSV with a fixed header; each row is written whole and flushed at once.

    ``keep_rows``: continue an existing file (a resumed run) after its first ``keep_rows`` data rows, dropping
    any written after the checkpoint they belong to; None starts a new file.
    """

    def __init__(self, path: Path, columns: list[str], keep_rows: int | None = None):
        self.columns = columns
        self.rows = 0
        header = ",".join(columns) + "\n"
        if keep_rows is not None:
            problem = missing_rows(path, columns, keep_rows)
            if problem is not None:
                raise ValueError(f"{path}: {problem}; rerun with force=true")
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            atomic_write_text(path, "".join(lines[: keep_rows + 1]))
            self.rows = keep_rows
            self._file = open(path, "a", newline="", encoding="utf-8")
        else:
            self._file = open(path, "w", newline="", encoding="utf-8")
            self._file.write(header)
        self._writer = csv.DictWriter(self._file, fieldnames=columns, lineterminator="\n")  # not the csv default CRLF
        self._file.flush()

    def write(self, row: dict[str, Any]) -> None:
        self._writer.writerow({k: row.get(k) for k in self.columns})
        self._file.flush()
        self.rows += 1

    def close(self) -> None:
        self._file.close()


class Tracker:
    """metrics.csv, eval.csv and wandb, fed by the training loop.

    ``resume``: the ``position()`` a checkpoint recorded: the CSVs continue after the rows it had written and
    the wandb run (same id) continues too.
    """

    def __init__(self, run_dir: Path, cfg: WandbConfig, run_name: str, config: dict[str, Any], tags: list[str],
                 resume: dict[str, Any] | None = None, metric: str = "accuracy"):
        self.run_dir, self.metric = run_dir, metric
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = CsvSink(run_dir / "metrics.csv", STEP_COLUMNS, resume and resume["metrics_rows"])
        self.evals = CsvSink(run_dir / "eval.csv", eval_columns(metric), resume and resume["eval_rows"])
        self.wandb = None
        self.last_step = resume["last_step"] if resume else 0
        mode = cfg.mode
        if mode == "auto":
            # WANDB_MODE in the environment (e.g. offline on a cluster) is the user's choice too.
            env = os.environ.get("WANDB_MODE", "").strip().lower()
            if env in ("online", "offline", "disabled"):
                mode = env
            else:
                mode = "online" if wandb_has_credentials() else "offline"
        self.wandb_mode = mode
        if mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group,
                tags=sorted(set(tags + list(cfg.tags or []))),
                name=run_name,
                config=config,
                dir=str(run_dir),
                mode=mode,
                reinit="finish_previous",
                settings=wandb.Settings(silent=True, console="off"),
                **({"id": resume["wandb_id"], "resume": "allow"} if resume and resume.get("wandb_id") else {}),
            )

    def position(self) -> dict[str, Any]:
        """What a checkpoint needs to continue these records later."""
        return {
            "metrics_rows": self.metrics.rows,
            "eval_rows": self.evals.rows,
            "last_step": self.last_step,
            "wandb_id": getattr(self.wandb, "id", None),
        }

    def log_step(self, row: dict[str, Any]) -> None:
        self.metrics.write(row)
        self.last_step = max(self.last_step, row["step"])
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=row["step"])

    def log_eval(self, step: int, split: str, loss: float, score: float, tied: float = 0.0) -> None:
        """One evaluation: loss, the task's main metric (``score``: accuracy, or F1) and the tied fraction."""
        self.evals.write({"step": step, "split": split, "loss": loss, self.metric: score, "tied": tied})
        if self.wandb is not None:
            values = {f"{split}/loss": loss, f"{split}/{self.metric}": score, f"{split}/tied": tied}
            if split == "test":
                # The test state is the best-dev step's, usually before the last logged step, and wandb drops any
                # step below its last: log at the last step (the chart's end point) and keep the best step beside.
                values["test/best_step"] = step
                for k, v in values.items():
                    self.wandb.summary[k] = v
            self.wandb.log(values, step=max(step, self.last_step))
        self.last_step = max(self.last_step, step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.wandb is not None:
            for k, v in values.items():
                self.wandb.summary[k] = v

    def close(self, failed: bool = False) -> None:
        self.metrics.close()
        self.evals.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if failed else 0)
            self.wandb = None


class SilentTracker(Tracker):
    """The tracker of a run's other ranks (several processes): rank 0 alone writes files and wandb."""

    def __init__(self, resume: dict[str, Any] | None = None):  # noqa: D107  (no files, no wandb)
        self.run_dir = None
        self.wandb = None
        self.wandb_mode = "disabled"
        self.last_step = resume["last_step"] if resume else 0

    def position(self) -> dict[str, Any]:
        return {"metrics_rows": 0, "eval_rows": 0, "last_step": self.last_step, "wandb_id": None}

    def log_step(self, row: dict[str, Any]) -> None:
        self.last_step = max(self.last_step, row["step"])

    def log_eval(self, step: int, split: str, loss: float, score: float, tied: float = 0.0) -> None:
        self.last_step = max(self.last_step, step)

    def close(self, failed: bool = False) -> None:
        pass


PREDICTIONS_DIR = "predictions"


def write_predictions(run_dir: Path, split: str, predictions: Any, rows: list[int] | None = None) -> Path:
    """``predictions/<split>.csv``: one row per example of ``split`` in its order, written atomically.

    Classification: ``index`` (position in the split), ``row`` (the example's row in its source file or Hub
    split, the same for every run drawn with the same data seed), ``gold``, ``pred``, ``correct`` and one
    ``score_<j>`` per candidate (blank past an example's own candidates). Generation tasks: ``index``, ``row``,
    ``prediction`` (the greedy answer), ``f1``, ``em``. ``predictions`` is an ``evaluate.Predictions``.
    """
    import io

    n = len(predictions)
    rows = list(rows) if rows is not None else list(range(n))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if predictions.f1 is not None:
        writer.writerow(["index", "row", "prediction", "f1", "em"])
        for i in range(n):
            writer.writerow([i, rows[i], predictions.texts[i], f"{predictions.f1[i]:.6g}", f"{predictions.em[i]:.6g}"])
    else:
        width = max((len(s) for s in predictions.scores), default=0)
        writer.writerow(["index", "row", "gold", "pred", "correct", *(f"score_{j}" for j in range(width))])
        for i in range(n):
            scores = [repr(float(v)) for v in predictions.scores[i]]
            writer.writerow([i, rows[i], predictions.gold[i], predictions.pred[i],
                             int(predictions.pred[i] == predictions.gold[i]), *scores, *[""] * (width - len(scores))])
    where = run_dir / PREDICTIONS_DIR
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{split}.csv"
    atomic_write_text(path, out.getvalue())
    return path
