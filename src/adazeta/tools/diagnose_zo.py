"""Watch a ZO run from inside: what grows, at which step, and what the loss then measures.

    python -m adazeta.tools.diagnose_zo --out results/diagnostics/collapse_lr1e-2.csv -- \
        method=adazeta schedule=constant method.optimizer.lr=1e-2

Runs the run ``adazeta-run`` would run with these overrides (its files go to ``<out stem>_run/``) and watches it
through the loop's observer hooks (``adazeta.train.Observer``), writing one CSV row per step: training loss, norm of the trainable set and of its last update, and at each
dev evaluation (every ``--eval-every`` steps) the dev loss and accuracy, the fraction of dev examples whose
candidates all score the same (to 1e-6), the RMS of the residual stream where the final norm reads it, the
largest adapter gain ``||A(h) - h|| / ||h||`` over the adapter sites, and the fraction of final-norm inputs
whose mean square overflows float32.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from adazeta.tools.offline import use_shared

if TYPE_CHECKING:
    from adazeta.scoring import Scorer

COLUMNS = ["step", "loss", "n_queries", "forward_passes", "param_norm", "update_norm", "dev_loss", "dev_accuracy",
           "tied_fraction", "final_norm_input_rms", "max_adapter_gain", "overflow_fraction"]


class Probes:
    """Forward hooks: the residual stream entering the final norm, and every adapter's relative change."""

    def __init__(self, scorer: "Scorer"):
        from adazeta.adapters.bottleneck import BottleneckAdapter
        from adazeta.adapters.tt import TTAdapter

        self.sq_sum = self.count = self.overflow = 0.0
        self.max_gain = 0.0
        model = scorer.model
        backbone, _ = scorer.parts()
        norm = getattr(backbone, "norm", None) or getattr(backbone, "final_layernorm", None)
        self.handles = []
        if norm is not None:
            self.handles.append(norm.register_forward_hook(self._final))
        for module in model.modules():
            if isinstance(module, (TTAdapter, BottleneckAdapter)):
                self.handles.append(module.register_forward_hook(self._adapter))

    def reset(self) -> None:
        self.sq_sum = self.count = self.overflow = 0.0
        self.max_gain = 0.0

    def _final(self, module, inputs, output) -> None:
        h = inputs[0].float()
        ms = h.pow(2).mean(-1)  # what RMSNorm computes in float32
        self.overflow += float((~torch.isfinite(ms)).sum())
        self.sq_sum += float(h.double().pow(2).sum())
        self.count += h.numel()

    def _adapter(self, module, inputs, output) -> None:
        h = inputs[0].double()
        gain = float((output.double() - h).norm() / h.norm().clamp_min(1e-30))
        self.max_gain = max(self.max_gain, gain if math.isfinite(gain) else float("inf"))


class Diagnosis:
    """An observer (``adazeta.train.Observer``) of a real run: one CSV row per step, eval columns where dev ran."""

    def __init__(self, writer: csv.DictWriter, flush: Callable[[], None]):
        self.writer, self.flush = writer, flush
        self.pending: dict[str, Any] | None = None

    def on_start(self, scorer, optimizer) -> None:
        self.model = scorer.model
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.previous = [p.detach().clone() for p in self.params]
        self.probes = Probes(scorer)

    def on_step(self, step: int, row: dict[str, Any], optimizer) -> None:
        self.write()
        update = math.sqrt(sum(float((p.detach() - o).double().pow(2).sum()) for p, o in zip(self.params, self.previous)))
        self.previous = [p.detach().clone() for p in self.params]
        self.pending = {k: row[k] for k in ("step", "loss", "n_queries", "forward_passes", "param_norm")}
        self.pending["update_norm"] = update
        self.probes.reset()  # what the probes see next is the dev evaluation, if one follows this step

    def on_eval(self, step: int, split: str, result) -> None:
        if split != "dev":
            return
        if self.pending is None:  # step 0: the evaluation before training
            norm = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in self.params))
            self.pending = {"step": 0, "param_norm": norm}
        probes, hidden = self.probes, self.model.config.hidden_size
        self.pending.update(
            dev_loss=result.loss, dev_accuracy=result.score, tied_fraction=result.tied,
            final_norm_input_rms=math.sqrt(probes.sq_sum / max(probes.count, 1)), max_adapter_gain=probes.max_gain,
            overflow_fraction=probes.overflow / max(probes.count / hidden, 1))
        self.write()
        self.probes.reset()

    def write(self) -> None:
        if self.pending is not None:
            self.writer.writerow(self.pending)
            self.flush()
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.pending.items()),
                  flush=True)
            self.pending = None


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="adazeta-run overrides (after --)")
    args = parser.parse_args(argv)
    use_shared()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    from adazeta.build import compose_config
    from adazeta.run import run

    run_dir = args.out.with_name(args.out.stem + "_run")  # the run's own files (metrics.csv, eval.csv, ...)
    cfg = compose_config(["wandb.mode=disabled", *args.overrides, f"train.max_steps={args.steps}",
                          f"train.eval_every={args.eval_every}", "train.eval_every_forwards=null",
                          "train.max_forward_passes=null"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        diagnosis = Diagnosis(writer, f.flush)
        run(cfg, run_dir, observers=[diagnosis])
        diagnosis.write()
    return args.out


if __name__ == "__main__":
    main()
