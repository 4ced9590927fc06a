"""Finite-difference estimators (central, one-sided, ES's members) on the seeded directions: one forward per loss,
batched forwards over weight replicas, or this rank's share of a step spread over processes.

A ``FiniteDifferences`` estimator evaluates a step's queries along the directions z_q of ``adazeta.optim.spsa``
and turns their losses into one g_q per direction:

- ``central`` (MeZO): g_q = (L(w + eps z_q) - L(w - eps z_q)) / (2 eps), 2Q forwards;
- ``one_sided``: g_q = (L(w + eps z_q) - L(w)) / eps, Q + 1 forwards (one unperturbed), biased by O(eps);
- ``members``: one forward at each w + eps z_q, no difference taken (ES shapes the Q losses, ``zo_es``).

``shape`` (optional) maps the step's losses to the g_q instead (ES's fitness shaping, after the ranks' sum on
several processes). How the losses are evaluated is the estimator's own:

- one after another (``sequential``), perturbing the parameters in place and restoring them: from a copy when the
  set takes at most ``opt.KEEP_WEIGHTS_BYTES`` (exact), else by the opposite perturbation (MeZO's way);
- with ``method.optimizer.batched_queries`` and a closure that evaluates weight replicas
  (``adazeta.optim.batched.ReplicaClosure``), in batched forwards of at most ``query_chunk`` perturbed copies each
  (``auto``: as many as ``query_memory`` allows), with the same z and the same projected gradients; a plain
  closure falls back to one forward per loss;
- with a ``plan`` (several processes), this rank's queries on this rank's shard, completed by one all-reduce
  (``share``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from adazeta.distributed import all_sum_
from adazeta.optim.batched import auto_chunk, estimate_batched
from adazeta.optim.engine import Estimator, Queries, as_loss, register_estimator
from adazeta.optim.spsa import perturb_, projected_gradient

log = logging.getLogger("adazeta")

AUTO_CHUNK_LIMIT = 64  # query_chunk=auto never replicates a minibatch more than this many times
FORWARDS: dict[str, Callable[[int], int]] = {  # forwards of a step of q queries, by the differences taken
    "central": lambda q: 2 * q,
    "one_sided": lambda q: q + 1,
    "members": lambda q: q,
}


class FiniteDifferences(Estimator):
    """Finite differences along the seeded directions (``differences``: central, one_sided or members), each g_q
    the difference's, or ``shape(losses)`` of the step's losses."""

    def __init__(self, name: str, differences: str = "central",
                 shape: Callable[[torch.Tensor], torch.Tensor] | None = None, *, batched: bool = True,
                 parallel: tuple[str, ...] = ("auto", "query", "data")):
        self.name, self.differences, self.shape = name, differences, shape
        self.batched, self.parallel = batched, parallel

    def forwards(self, queries: int) -> int:
        return FORWARDS[self.differences](queries)

    def estimate(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        if queries.plan is not None:
            losses, grads = self.share(opt, queries)
        elif self.replicas(opt, queries.closure):
            losses, grads = estimate_batched(queries.closure, queries.params, queries.seeds, opt.eps,
                                             self.differences, self.chunk(opt, queries), queries.masks, queries.cache)
        else:
            losses, grads = self.sequential(opt, queries)
        return (losses, grads) if self.shape is None else (losses, self.shape(losses))

    def replicas(self, opt: Any, closure: Any) -> bool:
        """Whether the losses come from batched forwards over weight replicas (``batched_queries``)."""
        if opt.config.batched_queries:
            if callable(getattr(closure, "replicated", None)):
                return True
            if not opt.warned_sequential:  # e.g. a generation objective: nothing to replicate
                log.warning("batched_queries=true, but this closure cannot evaluate weight replicas: sequential")
                opt.warned_sequential = True
        return False

    def chunk(self, opt: Any, queries: Queries) -> int:
        """Replicas per batched forward: ``query_chunk``, or with ``auto`` the most that ``query_memory`` allows."""
        chunk = opt.config.query_chunk
        if chunk == "auto":
            chunk = auto_chunk(queries.closure, queries.params, opt.config.query_memory, AUTO_CHUNK_LIMIT)
        opt.last_chunk = chunk
        return chunk

    def sequential(self, opt: Any, queries: Queries,
                   evaluated: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward per loss, perturbing the parameters in place; ``evaluated``: the indices of the queries to
        evaluate (None: all). The others are perturbed and restored without a forward, so that the parameters
        end with the rounding of the whole step's perturbations, as on a single process."""
        closure, params, seeds, masks = queries.closure, queries.params, queries.seeds, queries.masks
        cache = queries.cache
        layout, eps, noise = cache.layout, opt.eps, opt.noise
        wanted = set(range(len(seeds)) if evaluated is None else evaluated)
        saved = [f.clone() for f in layout.flat] if layout.nbytes <= opt.KEEP_WEIGHTS_BYTES else None

        def restore(seed: int, scale: float, z: Any) -> None:
            if saved is not None:
                torch._foreach_copy_(layout.flat, saved)  # exact, whatever the rounding of the perturbations
            else:
                perturb_(params, seed, scale, masks, noise, z, layout)

        # One query with a z drawn on every pass (a full model): its restoring pass is left to the update, which
        # undoes it with the z it draws anyway (``zo_update_(restore=...)``): a quarter of the step's draws.
        defer = opt.FUSE_RESTORE and len(seeds) == 1 and cache.peek(seeds[0]) is None and saved is None
        losses: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if self.differences == "central":
            for i, seed in enumerate(seeds):
                z = cache.get(seed)  # None: regenerated on every pass
                perturb_(params, seed, eps, masks, noise, z, layout)
                loss_plus = as_loss(closure()) if i in wanted else None
                perturb_(params, seed, -2 * eps, masks, noise, z, layout)
                loss_minus = as_loss(closure()) if i in wanted else None
                if defer and z is None:
                    queries.restore = (seed, eps)
                else:
                    restore(seed, eps, z)
                del z
                if i in wanted:
                    losses += [loss_plus, loss_minus]
                    grads.append(projected_gradient(loss_plus, loss_minus, eps))
        elif self.differences == "members":
            # One forward at each w + eps z_q, no difference taken: the estimator shapes the Q losses (ES).
            for i, seed in enumerate(seeds):
                z = cache.get(seed)
                perturb_(params, seed, eps, masks, noise, z, layout)
                if i in wanted:
                    losses.append(as_loss(closure()))
                restore(seed, -eps, z)
                del z
            grads = list(losses)
        else:
            # One-sided (L(w + eps z) - L(w)) / eps: Q + 1 forwards instead of 2Q, at the price of O(eps) bias.
            loss_zero = as_loss(closure()) if wanted else None
            if wanted:
                losses.append(loss_zero)
            for i, seed in enumerate(seeds):
                z = cache.get(seed)
                perturb_(params, seed, eps, masks, noise, z, layout)
                loss_plus = as_loss(closure()) if i in wanted else None
                if defer and z is None:
                    queries.restore = (seed, -eps)
                else:
                    restore(seed, -eps, z)
                del z
                if i in wanted:
                    losses.append(loss_plus)
                    grads.append((loss_plus - loss_zero) / eps)
        if not losses:
            empty = torch.zeros(0, device=params[0].device)
            return empty, empty
        return torch.stack(losses), torch.stack(grads)

    def share(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's queries on this rank's shard, summed over the ranks into the whole step's estimate.

        Each rank fills the slots of its queries with its losses and projected gradients times its shard's share
        of the minibatch (zeros elsewhere); one all-reduce of the 3Q floats completes them on every rank.
        """
        params, seeds, plan = queries.params, queries.seeds, queries.plan
        q, central = len(seeds), self.differences == "central"
        mine = plan.queries(q)
        n_losses = 2 * q if central else q + 1
        dtype = torch.promote_types(params[0].dtype, torch.float32)
        buffer = torch.zeros(n_losses + q, dtype=dtype, device=params[0].device)
        losses, grads = buffer[:n_losses], buffer[n_losses:]
        weight = plan.weight
        evaluates = bool(mine) and weight > 0  # a rank without a query this step, or with an empty shard: zeros
        if not evaluates:
            mine = []
        opt.last_evaluated_seeds = [seeds[i] for i in mine]
        if self.replicas(opt, queries.closure):  # the parameters stay untouched; keep the z a single process keeps
            queries.cache.keep(seeds)
            local_losses, local_grads = (
                estimate_batched(queries.closure, params, [seeds[i] for i in mine], opt.eps, self.differences,
                                 self.chunk(opt, queries), queries.masks, queries.cache) if evaluates else (None, None))
        else:  # the other ranks' queries are perturbed and restored too: the same rounding on every rank
            local_losses, local_grads = self.sequential(opt, queries, mine)
        if evaluates:
            at = torch.tensor(mine, device=buffer.device)
            grads[at] = local_grads.to(dtype) * weight
            local_losses = local_losses.to(dtype) * weight
            if central:
                losses[2 * at], losses[2 * at + 1] = local_losses[0::2], local_losses[1::2]
            else:
                if plan.group == 0:  # the unperturbed loss: every group computes it, one group reports it
                    losses[0] = local_losses[0]
                losses[1 + at] = local_losses[1:]
        start = time.perf_counter()
        all_sum_(buffer)
        opt.comm_s.append(time.perf_counter() - start)  # the step's one all-reduce, timed where it runs
        return losses, grads


# MeZO's estimator: g_q = (L(w + eps z) - L(w - eps z)) / (2 eps), 2Q forwards a step.
register_estimator(FiniteDifferences("central", "central"))
# One-sided: g_q = (L(w + eps z) - L(w)) / eps, Q + 1 forwards (one unperturbed), biased by O(eps).
register_estimator(FiniteDifferences("one_sided", "one_sided"))
