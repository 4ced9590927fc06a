"""Watch a ZO run from inside: what grows, at which step, and what the loss then measures.

    python -m adazeta.tools.diagnose_zo --out results/diagnostics/collapse_lr1e-2.csv -- \
        method=adazeta schedule=constant method.optimizer.lr=1e-2

Runs the training loop's ZO steps (same data order, same query seeds as ``adazeta-run`` with these overrides)
and writes one CSV row per step: training loss, norm of the trainable set and of its last update, and at each
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

import torch

from adazeta.tools.offline import use_shared

COLUMNS = ["step", "loss", "n_queries", "forward_passes", "param_norm", "update_norm", "dev_loss", "dev_accuracy",
           "tied_fraction", "final_norm_input_rms", "max_adapter_gain", "overflow_fraction"]


class Probes:
    """Forward hooks: the residual stream entering the final norm, and every adapter's relative change."""

    def __init__(self, model: torch.nn.Module):
        from adazeta.adapters.bottleneck import BottleneckAdapter
        from adazeta.adapters.tt import TTAdapter
        from adazeta.scoring import lm_parts

        self.sq_sum = self.count = self.overflow = 0.0
        self.max_gain = 0.0
        backbone, _ = lm_parts(model, "causal")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="adazeta-run overrides (after --)")
    args = parser.parse_args()
    use_shared()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))

    from adazeta.build import build, compose_settings, seed_everything
    from adazeta.evaluate import evaluate
    from adazeta.optim.batched import ReplicaClosure
    from adazeta.train import steps_per_epoch

    s = compose_settings(["wandb.mode=disabled", *args.overrides])
    seed_everything(s.seed)
    b = build(s)
    model, scorer = b.model, b.scorer
    dev = scorer.batches(b.enc["dev"], s.train.eval_batch_size, sort=True)
    params = [p for _, p in b.named]
    probes = Probes(model)

    def dev_eval() -> dict[str, float]:
        probes.reset()
        result = evaluate(scorer, dev)  # the loop's own evaluation: loss, accuracy, tied share
        rms = math.sqrt(probes.sq_sum / max(probes.count, 1))
        return dict(dev_loss=result.loss, dev_accuracy=result.score, tied_fraction=result.tied,
                    final_norm_input_rms=rms, max_adapter_gain=probes.max_gain,
                    overflow_fraction=probes.overflow / max(probes.count / model.config.hidden_size, 1))

    def norm() -> float:
        return math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in params))

    per_epoch = steps_per_epoch(len(b.enc["train"]), s.train.batch_size)
    order_gen = torch.Generator().manual_seed(s.seed)  # as train(): data order only
    order = torch.randperm(len(b.enc["train"]), generator=order_gen)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerow(dict(step=0, param_norm=norm(), **dev_eval()))
        for step in range(1, args.steps + 1):
            epoch, slot = divmod(step - 1, per_epoch)
            if slot == 0 and step > 1:
                order = torch.randperm(len(b.enc["train"]), generator=order_gen)
            chosen = [b.enc["train"][i] for i in order[slot * s.train.batch_size : (slot + 1) * s.train.batch_size].tolist()]
            batch = scorer.collate(chosen)
            before = [p.detach().clone() for p in params]
            q = b.schedule(epoch)
            loss = b.optimizer.step(ReplicaClosure(model, lambda n, bt=batch: scorer.replica_losses(bt, n)), n_queries=q)
            update = math.sqrt(sum(float((p.detach() - o).double().pow(2).sum()) for p, o in zip(params, before)))
            row = dict(step=step, loss=float(loss), n_queries=q, forward_passes=b.optimizer.forward_passes,
                       param_norm=norm(), update_norm=update)
            if step % args.eval_every == 0:
                row.update(dev_eval())
            writer.writerow(row)
            f.flush()
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
