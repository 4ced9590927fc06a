"""How good is a ZO gradient estimate? Compare it with autograd's gradient of the same loss, on one minibatch.

For Q directions z_q ~ N(0, I) over the d trainable parameters, MeZO's estimate

    g_hat_Q = (1/Q) sum_q  [L(w + eps z_q) - L(w - eps z_q)] / (2 eps)  z_q

has E[g_hat] = g (up to the finite-difference error), but its cosine with g is only about sqrt(Q / (Q + d)): a
smaller trainable set d and more queries Q give better-aligned steps. That is AdaZeta's mechanism (TT adapters
shrink d; the schedule raises Q), measured here directly: cosine, relative norm error, and what a step at a
given learning rate does to the loss, per forward pass spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from adazeta.optim.spsa import Masks, directions, perturb_, projected_gradient, query_seed

Loss = Callable[[], torch.Tensor]


@dataclass
class FidelityRow:
    seed: int
    queries: int
    cosine: float  # cos(g_hat_Q, g)
    relative_error: float  # ||g_hat_Q - g|| / ||g||
    norm_ratio: float  # ||g_hat_Q|| / ||g||
    fd_error: float  # mean |projected gradient - z . g| / mean |z . g| over the Q queries (finite differences)
    loss_decrease: float  # L(w) - L(w - lr g_hat_Q), same minibatch
    predicted_decrease: float  # lr * g . g_hat_Q (first order)
    decrease_per_forward: float  # loss_decrease / (2Q)


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return float(sum(torch.sum(x.double() * y.double()) for x, y in zip(a, b)))


def autograd_gradient(params: Sequence[torch.Tensor], loss: Loss) -> list[torch.Tensor]:
    """d loss / d params by backpropagation (the parameters must require grad)."""
    value = loss()
    return [g.detach().clone() for g in torch.autograd.grad(value, list(params))]


@torch.no_grad()
def zo_fidelity(
    params: Sequence[torch.Tensor],
    loss: Loss,
    true_grad: Sequence[torch.Tensor],
    queries: Sequence[int],
    seeds: Sequence[int],
    eps: float,
    lr: float,
    masks: Masks = None,
) -> list[FidelityRow]:
    """One row per (seed, Q in ``queries``): the estimate from the first Q directions of that seed's stream.

    Directions come from ``query_seed(seed, 0, q)``, as step 0 of a run with that seed draws them. Estimates for
    smaller Q are prefixes of the larger ones (nested), so each seed costs 2 max(Q) forwards plus one per Q for
    the step's effect. The parameters are left as they were.
    """
    params = list(params)
    g_norm = math.sqrt(_dot(true_grad, true_grad))
    base = float(loss())
    wanted = sorted(set(queries))
    rows = []
    for seed in seeds:
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        fd_abs = dd_abs = 0.0
        for q in range(wanted[-1]):
            s = query_seed(seed, 0, q)
            perturb_(params, s, eps, masks)
            plus = loss()
            perturb_(params, s, -2 * eps, masks)
            minus = loss()
            perturb_(params, s, eps, masks)
            proj = float(projected_gradient(plus, minus, eps))
            z = directions(params, s, masks)
            exact = _dot(z, true_grad)  # the directional derivative the finite difference estimates
            fd_abs += abs(proj - exact)
            dd_abs += abs(exact)
            torch._foreach_add_(total, [t.float() for t in z], alpha=proj)
            del z
            n = q + 1
            if n not in wanted:
                continue
            est = [t / n for t in total]
            e_norm = math.sqrt(_dot(est, est))
            diff = [a - b.float() for a, b in zip(est, true_grad)]
            dot = _dot(est, true_grad)
            torch._foreach_add_(params, [(-lr * t).to(p.dtype) for t, p in zip(est, params)])
            after = float(loss())
            torch._foreach_add_(params, [(lr * t).to(p.dtype) for t, p in zip(est, params)])
            rows.append(FidelityRow(
                seed=seed, queries=n,
                cosine=dot / (e_norm * g_norm) if e_norm and g_norm else float("nan"),
                relative_error=math.sqrt(_dot(diff, diff)) / g_norm if g_norm else float("nan"),
                norm_ratio=e_norm / g_norm if g_norm else float("nan"),
                fd_error=fd_abs / dd_abs if dd_abs else float("nan"),
                loss_decrease=base - after,
                predicted_decrease=lr * dot,
                decrease_per_forward=(base - after) / (2 * n),
            ))
    return rows


def expected_cosine(queries: int, dim: int) -> float:
    """E[cos(g_hat_Q, g)] ~ sqrt(Q / (Q + d + 1)) for Gaussian directions (large d; exact FD)."""
    return math.sqrt(queries / (queries + dim + 1))


@torch.no_grad()
def projected_gradients(params: Sequence[torch.Tensor], loss: Loss, seed: int, n: int, eps: float) -> list[float]:
    """The central differences ``[L(w + eps z_q) - L(w - eps z_q)] / (2 eps)`` of the first ``n`` directions of
    ``seed`` (``query_seed(seed, 0, q)``): two models given the same seed are measured on the same directions."""
    params = list(params)
    out = []
    for q in range(n):
        s = query_seed(seed, 0, q)
        perturb_(params, s, eps)
        plus = loss()
        perturb_(params, s, -2 * eps)
        minus = loss()
        perturb_(params, s, eps)
        out.append(float(projected_gradient(plus, minus, eps)))
    return out


@torch.no_grad()
def estimate_vector(params: Sequence[torch.Tensor], projections: Sequence[float], seed: int) -> list[torch.Tensor]:
    """``sum_q projections[q] z_q`` over the directions of ``seed``, in float32 (the estimate up to its 1/Q)."""
    params = list(params)
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for q, proj in enumerate(projections):
        torch._foreach_add_(total, [t.float() for t in directions(params, query_seed(seed, 0, q))], alpha=proj)
    return total


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    norms = math.sqrt(_dot(a, a)) * math.sqrt(_dot(b, b))
    return _dot(a, b) / norms if norms else float("nan")


@torch.no_grad()
def estimate_cosine(params: Sequence[torch.Tensor], projections: Sequence[float], seed: int,
                    true_grad: Sequence[torch.Tensor]) -> float:
    """cos(g_hat, g) of the estimate ``mean_q projections[q] z_q`` (the directions of ``seed``) with ``true_grad``."""
    return cosine(estimate_vector(params, projections, seed), true_grad)


@torch.no_grad()
def directional_derivatives(params: Sequence[torch.Tensor], seed: int, n: int,
                            true_grad: Sequence[torch.Tensor]) -> list[float]:
    """``z_q . g`` for the first ``n`` directions of ``seed``: what exact finite differences would measure, so
    the estimate built from them is the best these directions can give (``projected_gradients`` approach it)."""
    params = list(params)
    return [_dot([t.float() for t in directions(params, query_seed(seed, 0, q))], true_grad) for q in range(n)]
