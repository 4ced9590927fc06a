"""How the frozen backbone computes: its dtype, the adapters' compute dtype, compilation and int8 weights.

Each is a key of the model config (``model.dtype``, ``model.adapter_dtype``, ``model.compile``,
``model.quantize``) and composes with every method, adapter and optimizer, except where it cannot apply:
int8 weights are frozen copies, so a method that trains the backbone's weights (full fine-tuning, MeZO,
Sparse-MeZO) is refused; compilation needs a platform that ``torch.compile`` supports and, for inductor on a CPU,
a C++ compiler. :func:`check` refuses before anything loads; :func:`apply_` changes the model after the adapter
is attached, so that the adapter's trainable set is what it was and only the frozen weights change.

Which option is fastest depends on the machine: bf16 is fast on CPUs with AMX or AVX512-BF16 and emulated
(slower than fp32) on the others. :func:`cpu_line` says which at start-up; ``python -m adazeta.tools.bench
--options`` measures every option side by side on the machine it runs on.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adazeta.errors import ConfigError

ADAPTER_DTYPES = ("fp32", "backbone")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
QUANTIZATIONS = ("int8", "bf16")
BF16_FEATURES = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs with fast bf16 matrix products


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``); empty where that file does not exist."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def fast_bf16(flags: set[str]) -> bool:
    """Whether the CPU multiplies bf16 matrices in hardware (AMX or AVX512-BF16); else bf16 is emulated."""
    return any(f in flags for f in BF16_FEATURES)


def cpu_line(dtype: str, flags: set[str] | None = None) -> str:
    """The start-up line on a CPU: its bf16 features and what they mean for ``model.dtype``."""
    flags = cpu_flags() if flags is None else flags
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in BF16_FEATURES)
    if fast_bf16(flags):
        advice = "bf16 matrix products run in hardware: model.dtype=bf16 may be faster (measure: bench --options)"
    else:
        advice = "bf16 is emulated here, likely slower than fp32"
        advice += "; model.dtype=fp32 is the right choice" if dtype == "fp32" else f"; model.dtype={dtype} was asked for"
    return f"CPU bf16 features: {have}: {advice}"


def check(model_cfg: Any, trains_backbone: bool, method: str) -> None:
    """Refuse, in one line and before anything loads, an option that cannot apply to this method or platform."""
    if model_cfg.quantize and trains_backbone:
        raise ConfigError(f"model.quantize={model_cfg.quantize} freezes the backbone's weights as "
                          f"{model_cfg.quantize} copies, but "
                          f"method {method!r} trains them; use an adapter method (adazeta, mezo_lora, ...) or "
                          "model.quantize=null")
    if model_cfg.compile:
        if not torch._dynamo.is_dynamo_supported():
            raise ConfigError(f"model.compile={model_cfg.compile}: torch.compile is not supported on this platform "
                              "(Python or torch build); set model.compile=null")
        if model_cfg.device_map:
            raise ConfigError(f"model.compile={model_cfg.compile} with model.device_map={model_cfg.device_map}: "
                              "accelerate's hooks move tensors between devices inside the forward, which the "
                              "compiled graph cannot; unset one of them")
        if model_cfg.compile == "inductor" and on_cpu(model_cfg.device) and not cxx_compiler():
            raise ConfigError("model.compile=inductor on a CPU needs a C++ compiler (g++, c++ or clang++ on PATH, "
                              "or $CXX); install one, or set model.compile=aot_eager or null")


def on_cpu(device: str) -> bool:
    """Whether ``model.device`` puts the model on the CPU (auto does where no CUDA device is visible)."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use for CPU kernels, if one is on PATH."""
    return next((p for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and (p := shutil.which(c))), None)


class Int8Linear(nn.Module):
    """A frozen linear layer with int8 weights, one fp32 scale per output row (symmetric, absmax / 127).

    The weights are dequantised to the input's dtype at each call and multiplied densely: a quarter of the
    fp32 weights' memory, the dense product's speed less the dequantisation, and gradients to the input (the
    adapters before it train by backpropagation too). The weights are buffers, not parameters: nothing trains them.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @property
    def weight(self) -> Tensor:
        """The dequantised weight (model code reads ``layer.weight``, e.g. its dtype), in the bias's dtype."""
        dtype = self.bias.dtype if self.bias is not None else torch.float32
        return (self.qweight.to(dtype) * self.scale[:, None].to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        weight = self.qweight.to(x.dtype) * self.scale[:, None].to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Bf16Linear(nn.Module):
    """A frozen linear layer with bf16 weights whose product runs in bf16 on activations of any dtype.

    The input is rounded to bf16 for the product alone and the output returned in the input's dtype, so that on
    an fp32 backbone everything between the linear layers (the residual stream, the norms, attention's softmax and
    the adapters) stays fp32: half the frozen weights' memory, the products at the bf16 rate of a CPU with AMX or
    AVX512-BF16 (or a GPU), and, unlike ``model.dtype=bf16``, no rounding of the residual stream, where a ZO
    perturbation's small change to the activations would otherwise fall below bf16's resolution. Gradients reach
    the input (adapters before it train by backpropagation too). The weights are buffers: nothing trains them.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("bweight", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(torch.bfloat16))

    @property
    def weight(self) -> Tensor:
        """The bf16 weight (model code reads ``layer.weight``, e.g. its device)."""
        return self.bweight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.to(torch.bfloat16), self.bweight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16"


QUANTIZED = {"int8": Int8Linear, "bf16": Bf16Linear}


def quantize_frozen_(model: nn.Module, kind: str = "int8") -> int:
    """Replace every ``nn.Linear`` whose weight is frozen with its ``kind`` copy (:data:`QUANTIZED`); returns how
    many.

    Trainable linears (a LoRA matrix, a bottleneck adapter, a trained head) keep their weights.
    """
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and not child.weight.requires_grad]
    for parent, name, child in targets:
        setattr(parent, name, QUANTIZED[kind](child))
    return len(targets)


def autocast_forward(forward: Callable[..., Any], device: str, dtype: torch.dtype) -> Callable[..., Any]:
    """``forward`` under ``torch.autocast``: the fp32 adapters inside it multiply in ``dtype``, their weights
    (and a ZO perturbation of them) stay fp32."""

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device, dtype=dtype):
            return forward(*args, **kwargs)

    return wrapped


def apply_(model: nn.Module, model_cfg: Any, backbone: nn.Module) -> dict[str, Any]:
    """Quantise, autocast and compile the backbone of ``model`` (the adapter attached) as ``model_cfg`` asks.

    Returns what was done, for the log. The decoder (encoder for a masked model), which the scorer calls, is
    the unit autocast and compile wrap in place: parameter names and the trainable set do not change.
    """
    done: dict[str, Any] = {}
    if model_cfg.quantize:
        done["quantized_linears"] = quantize_frozen_(model, model_cfg.quantize)
    dtype = model_cfg.torch_dtype
    if model_cfg.adapter_dtype == "backbone" and dtype != torch.float32:
        device = next(backbone.parameters()).device.type
        backbone.forward = autocast_forward(backbone.forward, device, dtype)
        done["adapter_dtype"] = model_cfg.dtype
    if model_cfg.compile:
        backbone.compile(backend=model_cfg.compile)
        done["compile"] = model_cfg.compile
    return done
