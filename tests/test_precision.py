"""The backbone's speed options (model.dtype, adapter_dtype, compile, quantize): each composes with the adapter
methods and does what it says; the start-up line names the CPU's bf16 features."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adazeta.build import build, compose_settings, seed_everything
from adazeta.precision import Bf16Linear, Int8Linear, cpu_line, quantize_frozen_
from helpers import tiny_overrides


def built_loss(data_dir, *extra: str) -> tuple[float, object]:
    """The loss of the first 4 training examples on tiny-llama, wired by ``build`` with ``extra`` overrides."""
    s = compose_settings(tiny_overrides(data_dir, *extra))
    seed_everything(s.seed)
    b = build(s)
    with torch.no_grad():
        return float(b.scorer.loss(b.scorer.collate(b.enc["train"][:4]))), b


def test_int8_linear_is_close_to_the_dense_layer_and_passes_gradients_to_its_input():
    torch.manual_seed(0)
    dense = nn.Linear(48, 32)
    q = Int8Linear(dense)
    x = torch.randn(3, 5, 48, requires_grad=True)
    y = q(x)
    ref = dense(x)
    assert q.qweight.dtype == torch.int8 and not list(q.parameters())
    assert ((y - ref).norm() / ref.norm()) < 0.02
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_bf16_linear_multiplies_in_bf16_and_returns_the_inputs_dtype():
    torch.manual_seed(0)
    dense = nn.Linear(48, 32)
    q = Bf16Linear(dense)
    x = torch.randn(3, 5, 48, requires_grad=True)
    y = q(x)
    assert y.dtype == torch.float32 and q.bweight.dtype == torch.bfloat16 and not list(q.parameters())
    # exactly the bf16 product of the rounded input, cast back: the rounding is the input's and the output's alone
    expected = F.linear(x.detach().bfloat16(), dense.weight.detach().bfloat16(), dense.bias.detach().bfloat16())
    assert torch.equal(y.detach(), expected.float())
    ref = dense(x)
    assert 0 < ((y - ref).norm() / ref.norm()) < 0.02
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("kind, cls", [("int8", Int8Linear), ("bf16", Bf16Linear)])
def test_quantize_keeps_trainable_linears(kind, cls):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[0].requires_grad_(False)
    assert quantize_frozen_(model, kind) == 1
    assert isinstance(model[0], cls) and type(model[1]) is nn.Linear


@pytest.mark.parametrize("kind, cls", [("int8", Int8Linear), ("bf16", Bf16Linear)])
@pytest.mark.parametrize("method", ["adazeta", "mezo_lora", "tt_adapter"])
def test_quantized_backbone_keeps_the_trainable_set_and_nearly_the_loss(fixture_data, method, kind, cls):
    plain, b0 = built_loss(fixture_data, f"method={method}")
    quantized, b = built_loss(fixture_data, f"method={method}", f"model.quantize={kind}")
    assert any(isinstance(m, cls) for m in b.model.modules())
    assert not any(type(m) is nn.Linear and not m.weight.requires_grad for m in b.model.modules())
    assert [n for n, _ in b.named] == [n for n, _ in b0.named]
    assert all(p.dtype == torch.float32 for _, p in b.named)
    assert quantized != plain and abs(quantized - plain) < 0.05


def test_adapters_compute_in_the_backbones_dtype_only_when_asked(fixture_data):
    """On a bf16 backbone, adapter_dtype=backbone runs the TT adapters' products in bf16 (their weights stay fp32)."""
    fp32_adapters, _ = built_loss(fixture_data, "model.dtype=bf16")
    native, b = built_loss(fixture_data, "model.dtype=bf16", "model.adapter_dtype=backbone")
    on_fp32, _ = built_loss(fixture_data, "model.adapter_dtype=backbone")
    plain, _ = built_loss(fixture_data)
    assert all(p.dtype == torch.float32 for _, p in b.named)
    assert native != fp32_adapters
    assert on_fp32 == plain  # an fp32 backbone: nothing to change


def test_compiled_backbone_gives_the_eager_loss(fixture_data):
    eager, _ = built_loss(fixture_data)
    compiled, b = built_loss(fixture_data, "model.compile=eager")
    assert compiled == pytest.approx(eager, abs=1e-5)


def test_the_start_up_line_names_the_bf16_features():
    slow = cpu_line("fp32", {"avx512f"})
    assert "amx_bf16 no, avx512_bf16 no" in slow and "emulated" in slow and "fp32 is the right choice" in slow
    fast = cpu_line("fp32", {"amx_bf16", "avx512_bf16"})
    assert "amx_bf16 yes, avx512_bf16 yes" in fast and "may be faster" in fast


def compiled_graphs(data_dir, forwards: int) -> int:
    """Graphs dynamo compiled for a compiled tiny-llama with TT adapters over ``forwards`` ZO-style forwards: the
    adapters' weights change in place between forwards of one batch, as a ZO step's perturbations do."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _, b = built_loss(data_dir, "method=adazeta", "model.compile=eager")
    batch = b.scorer.collate(b.enc["train"][:4])
    with torch.no_grad():
        for _ in range(forwards):
            for _, p in b.named:
                p.add_(0.01)
            b.scorer.loss(batch)
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_a_compiled_backbone_is_compiled_once_however_often_zo_steps_change_the_adapters(fixture_data):
    # The TT layers' shared factor cache is host-side state: traced, it was guarded per layer and recompiled for
    # each (dynamo's recompile limit then left most layers eager); a decoder's KV cache was guarded per layer too.
    graphs = compiled_graphs(fixture_data, 3)
    assert 1 <= graphs <= 2, graphs
    assert compiled_graphs(fixture_data, 6) == graphs


def test_a_scoring_forward_builds_no_kv_cache(fixture_data):
    from transformers.cache_utils import Cache

    _, b = built_loss(fixture_data)
    seen = []
    layer = b.scorer.parts()[0].layers[0]
    layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    with torch.no_grad():
        b.scorer.loss(b.scorer.collate(b.enc["train"][:4]))
    assert seen and not any(isinstance(v, Cache) for kw in seen for v in kw.values())
