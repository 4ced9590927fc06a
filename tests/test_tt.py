"""Tensor-train helpers and AdaZeta's TT adapters: shapes, contraction, init, placement and parameter counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorly as tl
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    RobertaConfig,
    RobertaForMaskedLM,
)

from adazeta.adapters import ADAPTERS
from adazeta.adapters.tt import (
    AdaptedLinear,
    TTAdapter,
    TTAdapterConfig,
    TTFactorGroup,
    TTLinear,
    add_tt_adapters,
    count_adapters,
    group_tt_layers,
)
from adazeta.errors import ConfigError
from adazeta.tensor.tt import (
    contract_cores,
    default_shape,
    factorize,
    init_cores,
    split_index,
    tt_factors,
    tt_matmul,
    tt_num_params,
    tt_ranks,
)

LLAMA_DOWN, LLAMA_UP = [16, 16, 16, 4, 4, 4], [4, 4, 4, 16, 16, 16]
ROBERTA_SHAPE = [8, 8, 16, 8, 8]


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def is_adapter_param(name: str) -> bool:
    return ".adapter.down." in name or ".adapter.up." in name


# ---------------------------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    "n, expected",
    [(576, [8, 8, 9]), (64, [4, 4, 4]), (4096, [16, 16, 16]), (1024, [8, 8, 16]), (7, [1, 1, 7]), (1, [1, 1, 1])],
)
def test_factorize_table(n, expected):
    assert factorize(n) == expected


def test_factorize_other_counts_and_bad_input():
    assert factorize(4096, 2) == [64, 64]
    assert math.prod(factorize(11008, 4)) == 11008
    with pytest.raises(ValueError):
        factorize(0)


def test_default_shape_and_split():
    assert default_shape(4096, 64) == LLAMA_DOWN
    assert default_shape(64, 4096) == LLAMA_UP
    assert default_shape(576, 64) == [8, 8, 9, 4, 4, 4]
    assert split_index(LLAMA_DOWN, 4096) == 3
    assert split_index(ROBERTA_SHAPE, 64) == 2
    with pytest.raises(ValueError, match="in_features=100"):
        split_index(LLAMA_DOWN, 100)


def test_tt_ranks_and_num_params():
    assert tt_ranks(4, 5) == [1, 5, 5, 5, 1]
    assert tt_num_params(LLAMA_DOWN, 5) == 1100  # 80 + 400 + 400 + 100 + 100 + 20
    assert tt_num_params(LLAMA_UP, 5) == 1100
    assert tt_num_params(ROBERTA_SHAPE, 5) == 880
    assert tt_num_params([3, 4], 1) == 7


@pytest.mark.parametrize(
    "shape, n_in, n_out, rank",
    [
        ([2, 3, 4], 6, 4, 3),
        ([2, 3, 4, 5], 2, 60, 2),
        ([8, 8, 9, 4, 4, 4], 576, 64, 5),
        ([4, 4, 4, 8, 8, 9], 64, 576, 5),
        (LLAMA_DOWN, 4096, 64, 5),
        (LLAMA_UP, 64, 4096, 5),
        (ROBERTA_SHAPE, 1024, 64, 5),
        (ROBERTA_SHAPE, 64, 1024, 5),
    ],
)
def test_tt_matmul_matches_tensorly_reconstruction(shape, n_in, n_out, rank):
    g = torch.Generator().manual_seed(0)
    cores = init_cores(shape, rank, n_in, n_out, generator=g)
    x = torch.randn(3, 2, n_in, generator=g)
    # Reference: tensorly's dense reconstruction (numpy backend, float64), reshaped row-major to (in, out).
    with tl.backend_context("numpy"):  # independent of any backend another test may have set globally
        dense = tl.tt_to_tensor([c.double().numpy() for c in cores]).reshape(n_in, n_out)
    expected = x.double().numpy() @ dense
    got = tt_matmul(x, cores, split_index(shape, n_in))
    assert got.shape == (3, 2, n_out)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-5 * scale, rtol=1e-5)
    np.testing.assert_allclose(contract_cores(cores[: split_index(shape, n_in)]).shape, (n_in, rank))


def test_init_std_matches_target():
    """Entries of the reconstructed matrix have std s = sqrt(1/(in+out)) on average over draws."""
    g = torch.Generator().manual_seed(0)
    n_in, n_out, shape = 576, 64, [8, 8, 9, 4, 4, 4]
    second_moments = [
        contract_cores(init_cores(shape, 5, n_in, n_out, generator=g)).pow(2).mean() for _ in range(100)
    ]
    std = torch.stack(second_moments).mean().sqrt().item()
    assert std == pytest.approx(math.sqrt(1 / (n_in + n_out)), rel=0.15)


def test_init_cores_are_seeded_and_meta_safe():
    a = init_cores([4, 4, 4], 3, 4, 16, generator=torch.Generator().manual_seed(1))
    b = init_cores([4, 4, 4], 3, 4, 16, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with torch.device("meta"):
        meta = init_cores([4, 4, 4], 3, 4, 16, generator=torch.Generator().manual_seed(1))
    assert all(c.is_meta for c in meta) and [tuple(c.shape) for c in meta] == [(1, 4, 3), (3, 4, 3), (3, 4, 1)]


# ---------------------------------------------------------------------------------------------- modules


def test_ttlinear_equals_dense_product_plus_bias():
    layer = TTLinear(12, 8, [3, 4, 2, 4], rank=3, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 12)
    dense = contract_cores(list(layer.cores)).reshape(12, 8)
    torch.testing.assert_close(layer(x), x @ dense + layer.bias)
    assert layer.bias.abs().max() <= 1 / math.sqrt(8)


def test_adapter_is_not_identity_at_init():
    adapter = TTAdapter(16, 4, [4, 4, 2, 2], [2, 2, 4, 4], rank=3, generator=torch.Generator().manual_seed(0))
    h = torch.randn(2, 3, 16)
    assert not torch.allclose(adapter(h), h)


def test_adapter_bf16_in_bf16_out_with_fp32_params():
    adapter = TTAdapter(16, 4, [4, 4, 2, 2], [2, 2, 4, 4], rank=3, generator=torch.Generator().manual_seed(0))
    h = torch.randn(2, 3, 16)
    out = adapter(h.bfloat16())
    assert out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in adapter.parameters())
    torch.testing.assert_close(out.float(), adapter(h.bfloat16().float()), atol=0, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_forward_without_module_calls_is_the_module_formula(dtype):
    """The adapter runs its layers' products directly, residual added in place: the numbers of
    ``h + up(act(down(h)))`` through the modules, bit for bit, with and without autograd; a layer whose forward is
    replaced (weight replicas) or hooked still runs through its module call."""
    adapter = TTAdapter(16, 4, [4, 4, 2, 2], [2, 2, 4, 4], rank=3, activation="gelu",
                        generator=torch.Generator().manual_seed(0))
    h = torch.randn(2, 3, 16).to(dtype)

    def formula():
        x = h.float()
        return (x + adapter.up(adapter.act(adapter.down(x)))).to(h.dtype)

    with torch.no_grad():
        assert torch.equal(adapter(h), formula())
    out = adapter(h)
    assert torch.equal(out, formula())
    out.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in adapter.parameters()]
    adapter.zero_grad()
    formula().float().pow(2).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, adapter.parameters()))

    calls = []
    adapter.up.forward = lambda x: calls.append("replaced") or adapter.up.product(x)
    adapter(h)
    del adapter.up.forward
    handle = adapter.down.register_forward_hook(lambda *_: calls.append("hooked"))
    adapter(h)
    handle.remove()
    adapter(h)
    assert calls == ["replaced", "hooked"]


def test_adapted_linear_positions():
    base = torch.nn.Linear(8, 4)
    for position, features in (("input", 8), ("output", 4)):
        adapter = TTAdapter(features, 2, default_shape(features, 2), default_shape(2, features), rank=2)
        wrapped = AdaptedLinear(base, adapter, position)
        x = torch.randn(3, 8)
        expected = base(adapter(x)) if position == "input" else adapter(base(x))
        torch.testing.assert_close(wrapped(x), expected)
        assert wrapped.weight is base.weight


# ---------------------------------------------------------------------------------------------- config


def test_config_defaults_and_registry():
    cfg = TTAdapterConfig()
    assert (cfg.bottleneck, cfg.rank, cfg.placement, cfg.activation) == (64, 5, "official", "relu")
    assert ADAPTERS.get("tt").config_cls is TTAdapterConfig
    assert ADAPTERS.config("tt", {"rank": 3}).rank == 3


@pytest.mark.parametrize(
    "values, field",
    [
        ({"bottleneck": 0}, "adapter.bottleneck"),
        ({"rank": 0}, "adapter.rank"),
        ({"placement": "everywhere"}, "adapter.placement"),
        ({"activation": "swish2"}, "adapter.activation"),
        ({"shape_down": [16, 16, 16, 4, 4, 3]}, "adapter.shape_down"),  # product not a multiple of 64
        ({"shape_down": [16, 16, 8, 4, 4, 8]}, "adapter.shape_down"),  # no suffix multiplying to 64
        ({"shape_up": [16, 16, 16, 4, 4, 4]}, "adapter.shape_up"),  # no prefix multiplying to 64
        ({"targets": [{"pattern": "fc1", "position": "middle"}]}, "adapter.targets[0].position"),
        ({"targets": [{"pattern": "(", "position": "input"}]}, "adapter.targets[0].pattern"),
    ],
)
def test_config_validation_names_the_field(values, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        TTAdapterConfig(**values)


def test_check_hidden_reports_the_expected_product():
    cfg = TTAdapterConfig(shape_down=LLAMA_DOWN, shape_up=LLAMA_UP)
    cfg.check_hidden(4096)
    with pytest.raises(ConfigError, match=r"adapter\.shape_down=.*product 262144.*576\*64 = 36864"):
        cfg.check_hidden(576)


# ---------------------------------------------------------------------------------------------- placement


def _meta_llama_7b():
    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_llama2_7b_reference_count():
    model = add_tt_adapters(_meta_llama_7b(), TTAdapterConfig(shape_down=LLAMA_DOWN, shape_up=LLAMA_UP))
    assert count_adapters(model) == 96
    adapter = model.model.layers[0].mlp.down_proj.adapter
    assert sum(p.numel() for p in adapter.parameters()) == 6360
    params = trainable(model)
    assert sum(p.numel() for p in params.values()) == 610_560
    assert all(is_adapter_param(name) and p.dtype == torch.float32 and p.is_meta for name, p in params.items())
    # The derived shapes for H = 4096, b = 64 are the reference ones.
    assert adapter.down.shape == LLAMA_DOWN and adapter.up.shape == LLAMA_UP


def test_llama2_7b_paper_placement():
    model = add_tt_adapters(_meta_llama_7b(), TTAdapterConfig(placement="paper"))
    assert count_adapters(model) == 64
    layer = model.model.layers[3]
    assert isinstance(layer.self_attn.o_proj, AdaptedLinear) and layer.self_attn.o_proj.position == "output"
    assert not isinstance(layer.mlp.gate_proj, AdaptedLinear)


def test_roberta_large_reference_count(reference_targets):
    cfg = RobertaConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    with torch.device("meta"):
        model = RobertaForMaskedLM(cfg)
    targets = reference_targets("roberta")
    model = add_tt_adapters(model, TTAdapterConfig(shape_down=ROBERTA_SHAPE, shape_up=ROBERTA_SHAPE, targets=targets))
    assert count_adapters(model) == 48
    assert sum(p.numel() for p in model.roberta.encoder.layer[0].output.dense.adapter.parameters()) == 2848
    assert sum(p.numel() for p in trainable(model).values()) == 136_704
    # One adapter after the attention-output dense, one after the FFN-output dense; none on the intermediate.
    layer = model.roberta.encoder.layer[5]
    assert isinstance(layer.attention.output.dense, AdaptedLinear)
    assert isinstance(layer.output.dense, AdaptedLinear)
    assert not isinstance(layer.intermediate.dense, AdaptedLinear)
    assert not isinstance(model.lm_head.dense, AdaptedLinear)


def test_smollm2_shapes_count():
    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model = add_tt_adapters(model, TTAdapterConfig())
    assert count_adapters(model) == 90
    assert model.model.layers[0].mlp.gate_proj.adapter.down.shape == [8, 8, 9, 4, 4, 4]
    assert sum(p.numel() for p in trainable(model).values()) == 179_100


def test_explicit_shape_mismatching_the_model_fails():
    with pytest.raises(ConfigError, match=r"adapter\.shape_down"):
        add_tt_adapters(_meta_llama_7b(), TTAdapterConfig(shape_down=[8, 8, 9, 4, 4, 4]))


# ---------------------------------------------------------------------------------------------- tiny real models


def _tiny_llama(intermediate_size: int = 64):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return AutoModelForCausalLM.from_config(cfg)


def test_tiny_llama_forward_and_only_adapters_train():
    model = _tiny_llama()
    ids = torch.randint(0, 100, (2, 7))
    before = model(ids).logits
    model = add_tt_adapters(model, TTAdapterConfig(bottleneck=8, rank=3), generator=torch.Generator().manual_seed(0))
    assert count_adapters(model) == 6
    params = trainable(model)
    assert params and all(is_adapter_param(name) for name in params)
    frozen = dict(model.named_parameters())
    assert not frozen["lm_head.weight"].requires_grad
    assert not frozen["model.norm.weight"].requires_grad
    assert not frozen["model.layers.0.input_layernorm.weight"].requires_grad
    logits = model(ids).logits
    assert logits.shape == (2, 7, 100) and torch.isfinite(logits).all()
    assert not torch.allclose(logits, before)  # the adapters act at init


def test_tiny_llama_bf16_backbone_keeps_fp32_adapters():
    model = _tiny_llama().to(torch.bfloat16)
    model = add_tt_adapters(model, TTAdapterConfig(bottleneck=8, rank=3))
    assert all(p.dtype == torch.float32 for p in trainable(model).values())
    logits = model(torch.randint(0, 100, (1, 5))).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_tiny_roberta_forward_and_frozen_head():
    torch.manual_seed(0)
    cfg = RobertaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=100
    )
    model = add_tt_adapters(RobertaForMaskedLM(cfg), TTAdapterConfig(bottleneck=8, rank=3))
    assert count_adapters(model) == 4
    params = trainable(model)
    assert params and all(is_adapter_param(name) for name in params)
    assert not any("LayerNorm" in name or name.startswith("lm_head") for name in params)
    logits = model(torch.randint(3, 100, (2, 6))).logits
    assert logits.shape == (2, 6, 100) and torch.isfinite(logits).all()


def test_tiny_gpt2_conv1d_gets_adapters(reference_targets):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0)
    )
    model = add_tt_adapters(model, TTAdapterConfig(bottleneck=8, rank=3, targets=reference_targets("gpt2")))
    assert count_adapters(model) == 4
    assert isinstance(model.transformer.h[0].attn.c_proj, AdaptedLinear)
    assert model.transformer.h[0].mlp.c_proj.adapter.up.out_features == 32  # Conv1D: nf = out features
    assert all(is_adapter_param(name) for name in trainable(model))
    assert torch.isfinite(model(torch.randint(0, 100, (2, 5))).logits).all()


def test_tiny_opt_gets_adapters():
    torch.manual_seed(0)
    cfg = OPTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=100, word_embed_proj_dim=32
    )
    model = add_tt_adapters(AutoModelForCausalLM.from_config(cfg), TTAdapterConfig(bottleneck=8, rank=3))
    assert count_adapters(model) == 4
    assert model.model.decoder.layers[1].fc1.position == "input"
    assert model.model.decoder.layers[1].fc2.position == "output"
    assert all(is_adapter_param(name) for name in trainable(model))
    assert torch.isfinite(model(torch.randint(2, 100, (2, 5))).logits).all()


def test_unknown_architecture_gets_the_mlp_sites_or_needs_targets():
    model = _tiny_llama()
    model.config.model_type = "mystery"
    found = add_tt_adapters(model, TTAdapterConfig(bottleneck=8, rank=3))  # the MLP, from its shapes
    assert {n for n, m in found.named_modules() if isinstance(m, AdaptedLinear)} == {
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    model = _tiny_llama(intermediate_size=32)  # an MLP as wide as the residual stream: shapes cannot tell it apart
    model.config.model_type = "mystery"
    with pytest.raises(ConfigError, match=r"adapter\.targets"):
        add_tt_adapters(model, TTAdapterConfig())
    targets = [{"pattern": r"mlp\.down_proj$", "position": "output"}]
    model = add_tt_adapters(model, TTAdapterConfig(bottleneck=8, rank=3, targets=targets))
    assert count_adapters(model) == 2


def test_target_matching_nothing_fails():
    targets = [{"pattern": r"no_such_layer$", "position": "output"}]
    with pytest.raises(ConfigError, match="no_such_layer"):
        add_tt_adapters(_tiny_llama(), TTAdapterConfig(targets=targets))


# ------------------------------------------------------------------------------------- grouped TT factors


def _adapted_tiny_llama():
    model = add_tt_adapters(_tiny_llama(), TTAdapterConfig(bottleneck=8, rank=3),
                            generator=torch.Generator().manual_seed(0))
    return model, [m for m in model.modules() if isinstance(m, TTLinear)]


def test_layers_of_one_shape_share_a_group_whose_factors_equal_their_own():
    model, layers = _adapted_tiny_llama()
    groups = {id(layer._group[0]) for layer in layers}
    assert len(groups) == 2  # every adapter of the tiny Llama is on a 32-wide site: one down and one up group
    with torch.no_grad():
        for layer in layers:
            a, b = tt_factors(list(layer.cores), layer.split)
            a_t, b_t = layer.factors()  # from the group's batched contraction
            assert a_t.is_contiguous() and b_t.is_contiguous()
            # Batched products may round otherwise than single ones (bit for bit on SmolLM2's shapes on our CPUs)
            torch.testing.assert_close(a_t, a.t(), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(b_t, b.t(), atol=1e-6, rtol=1e-6)


def test_grouped_forward_equals_the_reference_product_and_the_autograd_path():
    model, layers = _adapted_tiny_llama()
    x = torch.randn(2, 7, layers[0].in_features)
    layer = layers[0]
    reference = tt_matmul(x, list(layer.cores), layer.split) + layer.bias  # the formula, as before grouping
    with torch.no_grad():
        grouped = layer(x)
    with_grad = layer(x)  # autograd: the layer's own contraction
    torch.testing.assert_close(grouped, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grouped, with_grad, atol=1e-6, rtol=1e-6)
    with_grad.sum().backward()
    assert all(core.grad is not None and core.grad.abs().sum() > 0 for core in layer.cores)
    ids = torch.randint(0, 100, (2, 7))
    with torch.inference_mode():
        grouped_logits = model(ids).logits
    torch.testing.assert_close(grouped_logits, model(ids).logits.detach(), atol=1e-6, rtol=1e-6)


def test_group_factors_follow_every_change_of_a_core():
    model, layers = _adapted_tiny_llama()
    x = torch.randn(3, layers[1].in_features)

    def check():
        with torch.no_grad():
            got = layers[1](x)
            a, b = tt_factors(list(layers[1].cores), layers[1].split)
            torch.testing.assert_close(layers[1].factors()[0], a.t(), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got, x @ a @ b + layers[1].bias, atol=1e-6, rtol=1e-6)

    check()
    with torch.no_grad():
        layers[1].cores[2].add_(1.0)  # an in-place step (ZO perturbation, optimizer)
    check()
    state = {k: v + 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # copies into the parameters
    check()
    with torch.inference_mode():  # factors drawn in inference mode serve later no_grad forwards
        layers[1](x)
    with torch.no_grad():
        layers[1].cores[0].mul_(2.0)
    check()
    model.double()  # new storage
    x = x.double()
    check()
    layer = layers[1]
    swapped = {name: p * 2 for name, p in layer.named_parameters()}
    with torch.no_grad():  # parameters swapped in for one call
        got = torch.func.functional_call(layer, swapped, (x,))
        cores = [swapped[f"cores.{i}"] for i in range(len(layer.cores))]
        expected = tt_matmul(x, cores, layer.split) + swapped["bias"]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    check()  # and its own again after


def test_a_copied_model_has_groups_of_its_own():
    import copy

    model, layers = _adapted_tiny_llama()
    twin = copy.deepcopy(model)
    twin_layers = [m for m in twin.modules() if isinstance(m, TTLinear)]
    assert twin_layers[0]._group[0] is not layers[0]._group[0]
    assert twin_layers[0]._group[0].layers[0] is twin_layers[0]
    with torch.no_grad():
        twin_layers[0].cores[0].add_(1.0)
        assert not torch.equal(twin_layers[0].factors()[0], layers[0].factors()[0])


def test_a_lone_layer_contracts_its_own_cores():
    layer = TTLinear(12, 8, [3, 4, 2, 4], rank=2, generator=torch.Generator().manual_seed(0))
    assert layer._group is None and group_tt_layers(torch.nn.ModuleList([layer])) == 0
    a, b = tt_factors(list(layer.cores), layer.split)
    with torch.no_grad():
        assert torch.equal(layer.factors()[0], a.t())  # its own contraction: the same products
    assert isinstance(_adapted_tiny_llama()[1][0]._group[0], TTFactorGroup)


def _unfolded(adapter: TTAdapter, h: torch.Tensor) -> torch.Tensor:
    """The adapter's formula through its layers' plain products (bias added by the product, residual after)."""
    x = h.float()
    return adapter.up.product(adapter.act(adapter.down.product(x))).add_(x).to(h.dtype)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_forward_equals_the_unfolded_products(activation, dtype):
    """Without autograd a grouped adapter runs its layers' folded factors (biases inside the products, the
    residual inside the last): the numbers of the unfolded products, on SmolLM2's shapes and a small one."""
    for features, bottleneck, down, up in [(576, 64, [8, 8, 9, 4, 4, 4], [4, 4, 4, 8, 8, 9]),
                                           (16, 4, [4, 4, 2, 2], [2, 2, 4, 4])]:
        adapters = torch.nn.ModuleList(TTAdapter(features, bottleneck, down, up, rank=5, activation=activation,
                                                 generator=torch.Generator().manual_seed(i)) for i in range(3))
        assert group_tt_layers(adapters) == 2
        h = torch.randn(2, 7, features).to(dtype)
        for adapter in adapters:
            with torch.no_grad():
                folded = adapter(h)
                unfolded = _unfolded(adapter, h)
            assert folded.dtype == dtype and folded.shape == h.shape
            torch.testing.assert_close(folded.float(), unfolded.float(), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(folded.float(), adapter(h).detach().float(), atol=1e-6, rtol=1e-6)  # autograd


def test_folded_factors_hold_the_factors_and_follow_the_bias():
    model, layers = _adapted_tiny_llama()
    layer = layers[1]
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        a1, e, b1 = layer.folded()
        a_t, b_t = layer.factors()
        assert torch.equal(a1[:-1], a_t) and not a1[-1].any() and torch.equal(e, torch.eye(len(e))[-1])
        assert torch.equal(b1[:, :-1], b_t) and torch.equal(b1[:, -1], layer.bias)
        torch.testing.assert_close(F.linear(F.linear(x, a1, e), b1), layer.product(x), atol=1e-6, rtol=1e-6)
        layer.bias.add_(1.0)  # a bias changed alone (a ZO perturbation of the bias, an optimizer step)
        assert torch.equal(layer.folded()[2][:, -1], layer.bias)
        layer.cores[0].mul_(2.0)
        assert torch.equal(layer.folded()[0][:-1], layer.factors()[0])
        ids = torch.randint(0, 100, (2, 5))
        grouped = model(ids).logits
    torch.testing.assert_close(grouped, model(ids).logits.detach(), atol=1e-5, rtol=1e-5)  # autograd: own products
    assert TTLinear(12, 8, [3, 4, 2, 4], rank=2).folded() is None  # a lone layer has no group to fold in


def test_adapted_linear_calls_a_hooked_adapter_as_a_module():
    model, _ = _adapted_tiny_llama()
    site = next(m for m in model.modules() if isinstance(m, AdaptedLinear))
    x = torch.randn(2, site.in_features)
    calls = []
    handle = site.adapter.register_forward_hook(lambda *_: calls.append("hook"))
    with torch.no_grad():
        hooked = site(x)
    handle.remove()
    with torch.no_grad():
        plain = site(x)
    assert calls == ["hook"] and torch.equal(hooked, plain)


def test_unfolded_runs_the_unfolded_products_and_restores_folding(monkeypatch):
    from adazeta.adapters import tt

    adapters = torch.nn.ModuleList(TTAdapter(16, 4, [4, 4, 2, 2], [2, 2, 4, 4], rank=3,
                                             generator=torch.Generator().manual_seed(i)) for i in range(2))
    group_tt_layers(adapters)
    h = torch.randn(3, 16)
    folded = []
    monkeypatch.setattr(TTAdapter, "_folded_forward", lambda self, x: folded.append(1) or _unfolded(self, x))
    with torch.no_grad():
        adapters[0](h)
        with tt.unfolded():
            off = adapters[0](h)
        assert torch.equal(off, _unfolded(adapters[0], h))
        adapters[0](h)
    assert folded == [1, 1]  # the calls outside unfolded() took the folded path, the one inside did not
