"""Forward-Grad (Baydin et al. 2022, "Gradients without Backpropagation"; benchmarked by ZO-Bench): the exact
directional derivative g_q = grad L(w) . z_q from one forward-mode pass (``torch.func.jvp``), no finite
difference, then ZO-SGD's update w <- w - lr ((1/Q) sum_q g_q z_q + wd w) from the same seeded directions.

One query costs one forward (a jvp: the forward plus its tangents, about twice a forward's arithmetic and the
activations' tangents in memory, no stored graph; its matmul's forward-mode rule copies a weight, the LM head's at
most). The closure must expose its model (``closure.model``: the
training loop's classification and LM objectives do), whose trainable parameters are swapped for the jvp's
inputs while it runs; a generation objective (F1 of sampled answers) has no derivative and is refused. ``eps``
is unused. Queries run one after another on one process; attention runs through the math kernel (the fused
kernels have no forward-mode derivative).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.engine import Estimator, Queries, register_estimator
from adazeta.optim.spsa import decay_groups, directions
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig


def parameter_sites(model: nn.Module, params: Sequence[torch.Tensor]) -> list[tuple[nn.Module, str]]:
    """(module, name in its ``_parameters``) of each parameter, by identity."""
    where = {id(p): (module, name) for module in model.modules() for name, p in module._parameters.items()
             if p is not None}
    missing = [i for i, p in enumerate(params) if id(p) not in where]
    if missing:
        raise ConfigError(f"estimator=forward_grad: {len(missing)} trained parameter(s) are not in the closure's model")
    return [where[id(p)] for p in params]


@contextlib.contextmanager
def swapped(sites: Sequence[tuple[nn.Module, str]], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The modules' parameters replaced by ``tensors`` (a jvp's dual inputs) while the block runs."""
    saved = [module._parameters[name] for module, name in sites]
    try:
        for (module, name), t in zip(sites, tensors):
            module._parameters[name] = t  # read back by Module.__getattr__: the forward uses the dual tensor
        yield
    finally:
        for (module, name), p in zip(sites, saved):
            module._parameters[name] = p


class ForwardGrad(Estimator):
    """g_q = grad L(w) . z_q by one jvp per query, on one process."""

    name = "forward_grad"
    batched = False
    parallel = ()
    forward_mode = True

    def forwards(self, queries: int) -> int:
        return queries

    def estimate(self, opt: Any, queries: Queries) -> tuple[torch.Tensor, torch.Tensor]:
        if queries.plan is not None:
            raise ConfigError("estimator=forward_grad runs on one process; set distributed.mode or launch one process")
        closure, params, masks = queries.closure, queries.params, queries.masks
        model = getattr(closure, "model", None)
        if model is None:
            raise ConfigError("estimator=forward_grad needs a differentiable objective whose closure exposes its "
                              "model (not a generation objective): use another estimator")
        sites = parameter_sites(model, params)
        losses, grads = [], []
        for seed in queries.seeds:
            z = directions(params, seed, masks, opt.noise, queries.cache.layout)

            def loss_at(*weights: torch.Tensor) -> torch.Tensor:
                with swapped(sites, weights):
                    loss = torch.as_tensor(closure())  # not as_loss: detaching would drop the tangent
                return loss.reshape(()).to(torch.promote_types(loss.dtype, torch.float32))

            # Forward-mode AD (no graph is kept: nothing asks for a backward), through the math attention kernel:
            # the fused CPU / flash kernels have no forward-mode derivative.
            with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
                loss, derivative = torch.func.jvp(loss_at, tuple(p.detach() for p in params), tuple(z))
            del z  # before the next query draws its own: one z at a time (a full model's is the model's size)
            losses.append(loss.detach())
            grads.append(derivative.detach().to(loss.dtype))
        return torch.stack(losses), torch.stack(grads)


register_estimator(ForwardGrad())


@dataclasses.dataclass
class ForwardGradConfig(ZOSGDConfig):
    """Forward-Grad: exact directional derivatives by forward-mode AD, ZO-SGD's update."""

    estimator: str = "forward_grad"


@OPTIMIZERS.register("forward_grad", ForwardGradConfig)
def build_forward_grad(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ForwardGradConfig, seed: int) -> ZOSGD:
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed)
