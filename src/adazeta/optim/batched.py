"""Batched queries: all the perturbed losses of one ZO step (MeZO's estimator with Q queries) from batched forwards.

The sequential estimator moves the weights, runs a forward, moves them back, 2Q times. The batched one
repeats the minibatch R times (copy-major) and, for one forward, lets every module that owns trainable
parameters run with R *replicas* of its weights: replica r is ``w + eps z_q`` (or ``- eps z_q``, or ``w``),
and copy r of the batch meets replica r only. The parameters themselves are never modified. R is at most
``chunk`` per forward, so memory grows with the chunk, not with Q. The replicas are built with the very
operations the sequential path applies (``w + eps z``, then ``- 2 eps z``), from the same seeds, so the
projected gradients agree with it up to the rounding of the forward itself.

How a module opts in (the ``ReplicaForward`` protocol): a method ``forward_replicas(x, weights)`` that
computes its forward for R replicas at once. ``x``'s leading dimension holds R replica-major groups of rows
(copy r's rows are the r-th block), and ``weights`` maps names of the module's own parameters (as
``module.named_parameters()`` spells them, e.g. ``cores.0``) to (R, *shape) stacks; a name it lacks keeps the
module's parameter. ``TTLinear`` implements it; ``nn.Linear`` is covered by a rule in ``REPLICA_RULES``, which
serves peft's LoRA A/B matrices and dense bottleneck adapters. A module type that cannot take the method (a
library class) registers a rule ``(module, x, weights) -> y`` there instead. Each trainable parameter is served
by the deepest module above it that can run replicas; a parameter with none (full fine-tuning: embeddings,
norms) makes the batched path fail with a ConfigError that names it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Protocol, Sequence

import torch
from torch import Tensor, nn

from adazeta.errors import ConfigError
from adazeta.optim.spsa import DirectionCache, Masks, directions, noise_layout, projected_gradient

ReplicaRule = Callable[[nn.Module, Tensor, Mapping[str, Tensor]], Tensor]


class ReplicaForward(Protocol):
    """A module that can compute its forward for R replicas of its weights in one call (see module docstring)."""

    def forward_replicas(self, x: Tensor, weights: Mapping[str, Tensor]) -> Tensor: ...


def linear_replicas(module: nn.Linear, x: Tensor, weights: Mapping[str, Tensor]) -> Tensor:
    """``nn.Linear`` with R replicas: ``y[r] = x[r] @ W_r^T + b_r`` as one batched matrix product."""
    replicas = next(iter(weights.values())).shape[0]
    weight = weights.get("weight", module.weight)  # (R, out, in) or the shared (out, in)
    bias = weights.get("bias", module.bias)
    flat = x.reshape(replicas, -1, x.shape[-1])
    if weight.dim() == 2:
        weight = weight.expand(replicas, *weight.shape)
    if bias is None:
        y = torch.bmm(flat, weight.transpose(1, 2))
    else:
        bias = bias if bias.dim() == 2 else bias.expand(replicas, -1)
        y = torch.baddbmm(bias[:, None, :], flat, weight.transpose(1, 2))
    return y.reshape(*x.shape[:-1], y.shape[-1])


# Rules for module types that do not implement ``forward_replicas`` themselves; matched along the class's MRO.
REPLICA_RULES: dict[type, ReplicaRule] = {nn.Linear: linear_replicas}


def replica_rule(module: nn.Module) -> ReplicaRule | None:
    """How ``module`` runs weight replicas: its own ``forward_replicas``, a registered rule, or None."""
    method = getattr(module, "forward_replicas", None)
    if callable(method):
        return lambda m, x, weights: method(x, weights)
    for cls in type(module).__mro__:
        if cls in REPLICA_RULES:
            return REPLICA_RULES[cls]
    return None


Site = tuple[nn.Module, str]  # (module that runs the replicas, the parameter's name inside it)
_SITES: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], list[Site]]]" = weakref.WeakKeyDictionary()


def replica_sites(model: nn.Module, params: Sequence[Tensor]) -> list[Site]:
    """For each parameter (by identity): the deepest module of ``model`` that can run its replicas.

    Raises ConfigError naming the first parameter no module can serve. Cached per model and parameter list.
    """
    key = tuple(id(p) for p in params)
    cached = _SITES.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    index = {id(p): i for i, p in enumerate(params)}
    sites: list[Site | None] = [None] * len(params)
    depth = [-1] * len(params)
    for name, module in model.named_modules():
        if replica_rule(module) is None:
            continue
        level = 0 if not name else name.count(".") + 1
        for local, p in module.named_parameters():
            i = index.get(id(p))
            if i is not None and level > depth[i]:
                sites[i], depth[i] = (module, local), level
    for i, site in enumerate(sites):
        if site is None:
            name = next((n for n, p in model.named_parameters() if p is params[i]), f"#{i}")
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            raise ConfigError(
                f"method.optimizer.batched_queries=true: parameter {name!r} lives in a {type(owner).__name__}, "
                f"which cannot run weight replicas; set method.optimizer.batched_queries=false, or give that module "
                f"a forward_replicas method (adazeta.optim.batched)"
            )
    resolved: list[Site] = [s for s in sites if s is not None]
    _SITES[model] = (key, resolved)
    return resolved


@contextmanager
def replicas_installed(sites: Sequence[Site], stacks: Sequence[Tensor]) -> Iterator[None]:
    """For the duration of the block, each site's module runs its forward with the (R, *shape) ``stacks``."""
    grouped: dict[int, tuple[nn.Module, dict[str, Tensor]]] = {}
    for (module, local), stack in zip(sites, stacks, strict=True):
        grouped.setdefault(id(module), (module, {}))[1][local] = stack
    patched: list[tuple[nn.Module, object]] = []
    try:
        for module, weights in grouped.values():
            rule = replica_rule(module)
            assert rule is not None  # replica_sites only returns modules with a rule
            # An instance attribute shadows the class's forward for this module only; hooks still run.
            patched.append((module, module.__dict__.get("forward")))
            module.forward = _bound(rule, module, weights)
        yield
    finally:
        for module, previous in patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


def _bound(rule: ReplicaRule, module: nn.Module, weights: Mapping[str, Tensor]) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor) -> Tensor:
        return rule(module, x, weights)

    return forward


class ReplicaClosure:
    """A ZO closure that can also evaluate R weight replicas in one forward.

    ``losses(n)`` must return the (n,) losses of one forward over n copies of the minibatch (copy-major, e.g.
    ``scoring.replica_losses``); ``closure()`` is its one-copy loss, so the sequential estimator can use it too.
    """

    def __init__(self, model: nn.Module, losses: Callable[[int], Tensor], batch: object | None = None):
        self.model = model
        self.losses = losses
        self.batch = batch  # the minibatch ``losses`` scores (``scoring.Batch``): sizes ``query_chunk=auto``

    def __call__(self) -> Tensor:
        return self.losses(1)[0]

    def replicated(self, params: Sequence[Tensor], stacks: Sequence[Tensor]) -> Tensor:
        """(R,) losses, the r-th with every parameter ``params[i]`` replaced by ``stacks[i][r]``."""
        sites = replica_sites(self.model, params)
        with replicas_installed(sites, stacks):
            return self.losses(int(stacks[0].shape[0]))


def replica_plan(seeds: Sequence[int], eps: float, estimator: str) -> list[tuple[int | None, tuple[float, ...]]]:
    """(seed, perturbation steps) of every loss evaluation, in the sequential estimator's order.

    central: ``+eps`` then ``+eps, -2 eps`` per query (the sequential path's arithmetic for w - eps z);
    one_sided: the unperturbed weights, then ``+eps`` per query.
    """
    if estimator == "central":
        return [entry for s in seeds for entry in ((s, (eps,)), (s, (eps, -2 * eps)))]
    if estimator == "one_sided":
        return [(None, ())] + [(s, (eps,)) for s in seeds]
    raise ValueError(f"estimator={estimator!r}; known: central, one_sided")


@torch.no_grad()
def replica_weights(
    params: Sequence[Tensor],
    plan: Sequence[tuple[int | None, tuple[float, ...]]],
    masks: Masks = None,
    cache: DirectionCache | None = None,
    noise: str = "per_tensor",
) -> list[Tensor]:
    """One (R, *shape) stack per parameter: row r is the parameter perturbed as ``plan[r]`` says.

    z is drawn as ``perturb_`` draws it from the seed (the same z as the sequential path), or taken from
    ``cache``, whose stream then decides ``noise``.
    """
    replicas = len(plan)
    stacks = [p.detach().reshape(1, -1).repeat(replicas, 1) for p in params]  # (R, numel): z is flat
    rows_of: dict[int, list[int]] = {}
    for r, (seed, steps) in enumerate(plan):
        if seed is not None and steps:
            rows_of.setdefault(seed, []).append(r)
    if cache is not None:
        noise = cache.layout.stream
    layout = cache.layout if cache is not None else noise_layout(params, noise)
    for seed, rows in rows_of.items():
        z = cache.get(seed) if cache is not None else None
        if z is None:
            z = [d.reshape(-1) for d in directions(params, seed, masks, noise, layout)]
        for r in rows:
            row = [stack[r] for stack in stacks]
            for scale in plan[r][1]:  # the sequential path's additions, in its order: the same rounding
                torch._foreach_add_(row, z, alpha=scale)
        del z
    return [stack.view(replicas, *p.shape) for stack, p in zip(stacks, params)]


# The sum of a forward's live tensors understates what it takes: on SmolLM2 with 16 SST-2 prompts the sum is 12 MB,
# while each extra replica of a batched step raised the measured peak by 20-31 MB (results/bench/chunk-memory).
ALLOCATOR_SLACK = 2.0


def forward_bytes(model: nn.Module, batch: object) -> int:
    """Activation memory of one no-grad forward over ``batch`` (bytes, an upper-bound estimate).

    Inside one decoder (or encoder) layer at a time: the residual stream and its normalised copy, q, k, v and the
    attention output (6 x tokens x hidden), the MLP's gate, up and activated tensors (3 x tokens x intermediate),
    the attention scores and mask of a kernel that materialises them (rows x heads x T x T), and once per forward
    the vocabulary logits of the scored positions with their log-softmax (2 x positions x vocabulary, fp32);
    times ``ALLOCATOR_SLACK`` for what the allocator holds beyond the live tensors.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0)
    inner = int(getattr(text, "intermediate_size", 0) or getattr(text, "ffn_dim", 0) or getattr(text, "n_inner", 0)
                or 4 * hidden)
    heads = int(getattr(text, "num_attention_heads", 0) or getattr(text, "n_head", 0) or 1)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    width = next((p.element_size() for p in base.parameters() if p.is_floating_point()), 4)
    ids = batch.input_ids
    rows, length = int(ids.shape[0]), int(ids.shape[1])
    tokens = rows * length
    layer = tokens * (6 * hidden + 3 * inner) * width + rows * length * length * (heads * width + 1)
    logits = int(batch.positions.numel()) * vocab * 4 * 2
    return int(ALLOCATOR_SLACK * (layer + logits))


def auto_chunk(closure: "ReplicaClosure", params: Sequence[Tensor], budget: float, limit: int) -> int:
    """The most replicas per forward (at most ``limit``) whose extra memory stays within ``budget`` x the
    inference forward's (weights plus one forward's activations): each replica beyond the first adds a forward's
    activations, and every replica a copy of the trainable parameters."""
    model = closure.model
    if closure.batch is None:
        return 1
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    one = forward_bytes(model, closure.batch)
    copy = sum(p.numel() * p.element_size() for p in params)
    allowed = budget * (weights + one)
    chunk = 1
    while chunk < limit and chunk * one + (chunk + 1) * copy <= allowed:
        chunk += 1  # chunk + 1 replicas: chunk x one extra activations, chunk + 1 weight copies
    return chunk


def estimate_batched(
    closure: ReplicaClosure,
    params: Sequence[Tensor],
    seeds: Sequence[int],
    eps: float,
    estimator: str,
    chunk: int,
    masks: Masks = None,
    cache: DirectionCache | None = None,
) -> tuple[Tensor, Tensor]:
    """(all losses evaluated, projected gradient per query), as an ``Estimator.estimate`` returns them.

    At most ``chunk`` replicas per forward; the parameters are left untouched.
    """
    plan = replica_plan(seeds, eps, estimator)
    chunk = max(1, min(chunk, len(plan)))
    parts = []
    for start in range(0, len(plan), chunk):
        part = plan[start : start + chunk]
        parts.append(closure.replicated(params, replica_weights(params, part, masks, cache)).detach())
    losses = torch.cat(parts)
    losses = losses.to(torch.promote_types(losses.dtype, torch.float32))
    if estimator == "central":
        grads = projected_gradient(losses[0::2], losses[1::2], eps)
    else:
        grads = (losses[1:] - losses[0]) / eps
    return losses, grads
