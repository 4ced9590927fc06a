"""Numerical guards: does an update move the weights it means to move, and do the processes hold the same weights?

A small update can vanish in the weights' rounding: a bf16 weight of 0.02 has a resolution of ~1e-4, so
lr x g below half of it leaves the weight as it was, and at eps = 1e-30 a perturbation moves no weight at all, so
every projected gradient is zero. Such a run "finishes" with nothing trained. Every ``guard.every`` steps the loop
measures, on a fixed sample of trainable entries (all of them for small trainable sets):

- ``update_changed``: the share of the sampled entries whose stored value the step changed;
- ``update_cosine``: the cosine between the applied update (new - old weights, float64) and the one the optimizer
  meant (its ``intended_update``, exact arithmetic on the same directions; blank for optimizers without one).

``guard.stall_checks`` measurements in a row that change no entry (at most ``guard.stall_share`` of them) stop
the run as ``stalled``, a result with
that measurement as its reason. With several processes, a checksum of the trainable weights is compared across
the ranks every ``guard.checksum_every`` steps: ranks that drifted apart stop the run as failed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from adazeta.errors import ConfigError

log = logging.getLogger("adazeta")


@dataclass
class GuardConfig:
    every: int = 10  # measure the update every this many steps (0: never)
    sample: int = 65536  # entries measured at most (all entries of a smaller trainable set)
    stall_checks: int = 3  # this many measurements in a row that change no entry stop the run as `stalled` (0: never)
    # A measurement that changed at most this share of the entries counts as changing none: entries at exactly 0
    # (an embedding's padding row) take any update, however small, when every other entry rounds it away.
    stall_share: float = 1e-3
    checksum_every: int = 50  # several processes: compare the trainable weights' checksum every this many steps (0: never)

    def __post_init__(self) -> None:
        for name in ("every", "stall_checks", "checksum_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"guard.{name}={getattr(self, name)} must be >= 0 (0 turns it off)")
        if self.sample < 1:
            raise ConfigError(f"guard.sample={self.sample} must be >= 1")
        if not 0 <= self.stall_share < 1:  # also refuses nan
            raise ConfigError(f"guard.stall_share={self.stall_share} must be in [0, 1)")


@dataclass
class UpdateCheck:
    changed: float  # share of the measured entries whose value changed
    cosine: float  # cos(applied, intended); nan when the optimizer states no intended update or either is zero
    entries: int  # entries measured
    intended_norm: float  # ||intended update|| on the measured entries (nan: unknown)
    applied_norm: float  # ||applied update|| on the measured entries


class UpdateProbe:
    """Measures one step's update on a fixed sample of the trainable entries: ``before()``, the step, ``after()``.

    The sample (``index[i]``: entries of parameter i, None for all) is drawn once, from ``seed``, in proportion
    to each parameter's size, so every measurement looks at the same entries; it costs two float64 copies of
    the sample, never a copy of the weights.
    """

    def __init__(self, params: Sequence[torch.Tensor], sample: int, seed: int = 0):
        self.params = list(params)
        total = sum(p.numel() for p in self.params)
        self.index: list[torch.Tensor | None] = []
        gen = torch.Generator().manual_seed(seed)
        for p in self.params:
            if total <= sample:
                self.index.append(None)
                continue
            k = min(p.numel(), max(1, round(sample * p.numel() / total)))
            picked = torch.randperm(p.numel(), generator=gen)[:k].sort().values
            self.index.append(picked.to(p.device))
        self.entries = sum(p.numel() if i is None else i.numel() for p, i in zip(self.params, self.index))
        self._before: list[torch.Tensor] | None = None

    def values(self) -> list[torch.Tensor]:
        """The sampled entries of every parameter, as float64 (exact for every float dtype)."""
        return [(p.detach().reshape(-1) if i is None else p.detach().reshape(-1)[i]).double()
                for p, i in zip(self.params, self.index)]

    def before(self) -> None:
        self._before = self.values()

    def after(self, intended: Callable[..., list[torch.Tensor]] | None) -> UpdateCheck:
        """Compare the weights now with those at ``before()``. ``intended(index, before)``: the update the
        optimizer meant at the sampled entries, float64 (``ZOSGD.intended_update``), or None."""
        if self._before is None:
            raise RuntimeError("UpdateProbe.after() without before()")
        old, self._before = self._before, None
        new = self.values()
        intended = intended(self.index, old) if intended is not None else None
        applied = torch.cat([(n - o).reshape(-1).cpu() for n, o in zip(new, old)])
        changed = float((applied != 0).sum()) / max(1, applied.numel())
        applied_norm = float(applied.norm())
        cosine = intended_norm = math.nan
        if intended is not None:
            meant = torch.cat([t.reshape(-1).double().cpu() for t in intended])
            intended_norm = float(meant.norm())
            if intended_norm > 0 and applied_norm > 0:
                cosine = float(applied @ meant) / (applied_norm * intended_norm)
        return UpdateCheck(changed, cosine, self.entries, intended_norm, applied_norm)


def stall_reason(checks: Sequence[UpdateCheck], dtype: torch.dtype, eps: float | None) -> str:
    """Why a run stalled, from its last measurements (each changed no entry)."""
    last = checks[-1]
    most = max(c.changed for c in checks)
    share = "none" if most == 0 else f"at most {most:.2%}"
    head = (f"stalled: {len(checks)} measured updates in a row changed {share} of {last.entries:,} trainable entries "
            f"({str(dtype).replace('torch.', '')} weights)")
    if last.intended_norm == 0:
        perturbation = f" (eps={eps:g} moves no weight or no loss)" if eps is not None else ""
        return f"{head}: every update was zero, the perturbed losses were equal{perturbation}; raise eps"
    if not math.isnan(last.intended_norm):
        return (f"{head}: the intended update (norm {last.intended_norm:.3g}) is below the weights' resolution; "
                "raise the learning rate or train in float32")
    return f"{head}: raise the learning rate, or train in float32"


def checksum(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """(sum, sum of squares, sum of index-weighted entries) of the trainable weights in float64: any rank whose
    weights differ by one entry gives another triple."""
    out = torch.zeros(3, dtype=torch.float64)
    for k, p in enumerate(params, 1):
        flat = p.detach().reshape(-1).double()
        out[0] += flat.sum().cpu()
        out[1] += flat.square().sum().cpu()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).mul_(1.0 / flat.numel())
        out[2] += (flat * weights).sum().cpu() * k
    return out


def ranks_agree(params: Sequence[torch.Tensor]) -> bool:
    """Whether every process holds the same trainable weights (True with a single process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    mine = checksum(params)
    if dist.get_backend() == "nccl":
        mine = mine.to(params[0].device)
    high, low = mine.clone(), -mine
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MAX)
    return bool(torch.equal(high, -low))


class UpdateGuard:
    """The training loop's side of the guards: which steps are measured, the measurements in a row that changed no
    entry, the one warning about rounding, and the stall decision; its state goes into checkpoints."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: GuardConfig, seed: int = 0):
        self.cfg, self.dtype = cfg, params[0].dtype
        self.probe = UpdateProbe(params, cfg.sample, seed) if cfg.every else None
        self.stalls: list[UpdateCheck] = []
        self.warned = False

    def before(self, step: int) -> bool:
        """Snapshot the sample when ``step`` is measured; whether it is."""
        measured = self.probe is not None and step % self.cfg.every == 0
        if measured:
            self.probe.before()
        return measured

    def after(self, optimizer: Any, step: int) -> UpdateCheck:
        check = self.probe.after(getattr(optimizer, "intended_update", None))
        if check.changed < 0.5 and not self.stalls and not self.warned:
            self.warned = True
            log.warning("step %d changed only %.1f%% of the measured trainable entries (cos(applied, intended) %s): "
                        "the weights' rounding drops most of each update; raise the learning rate or train in "
                        "float32", step, 100 * check.changed, "n/a" if math.isnan(check.cosine) else f"{check.cosine:.3f}")
        self.stalls = self.stalls + [check] if check.changed <= self.cfg.stall_share else []
        return check

    def stalled(self, optimizer: Any) -> str | None:
        """The reason to stop as `stalled`, once ``stall_checks`` measurements in a row changed nothing."""
        if self.cfg.stall_checks and len(self.stalls) >= self.cfg.stall_checks:
            return stall_reason(self.stalls, self.dtype, getattr(optimizer, "eps", None))
        return None

    @staticmethod
    def columns(check: UpdateCheck | None) -> dict[str, float | None]:
        """metrics.csv's update_changed and update_cosine (blank on unmeasured steps)."""
        return {"update_changed": None if check is None else round(check.changed, 6),
                "update_cosine": None if check is None or math.isnan(check.cosine) else round(check.cosine, 6)}

    def state_dict(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(c) for c in self.stalls]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.stalls = [UpdateCheck(**c) for c in state]
