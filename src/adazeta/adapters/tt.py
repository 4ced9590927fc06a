"""Tensor-train (TT) adapters, AdaZeta's trainable part (Yang et al., EMNLP 2024), and their injection into a backbone.

Over 400 lines: the TT adapter's config, layers, folded factor groups and injection are one unit.

An adapter is ``h -> h + up(act(down(h)))`` with bottleneck b, where ``down`` (H -> b) and ``up`` (b -> H) are
TT matrices (``adazeta.tensor.tt``). It is placed on the input (``base(x + A(x))``) or on the output
(``y + A(y)``) of chosen linear layers (``adazeta.adapters.sites`` says which). Everything else is frozen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adazeta.adapters import ADAPTERS, AdapterCapabilities
from adazeta.adapters.sites import PLACEMENT_NAMES, POSITIONS, check_targets, linear_features, resolve_sites
from adazeta.errors import ConfigError
from adazeta.tensor.tt import default_shape, init_cores, split_index, tt_factors, tt_matmul, tt_num_params

# reference: the AdaZeta reference code's init, not the identity at step 0; identity: the last `up` core and
# the `up` bias start at zero, so the adapted model equals the backbone at step 0 (as LoRA's B = 0 does).
INITS = ("reference", "identity")
# Without autograd, an adapter whose layers are grouped runs from their folded factors (TTAdapter._folded_forward);
# inside ``unfolded()`` it runs the unfolded products instead: the same numbers, kept so that the benchmark can
# time both. Set only through that context manager.
_FOLD = True


@contextlib.contextmanager
def unfolded() -> Iterator[None]:
    """Grouped adapters run their unfolded products while the block runs (the same numbers, more arithmetic)."""
    global _FOLD
    saved, _FOLD = _FOLD, False
    try:
        yield
    finally:
        _FOLD = saved

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "identity": nn.Identity,
}

@dataclasses.dataclass
class TTAdapterConfig(AdapterCapabilities):
    """Config of AdaZeta's TT adapter; validated on construction."""

    takes_model_shapes: ClassVar[bool] = True  # conf/model/*.yaml's tt_shapes (e.g. [8,8,16,8,8] on RoBERTa-Large)
    takes_sites: ClassVar[bool] = True  # conf/model/*.yaml's placements, unless `targets` names its own

    bottleneck: int = 64  # b: width of the adapter's hidden layer
    rank: int = 5  # inner TT rank r of both projections; parameters grow as r^2
    placement: str = "official"  # "official" (reference code) or "paper"; ignored when `targets` is set
    shape_down: list[int] | None = None  # TT modes of the (H, b) down matrix; None derives balanced ones
    shape_up: list[int] | None = None  # TT modes of the (b, H) up matrix; None derives balanced ones
    activation: str = "relu"
    num_factors: int = 3  # modes per side when shapes are derived (H -> num_factors modes, b -> num_factors)
    # Sites: [{"pattern": regex searched in module names, "position": "input" or "output"}]. None: the model
    # config's placement table for its model_type, else the MLP projections found from the module structure.
    targets: list[dict] | None = None
    # reference (default, for fidelity): each adapter moves its site's activations (by up to 65 % at step 0 on
    # SmolLM2), so the adapted model starts far from the backbone; identity: starts exactly at the backbone.
    init: str = "reference"

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ConfigError(f"method.adapter.init={self.init!r} is unknown; known: {', '.join(INITS)}")
        if self.bottleneck < 1:
            raise ConfigError(f"method.adapter.bottleneck={self.bottleneck} must be >= 1")
        if self.rank < 1:
            raise ConfigError(f"method.adapter.rank={self.rank} must be >= 1")
        if self.num_factors < 1:
            raise ConfigError(f"method.adapter.num_factors={self.num_factors} must be >= 1")
        if self.placement not in PLACEMENT_NAMES:
            raise ConfigError(f"method.adapter.placement={self.placement!r} is unknown; known: {', '.join(PLACEMENT_NAMES)}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"method.adapter.activation={self.activation!r} is unknown; known: {', '.join(ACTIVATIONS)}")
        if self.shape_down is not None:
            self._check_shape("shape_down", list(self.shape_down), bottleneck_is_input=False)
        if self.shape_up is not None:
            self._check_shape("shape_up", list(self.shape_up), bottleneck_is_input=True)
        if self.targets is not None:
            check_targets(self.targets, "method.adapter.targets")

    def _check_shape(self, field: str, shape: list[int], bottleneck_is_input: bool) -> None:
        if len(shape) < 2 or any(not isinstance(k, int) or k < 1 for k in shape):
            raise ConfigError(f"method.adapter.{field}={shape} must be a list of at least two positive integers")
        total = math.prod(shape)
        if total % self.bottleneck:
            raise ConfigError(
                f"method.adapter.{field}={shape} has product {total}, not a multiple of bottleneck={self.bottleneck}"
            )
        # down: (H, b), so a prefix must multiply to H; up: (b, H), so a prefix must multiply to b.
        in_features = self.bottleneck if bottleneck_is_input else total // self.bottleneck
        try:
            split_index(shape, in_features)
        except ValueError:
            side = "first" if bottleneck_is_input else "last"
            raise ConfigError(
                f"method.adapter.{field}={shape} cannot be split: its {side} modes must multiply to "
                f"bottleneck={self.bottleneck}"
            ) from None

    def count_trainable(self, backbone: nn.Module) -> int:
        """At each site of width H: the cores of the down and up tensor trains and their biases (b and H)."""
        total = 0
        for base, position in resolve_sites(backbone, self.targets, self.placement).values():
            fan_in, fan_out = linear_features(base)
            features = fan_in if position == "input" else fan_out
            down, up = self.shapes(features)
            total += tt_num_params(down, self.rank) + tt_num_params(up, self.rank) + self.bottleneck + features
        return total

    def count_modules(self, model: nn.Module) -> int:
        return count_adapters(model)

    def check_hidden(self, hidden_size: int) -> None:
        """Fail before loading a model when explicit shapes do not fit ``hidden_size * bottleneck``."""
        for field in ("shape_down", "shape_up"):
            self.check_features(field, hidden_size, what="hidden_size")

    def check_features(self, field: str, features: int, what: str = "features") -> None:
        """Raise ConfigError when ``getattr(self, field)`` is set and its product is not ``features * b``."""
        shape = getattr(self, field)
        if shape is None:
            return
        expected = features * self.bottleneck
        if math.prod(shape) != expected:
            raise ConfigError(
                f"method.adapter.{field}={list(shape)} has product {math.prod(shape)} but {what}*bottleneck = "
                f"{features}*{self.bottleneck} = {expected}; fix the shape or remove it to derive one"
            )

    def shapes(self, features: int) -> tuple[list[int], list[int]]:
        """TT modes (down, up) for an adapter of width ``features``: the explicit ones or balanced ones."""
        self.check_features("shape_down", features)
        self.check_features("shape_up", features)
        down = list(self.shape_down) if self.shape_down else default_shape(features, self.bottleneck, self.num_factors)
        up = list(self.shape_up) if self.shape_up else default_shape(self.bottleneck, features, self.num_factors)
        return down, up


def _uniform(size: int, bound: float, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """``U(-bound, bound)`` drawn on the generator's device (uninitialized on meta)."""
    if device.type == "meta":
        return torch.empty(size, device=device)
    draw_device = generator.device if generator is not None else device
    values = torch.rand(size, generator=generator, device=draw_device) * (2 * bound) - bound
    return values.to(device)


class TTLinear(nn.Module):
    """``y = x @ W + bias`` with W (in, out) kept as a tensor train of modes ``shape``; fp32 parameters."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        shape: Sequence[int],
        rank: int,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if math.prod(shape) != in_features * out_features:
            raise ValueError(
                f"TT shape {list(shape)} has product {math.prod(shape)}, expected {in_features}*{out_features}"
            )
        device = torch.device(device) if device is not None else torch.empty(0).device
        self.in_features, self.out_features = in_features, out_features
        self.shape, self.rank = list(shape), rank
        self.split = split_index(shape, in_features)
        cores = init_cores(shape, rank, in_features, out_features, generator=generator, device=device)
        self.cores = nn.ParameterList(nn.Parameter(core) for core in cores)
        # Reference init: U(+-1/sqrt(out)), so the adapter is not the identity at step 0.
        self.bias = nn.Parameter(_uniform(out_features, 1 / math.sqrt(out_features), generator, device))
        self._group: tuple[TTFactorGroup, int] | None = None  # (its group, its place in it): see group_tt_layers

    def factors(self) -> tuple[Tensor, Tensor]:
        """``(A^T, B^T)``, contiguous, with ``W = A @ B`` (``tt_factors``): the two rank-r halves as ``nn.Linear``
        weights, a layout whose skinny products run 2-3x faster on a CPU than ``x @ A``. Without autograd they come
        from the layer's group, contracted for all its layers at once (``grouped``)."""
        if not self.grouped():
            a, b = tt_factors(list(self.cores), self.split)
            return a.t().contiguous(), b.t().contiguous()
        group, index = self._group
        return group.factors(index)

    def grouped(self) -> bool:
        """Whether this forward reads the layer's group: without autograd, and not under ``torch.compile`` (the
        group's cache is host-side state that a compiled graph would guard on, once per layer, and recompile for)."""
        return self._group is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def folded(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The layer's product with its bias folded in, for forwards without autograd: ``(A1, e, B1)`` with
        ``x @ W + bias == F.linear(F.linear(x, A1, e), B1)``. A1 is ``A^T`` with a zero row and e the unit vector
        of that row, so the first product's extra column is exactly 1; B1 is ``[B^T | bias]``, so the second
        product adds the bias as the last term of its own sum, with no copy of the bias into its output, and
        ``torch.addmm(r, y, B1.t())`` adds a residual r in the same call. From the layer's group (None without
        one)."""
        if self._group is None:
            return None
        group, index = self._group
        return group.folded(index)

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x)

    def product(self, x: Tensor) -> Tensor:
        """``x @ W + bias``: what ``forward`` computes, callable without the module call (``TTAdapter``)."""
        a_t, b_t = self.factors()
        return F.linear(F.linear(x, a_t), b_t, self.bias)

    def forward_replicas(self, x: Tensor, weights: Mapping[str, Tensor]) -> Tensor:
        """``forward`` with R weight replicas at once (the ``ReplicaForward`` protocol of ``adazeta.optim.batched``).

        ``x``'s leading dimension holds R replica-major groups of rows; ``weights`` maps parameter names
        (``cores.0``, ..., ``bias``) to (R, *shape) stacks; a name it lacks keeps the module's own parameter.
        """
        replicas = next(iter(weights.values())).shape[0]
        cores = [weights.get(f"cores.{i}", core.expand(replicas, *core.shape)) for i, core in enumerate(self.cores)]
        bias = weights.get("bias", self.bias.expand(replicas, -1))
        y = tt_matmul(x.reshape(replicas, -1, x.shape[-1]), cores, self.split)  # (R, rows of one replica, out)
        return (y + bias[:, None, :]).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, shape={self.shape}, rank={self.rank}"


def _layer_state(layer: "TTLinear") -> tuple[int, ...]:
    # Every in-place torch op on a parameter (an optimizer's step, a ZO perturbation, load_state_dict) bumps its
    # version counter; a new tensor (.to(), .cuda()) has another storage; a parameter swapped in (setattr,
    # torch.func.functional_call) is another object. Read from the list's dict: iterating it is several times slower.
    params = (*layer.cores._parameters.values(), layer.bias)
    return tuple(map(id, params)) + tuple(p._version for p in params) + tuple(p.data_ptr() for p in params)


class TTFactorGroup:
    """TT layers of one model with the same modes, rank, device and dtype, whose factors are contracted together.

    A forward of a model with TT adapters contracts every layer's cores into its factors (A, B): five small matrix
    products per layer, 900 for SmolLM2's 180 layers, each too small to keep a core (or a GPU) busy. Stacked, a
    group's layers take five batched products in all. The factors, and on request the layers' folded factors
    (``TTLinear.folded``: the bias inside the products), are kept until a core or bias of any layer changes (its
    version counter or storage; writes through ``.data`` bypass both and are not seen) and serve forwards without
    autograd (ZO steps, evaluation); with autograd each layer contracts its own cores, as before.
    The factors equal each layer's own contraction to rounding (batched products may sum in another order: 1e-6 in
    fp32, tested; bit for bit on SmolLM2's shapes on the CPUs measured).
    """

    def __init__(self, layers: Sequence[TTLinear]):
        self.layers = list(layers)
        self.split = self.layers[0].split
        self._states: list[tuple[int, ...]] | None = None
        self._factors: list[tuple[Tensor, Tensor]] = []
        self._stacked: tuple[Tensor, Tensor] | None = None  # the factors of all layers, (G, r, in) and (G, out, r)
        self._folded: list[tuple[Tensor, Tensor, Tensor]] | None = None

    def _refresh(self, index: int) -> None:
        """Contract again if a core or the bias of layer ``index`` changed since the last contraction."""
        if self._states is None or self._states[index] != _layer_state(self.layers[index]):
            self._contract()

    def factors(self, index: int) -> tuple[Tensor, Tensor]:
        self._refresh(index)
        return self._factors[index]

    def folded(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        """``TTLinear.folded`` of layer ``index``: built for the whole group from its factors, once per contraction."""
        self._refresh(index)
        if self._folded is None:
            self._fold()
        return self._folded[index]

    @torch.no_grad()
    def _contract(self) -> None:
        cores = [tuple(layer.cores) for layer in self.layers]
        a, b = tt_factors([torch.stack(stack) for stack in zip(*cores)], self.split)
        self._stacked = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()
        self._factors = list(zip(*(stack.unbind() for stack in self._stacked)))
        self._folded = None
        self._states = [_layer_state(layer) for layer in self.layers]

    @torch.no_grad()
    def _fold(self) -> None:
        a_t, b_t = self._stacked
        bias = torch.stack([layer.bias for layer in self.layers])  # (G, out)
        a1 = torch.cat([a_t, a_t.new_zeros(a_t.shape[0], 1, a_t.shape[2])], dim=1)  # (G, r + 1, in)
        e = a_t.new_zeros(a_t.shape[1] + 1)
        e[-1] = 1
        b1 = torch.cat([b_t, bias[:, :, None]], dim=2)  # (G, out, r + 1)
        self._folded = [(a, e, b) for a, b in zip(a1.unbind(), b1.unbind())]


def group_tt_layers(model: nn.Module) -> int:
    """Put ``model``'s TT layers of the same modes, rank, device and dtype into shared ``TTFactorGroup``s (a
    layer alone keeps its own contraction). Returns the number of groups."""
    groups: dict[tuple, list[TTLinear]] = {}
    for module in model.modules():
        if isinstance(module, TTLinear):
            core = module.cores[0]
            groups.setdefault((tuple(module.shape), module.rank, module.split, core.device, core.dtype), []).append(module)
    n = 0
    for layers in groups.values():
        if len(layers) > 1 and layers[0].cores[0].device.type != "meta":
            group = TTFactorGroup(layers)
            for index, layer in enumerate(layers):
                layer._group = (group, index)
            n += 1
    return n


def _called_as_module(module: nn.Module) -> bool:
    """Whether ``module`` must run through its module call: its forward replaced on the instance, or hooks."""
    hooks = nn.modules.module
    return ("forward" in module.__dict__ or bool(module._forward_hooks) or bool(module._forward_pre_hooks)
            or bool(module._backward_hooks) or bool(module._backward_pre_hooks)
            or bool(hooks._global_forward_hooks) or bool(hooks._global_forward_pre_hooks)
            or bool(hooks._global_backward_hooks) or bool(hooks._global_backward_pre_hooks))


class TTAdapter(nn.Module):
    """AdaZeta's ``h -> h + up(act(down(h)))`` with TT ``down`` and ``up``, in float32 whatever the dtype of h."""

    def __init__(
        self,
        features: int,
        bottleneck: int,
        shape_down: Sequence[int],
        shape_up: Sequence[int],
        rank: int,
        activation: str = "relu",
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        init: str = "reference",
    ):
        super().__init__()
        if init not in INITS:
            raise ValueError(f"init={init!r}; known: {', '.join(INITS)}")
        self.down = TTLinear(features, bottleneck, shape_down, rank, generator=generator, device=device)
        self.act = ACTIVATIONS[activation]()
        self.up = TTLinear(bottleneck, features, shape_up, rank, generator=generator, device=device)
        if init == "identity" and self.up.bias.device.type != "meta":
            # One zero core zeroes the whole `up` matrix, so the adapter adds nothing at step 0. The other cores
            # keep their reference values: a ZO perturbation moves the zero core and the bias off zero at once,
            # and from the first update on every core's direction changes the output (first-order, like LoRA's B).
            with torch.no_grad():
                self.up.cores[-1].zero_()
                self.up.bias.zero_()

    def forward(self, h: Tensor) -> Tensor:
        x = h.float()
        down, up = self.down, self.up
        if _called_as_module(down) or _called_as_module(up):
            # A layer with a forward of its own (weight replicas: adazeta.optim.batched) or with hooks.
            return (x + up(self.act(down(x)))).to(h.dtype)
        if _FOLD and down.grouped() and up.grouped():
            return self._folded_forward(x).to(h.dtype)
        # The same products without the two layers' module calls, and the residual added into the last one's
        # fresh output: the same numbers (x + y == y + x), an allocation and two calls fewer per adapter.
        out = up.product(self.act(down.product(x)))
        # Add in fp32 and round once: a bf16 residual would round the (small) adapter update twice.
        return out.add_(x).to(h.dtype)

    def _folded_forward(self, x: Tensor) -> Tensor:
        """``x + up(act(down(x)))`` from the layers' folded factors (``TTLinear.folded``), for forwards without
        autograd (ZO steps, evaluation): four products, the biases inside them and the residual inside the last,
        with a ReLU in place; no bias copies and no separate addition. The sums are those of the products with
        a bias, each bias added last, so the numbers equal the unfolded forward's (bit for bit on the CPUs we
        measured; 1e-6 tested)."""
        a_d, e_d, b_d = self.down.folded()
        a_u, e_u, b_u = self.up.folded()
        flat = x.reshape(-1, x.shape[-1])
        y = F.linear(F.linear(flat, a_d, e_d), b_d)
        y = F.relu_(y) if type(self.act) is nn.ReLU else self.act(y)
        return torch.addmm(flat, F.linear(y, a_u, e_u), b_u.t()).view(x.shape)


class AdaptedLinear(nn.Module):
    """A frozen linear layer with a TT adapter on its input, ``base(A(x))``, or output, ``A(base(x))``."""

    def __init__(self, base: nn.Module, adapter: TTAdapter, position: str):
        super().__init__()
        if position not in POSITIONS:
            raise ValueError(f"position={position!r}; known: {', '.join(POSITIONS)}")
        self.base, self.adapter, self.position = base, adapter, position
        self.in_features, self.out_features = linear_features(base)

    # Some model code reads `layer.weight` (e.g. its dtype) from the modules it owns.
    @property
    def weight(self) -> Tensor:
        return self.base.weight

    def forward(self, x: Tensor) -> Tensor:
        # The adapter's forward without its module call, unless it is hooked or its forward replaced.
        adapter = self.adapter if _called_as_module(self.adapter) else self.adapter.forward
        if self.position == "input":
            return self.base(adapter(x))
        return adapter(self.base(x))

    def extra_repr(self) -> str:
        return f"position={self.position}"


def count_adapters(model: nn.Module) -> int:
    """Number of TT adapters in ``model``."""
    return sum(isinstance(m, TTAdapter) for m in model.modules())


@ADAPTERS.register("tt", TTAdapterConfig)
def add_tt_adapters(model: nn.Module, cfg: TTAdapterConfig, generator: torch.Generator | None = None) -> nn.Module:
    """Freeze ``model`` and wrap each targeted linear layer in an AdaptedLinear; only adapters train.

    Adapters are float32 and live on their layer's device (meta included: nothing is drawn there).
    ``generator`` (optional) makes their initialization independent of the global RNG.
    """
    model.requires_grad_(False)
    for name, (base, position) in resolve_sites(model, cfg.targets, cfg.placement).items():
        fan_in, fan_out = linear_features(base)
        features = fan_in if position == "input" else fan_out
        down, up = cfg.shapes(features)
        adapter = TTAdapter(
            features, cfg.bottleneck, down, up, cfg.rank, cfg.activation, generator=generator,
            device=base.weight.device, init=cfg.init,
        )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, AdaptedLinear(base, adapter, position))
    group_tt_layers(model)
    from adazeta.runs.saving import refuse_save_pretrained

    refuse_save_pretrained(model)  # its keys are renamed now: adazeta.save_adapters keeps what trains
    return model
