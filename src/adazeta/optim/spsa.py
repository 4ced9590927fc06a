"""Pure pieces of the SPSA / MeZO zeroth-order estimator with Q queries (SPEC §3).

    g = (1/Q) * sum_q [L(w + eps z_q) - L(w - eps z_q)] / (2 eps) * z_q,     z_q ~ N(0, I)
    w <- w - lr * (g + weight_decay * w)

z is never stored: each query keeps a seed and a scalar (its projected gradient), and z_q is regenerated from
the seed, parameter by parameter in a fixed order, whenever it is needed. The noise comes from local
``torch.Generator``s so that it never touches (or is touched by) the global RNG, dropout or data order.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

_SEED_MASK = (1 << 63) - 1  # torch.Generator.manual_seed takes any 64-bit value; 63 bits stay a positive int64


def query_seed(run_seed: int, step: int, query: int) -> int:
    """Seed of query q at step k: a hash of (run seed, k, q), so no two queries or ranks share a direction."""
    if run_seed < 0 or step < 0 or query < 0:
        raise ValueError(f"query_seed needs non-negative ints, got run_seed={run_seed}, step={step}, query={query}")
    # SeedSequence mixes its whole entropy tuple, so nearby triples give unrelated seeds (unlike seed + step).
    state = np.random.SeedSequence([run_seed, step, query]).generate_state(1, dtype=np.uint64)
    return int(state[0]) & _SEED_MASK


def mask_seed(run_seed: int, step: int) -> int:
    """Seed of step k's random sparsity mask: a stream of its own, so it never repeats a query's seed."""
    if run_seed < 0 or step < 0:
        raise ValueError(f"mask_seed needs non-negative ints, got run_seed={run_seed}, step={step}")
    state = np.random.SeedSequence([run_seed, step], spawn_key=(1,)).generate_state(1, dtype=np.uint64)
    return int(state[0]) & _SEED_MASK


class _Streams:
    """Local generators seeded from one seed, one per device, created in the order devices are first met.

    Parameters split over several devices get one stream each; later devices derive their seed so that their
    draws do not repeat the first device's.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            n = len(self._generators)
            seed = self.seed if n == 0 else query_seed(self.seed, 0, n)
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return gen


class _Noise:
    """Draws z ~ N(0, I) for a fixed sequence of parameters from one seed, one generator per device."""

    def __init__(self, seed: int):
        self.seed = seed
        self._streams = _Streams(seed)

    def draw(self, p: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """A fresh z shaped like p (zero outside ``mask``): the one parameter-sized temporary."""
        gen = self._streams.on(p.device)
        # Draw the full tensor even under a mask, so z is the same whatever the mask and the stream stays aligned.
        z = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)
        if mask is not None:
            z.mul_(mask)
        return z


class RandomMask:
    """Per-parameter masks that are never stored: each is redrawn from ``seed`` whenever a pass needs it.

    Each entry is kept with probability ``density``. Masks are drawn parameter by parameter, in the parameters'
    order, from local generators, so every pass over the same parameters (a step's +eps, -eps and update passes)
    sees the same masks, at the cost of one uniform draw per entry and pass instead of one stored byte per entry.
    """

    def __init__(self, seed: int, density: float):
        if not 0.0 < density <= 1.0:
            raise ValueError(f"RandomMask density={density!r} must be in (0, 1]")
        self.seed, self.density = seed, density

    def for_params(self, params: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
        streams = _Streams(self.seed)
        for p in params:
            yield torch.rand(p.shape, generator=streams.on(p.device), device=p.device) < self.density


# Which entries each parameter may move: None (all), one tensor (or None) per parameter, or a RandomMask.
Masks = Sequence[torch.Tensor | None] | RandomMask | None


def _masks_for(params: Sequence[torch.Tensor], masks: Masks) -> Iterable[torch.Tensor | None]:
    """One mask (or None) per parameter, in order; a ``RandomMask`` is redrawn lazily, one tensor at a time."""
    if masks is None:
        return [None] * len(params)
    if isinstance(masks, RandomMask):
        return masks.for_params(params)
    if len(masks) != len(params):
        raise ValueError(f"got {len(masks)} masks for {len(params)} parameters")
    return masks


@torch.no_grad()
def directions(params: Sequence[torch.Tensor], seed: int, masks: Masks = None) -> list[torch.Tensor]:
    """z for every parameter, exactly as ``perturb_`` draws it from ``seed`` (for instruments that need z)."""
    noise = _Noise(seed)
    return [noise.draw(p, m) for p, m in zip(params, _masks_for(params, masks))]


@torch.no_grad()
def perturb_(params: Sequence[torch.Tensor], seed: int, scale: float, masks: Masks = None) -> None:
    """w <- w + scale * z, with z regenerated from ``seed`` (MeZO's perturbation, Algorithm 1)."""
    noise = _Noise(seed)
    for p, m in zip(params, _masks_for(params, masks)):
        z = noise.draw(p, m)
        p.add_(z, alpha=scale)
        del z  # free before drawing the next parameter's z: one temporary at a time


def projected_gradient(loss_plus: torch.Tensor, loss_minus: torch.Tensor, eps: float) -> torch.Tensor:
    """Central difference (L(w + eps z) - L(w - eps z)) / (2 eps), the gradient's projection on z."""
    # At least fp32, so that a bf16 loss does not round the small difference away; stays on the loss's device.
    dtype = torch.promote_types(torch.promote_types(loss_plus.dtype, loss_minus.dtype), torch.float32)
    return (loss_plus.to(dtype) - loss_minus.to(dtype)) / (2 * eps)


@torch.no_grad()
def zo_update_(
    params: Sequence[torch.Tensor],
    seeds: Sequence[int],
    grads: Sequence[torch.Tensor] | torch.Tensor,
    lr: float | Sequence[float],
    weight_decays: Sequence[float],
    reduction: str = "mean",
    masks: Masks = None,
) -> None:
    """w <- w - lr * (g + wd * w), g = (1/Q or 1) * sum_q grad_q * z_q, each z_q regenerated from seeds[q].

    ``grads`` are 0-dim tensors (or one tensor of Q values) left on the device: the update multiplies the noise
    by them, so no value is read back to the host. ``lr`` is one value or one per parameter (param groups).
    """
    n = len(params)
    lrs = [float(lr)] * n if isinstance(lr, (int, float)) else [float(x) for x in lr]
    if len(lrs) != n or len(weight_decays) != n:
        raise ValueError(f"got {len(lrs)} lrs and {len(weight_decays)} weight decays for {n} parameters")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
    if len(seeds) != len(grads):
        raise ValueError(f"got {len(seeds)} seeds for {len(grads)} projected gradients")
    grads = torch.stack(list(grads)) if not isinstance(grads, torch.Tensor) else grads.reshape(-1)
    # mean: the reference code's 1/Q; sum: the paper slides' plain sum, whose step grows with Q.
    scale = 1.0 / len(seeds) if reduction == "mean" else 1.0
    coefs = grads * scale  # (Q,) on the device

    # Decay first: w (1 - lr wd) - lr g equals w - lr (g + wd w) because g does not depend on w.
    for p, p_lr, wd in zip(params, lrs, weight_decays):
        if wd > 0:
            p.mul_(1.0 - p_lr * wd)

    # Queries outer, parameters inner: each z_q is drawn in the same order as in perturb_, so it is the same z.
    for q, seed in enumerate(seeds):
        noise = _Noise(seed)
        for p, p_lr, m in zip(params, lrs, _masks_for(params, masks)):
            z = noise.draw(p, m)
            coef = coefs[q] if coefs.device == p.device else coefs[q].to(p.device, non_blocking=True)
            # z * (-lr * grad_q / Q) with a 0-dim tensor factor: no host sync (``alpha=`` would need a float).
            z.mul_(coef * -p_lr)
            p.add_(z)
            del z


_NO_DECAY_KEYS = ("bias", "norm", "ln_")  # matched lower-cased, so also LayerNorm, layernorm, RMSNorm, ln_f


def decay_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """torch-style param groups (with ``param_names``): ``weight_decay`` on weights, 0 on biases and norms."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    decay_names: list[str] = []
    no_decay_names: list[str] = []
    for name, p in named_params:
        if any(key in name.lower() for key in _NO_DECAY_KEYS):
            no_decay.append(p)
            no_decay_names.append(name)
        else:
            decay.append(p)
            decay_names.append(name)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "param_names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "param_names": no_decay_names},
    ]
    # Drop an empty group (e.g. a model without biases): it would only clutter state_dicts and logs.
    return [g for g in groups if g["params"]]
