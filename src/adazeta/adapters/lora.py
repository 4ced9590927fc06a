"""LoRA through the ``peft`` library (MeZO-LoRA with ZO-SGD, LoRA with AdamW)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from adazeta.adapters import ADAPTERS, AdapterCapabilities
from adazeta.adapters.sites import find_sites, linear_features
from adazeta.errors import ConfigError


@dataclass
class LoraAdapterConfig(AdapterCapabilities):
    r: int = 8  # rank (8 for first-order LoRA in the AdaZeta paper's tables; MeZO-LoRA's reference code uses 5)
    alpha: float = 16.0  # scaling numerator: the update is (alpha / r) * B A
    dropout: float = 0.0  # LoRA dropout; ZO forwards run in eval mode, so it only acts in first-order runs
    # None: peft's default for the architecture (q and v projections); for a model type peft has no default for,
    # the MLP's projections found from the module structure (adapters/sites.py)
    target_modules: list[str] | None = None
    # Also train the whole LM head, untied from the input embeddings: the reference RoBERTa MeZO-LoRA's trainable
    # set (AdaZeta / MeZO medium_models/run.py freeze only roberta.* weights without "lora"; the head stays).
    train_head: bool = False

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"method.adapter.r={self.r} must be >= 1")
        if self.alpha <= 0:
            # alpha = 0 scales the update (alpha / r) B A to nothing: the adapter would never change the model.
            raise ConfigError(f"method.adapter.alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"method.adapter.dropout={self.dropout} must be in [0, 1)")

    def count_trainable(self, backbone: nn.Module) -> int:
        """r (in + out) for each module peft wraps (matched by peft's own rule), plus the whole head with
        ``train_head`` (untied: its own copy of a tied matrix)."""
        from peft import LoraConfig
        from peft.tuners.tuners_utils import check_target_module_exists
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

        targets = lora_targets(backbone, self) or PEFT_DEFAULTS[backbone.config.model_type]
        matcher = LoraConfig(r=self.r, target_modules=targets)
        total = 0
        for name, module in backbone.named_modules():
            if name and check_target_module_exists(matcher, name):
                sides = linear_features(module) or (
                    (module.num_embeddings, module.embedding_dim) if isinstance(module, nn.Embedding) else None)
                if sides is None:
                    raise ConfigError(f"method.adapter.target_modules: LoRA cannot wrap {name} (a "
                                      f"{type(module).__name__}); name linear or embedding modules")
                total += self.r * sum(sides)
        if self.train_head:
            from adazeta.adapters.basic import head_module

            total += sum(p.numel() for p in head_module(backbone).parameters())
        return total

    def count_modules(self, model: nn.Module) -> int:
        from peft.tuners.lora import LoraLayer

        return sum(isinstance(m, LoraLayer) for m in model.modules())


def lora_targets(model: nn.Module, cfg: LoraAdapterConfig) -> list[str] | None:
    """The modules LoRA wraps, as peft's ``target_modules``: the config's, else None (peft's default for the model
    type), else (a type peft has no default for) the MLP's projections found from the module structure."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    targets = list(cfg.target_modules) if cfg.target_modules else None
    if targets is None and getattr(model.config, "model_type", None) not in PEFT_DEFAULTS:
        targets = list(find_sites(model, "official"))  # full module names: peft matches exactly these
    return targets


@ADAPTERS.register("lora", LoraAdapterConfig)
def add_lora(model: nn.Module, cfg: LoraAdapterConfig) -> nn.Module:
    """Wrap the model with peft LoRA; only the LoRA A and B matrices train."""
    from peft import LoraConfig, get_peft_model

    model.requires_grad_(False)
    config = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=lora_targets(model, cfg),
        bias="none",
    )
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as e:  # peft: no default target modules for this architecture, or none matched
        raise ConfigError(f"LoRA could not be placed ({e}); set adapter.target_modules, e.g. [q_proj,v_proj]") from None
    if cfg.train_head:
        from adazeta.adapters.basic import head_module, untie_head

        untie_head(wrapped)
        head_module(wrapped).requires_grad_(True)
    return wrapped
