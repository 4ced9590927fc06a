"""``dry_run=true``: build the model on the meta device, attach the method's adapter, count, estimate memory.

Nothing is downloaded and no memory is allocated: the architecture comes from the model YAML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from adazeta.adapters import ADAPTERS
from adazeta.adapters.tt import count_adapters
from adazeta.models import build_meta_model, count_parameters

if TYPE_CHECKING:
    from adazeta.run import Settings

GIB = 2**30
ESTIMATE_SEQ_LEN = 256  # tokens per training sequence assumed by the activation estimate


def memory_estimate(s: "Settings", total: int, trainable: int, seq_len: int = ESTIMATE_SEQ_LEN) -> dict[str, float]:
    """Training memory in GiB by part: weights, activations, gradients, optimizer state (rough, documented).

    Activations for backward follow Korthikanti et al. (2022): per layer s*b*h*(34 + 5*a*s/h) bytes in 16-bit,
    scaled to the backbone's dtype. A ZO or inference forward keeps only about two layers' worth at a time.
    """
    arch = s.model.architecture or {}
    h = arch.get("hidden_size", 0)
    layers = arch.get("num_hidden_layers", 0)
    heads = arch.get("num_attention_heads", 1)
    width = torch.tensor([], dtype=s.model.torch_dtype).element_size()
    b = s.train.batch_size
    per_layer = seq_len * b * h * (34 + 5 * heads * seq_len / max(h, 1)) * width / 2
    weights = total * width + trainable * (4 - width if s.adapter.kind != "full" else 0)
    kind = s.optimizer.kind if s.optimizer else None
    first_order = kind is not None and kind != "zo_sgd"
    activations = per_layer * (layers if first_order else 2)
    grads = trainable * 4 if first_order else 0
    state = trainable * 8 if kind == "adamw" else 0
    parts = {"weights": weights, "activations": activations, "gradients": grads, "optimizer_state": state}
    out = {k: round(v / GIB, 3) for k, v in parts.items()}
    out["total"] = round(sum(parts.values()) / GIB, 3)
    return out


def dry_run(s: "Settings") -> dict[str, Any]:
    model = build_meta_model(s.model)
    model = ADAPTERS.get(s.adapter.kind).builder(model, s.adapter.config)
    total, trainable = count_parameters(model)
    record = {
        "model": s.model.name,
        "method": s.method,
        "total_params": total,
        "trainable_params": trainable,
        "adapters": count_adapters(model),
        "memory_estimate_gib": memory_estimate(s, total, trainable),
        "estimate_assumes": f"batch {s.train.batch_size} x {ESTIMATE_SEQ_LEN} tokens, {s.model.dtype} backbone",
    }
    print(f"model            {s.model.name} ({s.model.family}, {s.model.dtype})")
    print(f"method           {s.method} (adapter: {s.adapter.kind}, optimizer: {s.optimizer.kind if s.optimizer else None})")
    print(f"total params     {total:,}")
    print(f"trainable params {trainable:,}")
    print(f"adapters         {record['adapters']}")
    est = record["memory_estimate_gib"]
    print(
        "memory estimate  "
        + ", ".join(f"{k} {v:.2f} GiB" for k, v in est.items())
        + f"  ({record['estimate_assumes']})"
    )
    return record
