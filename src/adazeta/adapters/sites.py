"""Where adapters go: the linear layers they wrap, and whether on the input or the output.

Sites come from a list of ``{pattern, position}`` targets (regexes searched in the dotted module names): the
method's ``adapter.targets``, else the model config's ``placements`` entry for its model_type (the reference
placements, ``conf/model/*.yaml``). A model_type without an entry gets its sites from its module structure
(:func:`find_sites`): the MLP's projections, recognised by their shapes against the hidden and intermediate sizes.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from transformers.pytorch_utils import Conv1D

from adazeta.errors import ConfigError

POSITIONS = ("input", "output")
# official: the reference code's sites (Llama: the inputs of gate_proj and up_proj, the output of down_proj);
# paper: "after the attention and the feed-forward sub-layers".
PLACEMENT_NAMES = ("official", "paper")


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a linear-like module (nn.Linear or GPT-2's Conv1D, whose weight is (in, out)); else None."""
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return None


def check_targets(targets: Any, where: str) -> None:
    """Raise ConfigError unless ``targets`` is a list of ``{pattern: regex, position: input|output}``."""
    if not isinstance(targets, list):
        raise ConfigError(f"{where}={targets!r} must be a list of {{pattern, position}} entries")
    for i, target in enumerate(targets):
        if not isinstance(target, dict) or set(target) != {"pattern", "position"}:
            raise ConfigError(f"{where}[{i}]={target} must have exactly the keys 'pattern' and 'position'")
        if target["position"] not in POSITIONS:
            raise ConfigError(f"{where}[{i}].position={target['position']!r} is unknown; known: {', '.join(POSITIONS)}")
        try:
            re.compile(target["pattern"])
        except (re.error, TypeError) as err:
            raise ConfigError(f"{where}[{i}].pattern={target['pattern']!r} is not a regex: {err}") from None


def check_placements(placements: Any, where: str) -> None:
    """A placement table: ``{model_type: {official: targets, paper: targets}}``."""
    if not isinstance(placements, dict):
        raise ConfigError(f"{where} must map model types to {{official: [...], paper: [...]}}")
    for model_type, table in placements.items():
        if not isinstance(table, dict) or set(table) != set(PLACEMENT_NAMES):
            keys = sorted(table) if isinstance(table, dict) else table
            raise ConfigError(f"{where}.{model_type} has {keys}; it needs exactly {', '.join(PLACEMENT_NAMES)}")
        for name, targets in table.items():
            check_targets(targets, f"{where}.{model_type}.{name}")


def match_targets(model: nn.Module, targets: list[dict]) -> dict[str, tuple[nn.Module, str]]:
    """Linear layers to adapt: module name -> (layer, position). Every pattern must match; none may overlap."""
    chosen: dict[str, tuple[nn.Module, str]] = {}
    hits = {t["pattern"]: 0 for t in targets}
    for name, module in model.named_modules():
        if linear_features(module) is None:
            continue
        for target in targets:
            if re.search(target["pattern"], name):
                if name in chosen:
                    raise ConfigError(f"adapter: module {name!r} is matched by more than one target pattern")
                chosen[name] = (module, target["position"])
                hits[target["pattern"]] += 1
    missing = [pattern for pattern, n in hits.items() if n == 0]
    if missing:
        raise ConfigError(
            f"adapter: pattern(s) {', '.join(map(repr, missing))} match no linear layer of this model; "
            f"check adapter.targets or adapter.placement"
        )
    return chosen


# Config fields that name the MLP's width, by the conventions of transformers' model types (Llama, OPT, Falcon,
# GPT-2 / GPT-J / GPT-BigCode). GPT-2's n_inner=None and BLOOM mean 4 x hidden; MPT's expansion_ratio is not what
# transformers builds (4 x hidden whatever the ratio): the layers themselves are the better witness.
INTERMEDIATE_FIELDS = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner")


def model_linears(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Linear-like layers but the output head: module name -> (in, out)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: f for name, m in model.named_modules() if (f := linear_features(m)) is not None and m is not head}


def structural_intermediate(hidden: int, linears: dict[str, tuple[int, int]]) -> int | None:
    """The MLP's width read off the layers: the one width X != hidden with both hidden -> X and X -> hidden layers.

    A fused projection (attention's hidden -> 3 x hidden, Phi-3's gate and up hidden -> 2 x X) has no partner
    back to hidden, so it is not taken for the MLP's width. None when no width, or more than one, qualifies.
    """
    into = {o for i, o in linears.values() if i == hidden and o != hidden}
    out_of = {i for i, o in linears.values() if o == hidden and i != hidden}
    widths = into & out_of
    return widths.pop() if len(widths) == 1 else None


def mlp_sizes(config: Any, linears: dict[str, tuple[int, int]] | None = None) -> tuple[int, int]:
    """(hidden, intermediate) sizes: the config's intermediate where the layers (``linears``, module name ->
    (in, out)) confirm it or are not given, else the one width the layers pair with hidden."""
    hidden = getattr(config, "hidden_size", None)
    named = next((v for v in (getattr(config, f, None) for f in INTERMEDIATE_FIELDS) if isinstance(v, int) and v > 0),
                 None)
    inner = named
    if hidden and linears is not None:
        shapes = set(linears.values())
        confirmed = named and ({(hidden, named), (hidden, 2 * named)} & shapes) and (named, hidden) in shapes
        found = structural_intermediate(hidden, linears)
        if not confirmed and found and named and found != named:
            raise ConfigError(
                f"model_type={getattr(config, 'model_type', None)!r}: its config names an intermediate size of {named} "
                f"but its layers pair hidden {hidden} with {found}; set method.adapter.targets"
            )
        inner = named if confirmed else found or named
    if not hidden or not inner:
        raise ConfigError(
            f"model_type={getattr(config, 'model_type', None)!r}: neither its config nor its layers give one hidden "
            "and one intermediate size, so adapter sites cannot be found from the module structure; "
            "set method.adapter.targets"
        )
    return hidden, inner


def find_sites(model: nn.Module, placement: str) -> dict[str, tuple[nn.Module, str]]:
    """Adapter sites from the module structure, for model types without a placement table entry.

    The MLP's input projections are the linear layers hidden -> intermediate (or -> 2 x intermediate, a fused
    gate and up projection as in Phi-3); its output projection is intermediate -> hidden. ``official`` adapts
    the inputs of the former and the output of the latter (the reference code's Llama placement); ``paper``
    adapts the outputs of the attention's output projection (the last other linear layer with hidden outputs
    before each MLP) and of the MLP's output projection. An input projection inside a module that also holds an
    attention output is the attention's, whatever its width. Each decoder or encoder layer must yield exactly
    one MLP output projection (and, for ``paper``, one attention output).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    fix = "set method.adapter.targets, e.g. [{pattern: 'mlp\\.down_proj$', position: output}]"
    modules = dict(model.named_modules())
    linears = model_linears(model)
    hidden, inner = mlp_sizes(config, linears)
    if hidden == inner:
        raise ConfigError(f"model_type={model_type!r}: hidden and intermediate sizes are both {hidden}, so shapes "
                          f"cannot tell the MLP from the attention; {fix}")
    # Modules holding a layer with hidden outputs other than an MLP output: attention blocks. A fused attention
    # projection as wide as the MLP (Phi-3's qkv_proj can be) lives there, so shapes alone would take it for one.
    attention = {name.rpartition(".")[0] for name, (i, o) in linears.items() if o == hidden and i != inner}
    mlp_in: list[str] = []
    mlp_out: list[str] = []
    attention_out: list[str] = []
    pending: str | None = None  # the last other layer with hidden outputs: the attention's output projection
    for name, (fan_in, fan_out) in linears.items():
        if fan_in == hidden and fan_out in (inner, 2 * inner) and name.rpartition(".")[0] not in attention:
            mlp_in.append(name)
        elif fan_in == inner and fan_out == hidden:
            mlp_out.append(name)
            attention_out += [pending] if pending else []
            pending = None
        elif fan_out == hidden:
            pending = name
    layers = getattr(config, "num_hidden_layers", None)
    if getattr(config, "num_hidden_groups", None):  # ALBERT: its layers share the weights of a few distinct ones
        layers = config.num_hidden_groups * getattr(config, "inner_group_num", 1)
    found = {"MLP output projection (intermediate -> hidden)": mlp_out}
    if placement == "paper":
        found["attention output projection (the last layer -> hidden before an MLP)"] = attention_out
    for what, names in found.items():
        if len(names) != layers:
            raise ConfigError(f"model_type={model_type!r}: found {len(names)} {what} for {layers} layers "
                              f"(hidden {hidden}, intermediate {inner}); {fix}")
    if placement == "official":
        sites = {name: "input" for name in mlp_in} | {name: "output" for name in mlp_out}
    else:
        sites = {name: "output" for name in attention_out + mlp_out}
    # Registration order, as a table's patterns would give: the adapters' initialisation draws in that order.
    return {name: (module, sites[name]) for name, module in modules.items() if name in sites}


def resolve_sites(model: nn.Module, targets: list[dict] | None, placement: str) -> dict[str, tuple[nn.Module, str]]:
    """The sites ``targets`` name, or those :func:`find_sites` finds when there are none."""
    if targets is not None:
        return match_targets(model, list(targets))
    return find_sites(model, placement)
