"""``dry_run=true``: build the model on the meta device, attach the method's adapter, count, estimate memory.

Nothing is downloaded and no memory is allocated: the architecture comes from the model YAML, or from the model's
own config.json (a folder holding only that file is enough) or GGUF header.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from adazeta.build import attach_adapter
from adazeta.models import architecture_summary, build_meta_model, count_parameters
from adazeta.optim.memory import TrainedSet

if TYPE_CHECKING:
    from adazeta.settings import Settings

GIB = 2**30
ESTIMATE_SEQ_LEN = 256  # tokens per training sequence assumed by the activation estimate


def memory_parts(
    s: "Settings", total: int, trained: Sequence[Sequence[int]], seq_len: int = ESTIMATE_SEQ_LEN,
    largest_weight: int = 0,
) -> dict[str, float]:
    """Training memory in bytes by part: weights, activations, gradients, optimizer state, step temporaries.

    ``total`` weights, the trained ones shaped ``trained``; ``largest_weight``: entries of the model's largest
    weight tensor. Activations for backward follow Korthikanti et al. (2022): per layer s*b*h*(34 + 5*a*s/h) bytes
    in 16-bit, scaled to the backbone's dtype. First-order methods keep them for every layer even when only adapters
    or LoRA train, since backward runs through the whole frozen network; with ``train.gradient_checkpointing`` they
    keep each layer's input hidden states (s*b*h values) and one layer's activations at a time, recomputed in
    backward. A ZO or inference forward keeps only about two layers' worth at a time (times ``query_chunk`` with
    batched queries, whose forward replicates the minibatch; times the optimizer's ``activation_copies``: a jvp
    keeps a tangent beside each). Trained backbone weights (ft, mezo) keep the backbone's dtype, adapters are fp32;
    gradients and AdamW's two moments take the trained parameters' dtype. The optimizer declares the rest on its
    config: the state it keeps between steps (``state_bytes``: Sparse-MeZO's magnitude mask is a bit per entry)
    and the peak of the temporaries one step of the schedule's most queries holds (``step_bytes``: a dense
    estimate, copies of the weights, kept or drawn noise, a rule's per-tensor arithmetic; the run's device decides
    how noise is drawn, so a GPU run's estimate is the larger one).
    """
    arch = architecture_summary(s.model)
    h = arch["hidden_size"] or 0
    layers = arch["num_hidden_layers"] or 0
    heads = arch["num_attention_heads"] or 1
    width = torch.tensor([], dtype=s.model.torch_dtype).element_size()
    b = s.train.batch_size
    per_layer = seq_len * b * h * (34 + 5 * heads * seq_len / max(h, 1)) * width / 2
    trained_width = width if s.adapter.config.trains_backbone else 4
    trained_set = TrainedSet(tuple(tuple(shape) for shape in trained), trained_width, step_device(s),
                             largest_weight * width)
    trainable = trained_set.entries
    weights = (total - trainable) * width + trainable * trained_width
    cfg = s.optimizer.config if s.optimizer else None
    zeroth_order = cfg is not None and cfg.zeroth_order
    first_order = cfg is not None and not zeroth_order
    if first_order and s.train.gradient_checkpointing:
        activations = layers * seq_len * b * h * width + per_layer
    else:
        activations = per_layer * (layers if first_order else 2)
    if zeroth_order:
        activations *= cfg.activation_copies(width)
    if zeroth_order and cfg.batches_queries:
        if cfg.query_chunk == "auto":  # as many copies as fit in query_memory x the inference forward's memory
            activations += cfg.query_memory * (weights + activations)
        else:
            activations *= cfg.query_chunk  # one forward over up to query_chunk copies of the minibatch
    grads = trainable * trained_width if first_order else 0
    queries = s.schedule.config.max_queries if zeroth_order else 1
    return {
        "weights": weights, "activations": activations, "gradients": grads,
        "optimizer_state": cfg.state_bytes(trainable, trained_width) if cfg is not None else 0,
        "step_temporaries": cfg.step_bytes(trained_set, queries) if cfg is not None else 0,
    }


def memory_estimate(s: "Settings", total: int, trained: Sequence[Sequence[int]], seq_len: int = ESTIMATE_SEQ_LEN,
                    largest_weight: int = 0) -> dict[str, float]:
    """``memory_parts`` in GiB (rough, documented), with their total."""
    parts = memory_parts(s, total, trained, seq_len, largest_weight)
    out = {k: round(v / GIB, 3) for k, v in parts.items()}
    out["total"] = round(sum(parts.values()) / GIB, 3)
    return out


def step_device(s: "Settings") -> str:
    """The device type a run of ``s`` steps on here: ``model.device``, with ``auto`` a GPU when one is visible."""
    if s.model.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(s.model.device).type


def visible_gpus() -> list[float]:
    """Memory of each visible GPU in GiB (empty on a machine without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory / GIB for i in range(torch.cuda.device_count())]


def placement(est: dict[str, float], gpus: list[float], device_map: str | None, forward_only: bool,
              usable: float = 0.9, device: str = "auto") -> dict[str, Any]:
    """Where the run fits: one GPU, several through ``model.device_map`` (per-device estimate), or the CPU.

    With a device map the weights are split over the GPUs and each holds about its share plus the activations
    and ZO noise of the layers it runs (counted in full on every GPU: an upper bound). ``usable``: the share of a
    GPU's memory the estimate may take (the CUDA context, allocator slack and fragmentation take the rest).
    """
    total = est["total"]
    if not gpus and device.startswith("cuda"):
        return {"fits": "no", "advice": f"model.device={device!r} but no CUDA device is visible here: the run would "
                                        "stop; use model.device=auto or cpu"}
    if not gpus:
        return {"fits": "cpu", "advice": "no GPU visible: the run uses the CPU and host memory"}
    if total <= usable * gpus[0] and not device_map:
        return {"fits": "one_gpu", "advice": f"fits one GPU ({total:.1f} of {gpus[0]:.0f} GiB)"}
    if not forward_only:
        return {"fits": "no", "advice": f"needs {total:.1f} GiB, more than one GPU's {gpus[0]:.0f} GiB; a first-order "
                                       "method cannot use model.device_map: train an adapter or use a ZO method"}
    rest = total - est["weights"]
    for n in range(1, len(gpus) + 1):
        per_device = est["weights"] / n + rest
        if per_device <= usable * min(gpus[:n]):
            hint = "" if device_map else "; set model.device_map=auto"
            return {"fits": f"{n}_gpus", "per_device_gib": round(per_device, 3),
                    "advice": f"needs model.device_map: about {per_device:.1f} GiB on each of {n} GPU(s){hint}"}
    per_device = est["weights"] / len(gpus) + rest
    return {"fits": "offload", "per_device_gib": round(per_device, 3),
            "advice": f"more than the {len(gpus)} visible GPU(s) hold ({sum(gpus):.0f} GiB): with model.device_map=auto "
                      "accelerate offloads the rest to the CPU (slow)"}


def trained_shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shape of every trainable tensor of ``model``."""
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def largest_weight(model: torch.nn.Module) -> int:
    """Entries of the largest tensor of ``model``, trained or frozen."""
    return max((p.numel() for p in model.parameters()), default=0)


def dry_run(s: "Settings") -> dict[str, Any]:
    """Count and estimate the run ``s`` on the meta device: the trainable parameters and the adapter modules as
    the adapter's config declares them (``count_trainable``, ``count_modules``: every adapter kind alike), the
    total from the adapted model, and the memory estimate and placement; printed, and returned as a record."""
    backbone = build_meta_model(s.model)
    trainable = s.adapter.config.count_trainable(backbone)  # from the bare backbone's shapes, before attaching
    model = attach_adapter(s, backbone)  # the adapter attaches as in a run
    total, _ = count_parameters(model)
    record = {
        "model": s.model.name,
        "method": s.method,
        "total_params": total,
        "trainable_params": trainable,
        "adapters": s.adapter.config.count_modules(model),
        "memory_estimate_gib": memory_estimate(s, total, trained_shapes(model), largest_weight=largest_weight(model)),
        "estimate_assumes": f"batch {s.train.batch_size} x {ESTIMATE_SEQ_LEN} tokens, {s.model.dtype} backbone",
    }
    print(f"model            {s.model.name} ({s.model.family}, {s.model.dtype})")
    print("architecture     " + ", ".join(f"{k} {v}" for k, v in architecture_summary(s.model).items()))
    print(f"method           {s.method} (adapter: {s.adapter.kind}, optimizer: {s.optimizer.kind if s.optimizer else None})")
    print(f"total params     {total:,}")
    print(f"trainable params {trainable:,}")
    print(f"adapters         {record['adapters']}")
    est = record["memory_estimate_gib"]
    forward_only = s.optimizer is None or s.optimizer.config.zeroth_order
    record["placement"] = placement(est, visible_gpus(), s.model.device_map, forward_only, device=s.model.device)
    print(
        "memory estimate  "
        + ", ".join(f"{k} {v:.2f} GiB" for k, v in est.items())
        + f"  ({record['estimate_assumes']})"
    )
    print(f"placement        {record['placement']['advice']}")
    return record
