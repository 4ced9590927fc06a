"""train.gradient_checkpointing: a first-order step that recomputes activations in backward takes the same update,
evaluation is unchanged, and methods without a backward pass (ZO, training-free) refuse it in one line."""

from __future__ import annotations

import argparse

import pytest
import torch

from adazeta.tools import bench_memory
from adazeta.dryrun import memory_estimate
from adazeta.errors import ConfigError
from adazeta.scoring.evaluate import evaluate
from adazeta.models import enable_gradient_checkpointing_, load_model
from adazeta.build import build, preflight, seed_everything
from adazeta.settings import parse
from adazeta.train import first_order_step
from helpers import compose_cfg, tiny_overrides, write_fixture_data


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fixture_data(tmp_path_factory.mktemp("data"))


def _built(data_dir, method: str, checkpointing: bool):
    s = parse(compose_cfg(tiny_overrides(data_dir, f"method={method}",
                                         f"train.gradient_checkpointing={str(checkpointing).lower()}")))
    preflight(s)
    seed_everything(s.seed)  # the same adapter init in both builds
    return build(s)


def _layer_starts(model: torch.nn.Module) -> list[int]:
    """Per decoder layer, how many times its computation has started (a checkpointed layer's recompute in backward
    starts it again). Counted at the layer's first module: the recompute stops early, once it has rebuilt what
    backward needs, so hooks after the layer's last needed operation never see it."""
    layers = [m for name, m in model.named_modules() if name.endswith("input_layernorm")]
    counts = [0] * len(layers)
    for i, norm in enumerate(layers):
        norm.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


@pytest.mark.parametrize("method", ["lora", "tt_adapter"])
def test_a_checkpointed_adamw_step_takes_the_same_update(method, data_dir):
    updated, grads = {}, {}
    for checkpointing in (False, True):
        b = _built(data_dir, method, checkpointing)
        starts = _layer_starts(b.model)
        first_order_step(b.scorer, b.optimizer, b.enc["train"][:4])
        # Checkpointed, each layer runs once in the forward and again in backward: the setting is on.
        assert starts == [2 if checkpointing else 1] * 2, starts
        grads[checkpointing] = {n: p.grad.clone() for n, p in b.named}
        updated[checkpointing] = {n: p.detach().clone() for n, p in b.named}
    # The gradients reach every adapter parameter through the frozen, checkpointed layers, and are the same.
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 0
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-6, atol=1e-8, msg=name)
        torch.testing.assert_close(updated[True][name], updated[False][name], rtol=1e-6, atol=1e-8, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[True].values())


def test_evaluation_runs_each_layer_once_and_scores_the_same(data_dir):
    results = {}
    for checkpointing in (False, True):
        b = _built(data_dir, "lora", checkpointing)
        starts = _layer_starts(b.model)
        b.model.train()  # as after a first-order step: evaluate() switches to eval mode, where nothing checkpoints
        results[checkpointing] = evaluate(b.scorer, b.scorer.batches(b.enc["dev"][:4], 4))
        assert starts == [1, 1], starts
    assert results[True].loss == pytest.approx(results[False].loss, rel=1e-6)


@pytest.mark.parametrize("method", ["mezo", "adazeta", "zero_shot"])
def test_a_method_without_backward_refuses_it(method, data_dir):
    s = parse(compose_cfg(tiny_overrides(data_dir, f"method={method}", "train.gradient_checkpointing=true")))
    with pytest.raises(ConfigError, match=rf"^train.gradient_checkpointing=true: method '{method}' takes no "
                                          "backward pass.*leave it false$"):
        preflight(s)


def test_a_model_without_checkpointing_support_is_refused_in_one_line():
    s = parse(compose_cfg(["model=tiny-llama", "method=lora"]))
    model = load_model(s.model).model
    model.supports_gradient_checkpointing = False
    with pytest.raises(ConfigError, match=r"^train.gradient_checkpointing=true: LlamaForCausalLM does not support "
                                          r"gradient checkpointing; set train.gradient_checkpointing=false$"):
        enable_gradient_checkpointing_(model)
    with pytest.raises(ConfigError, match="Linear does not support gradient checkpointing"):
        enable_gradient_checkpointing_(torch.nn.Linear(2, 2))


def test_the_dry_run_estimate_keeps_only_layer_inputs():
    def activations(*extra: str) -> float:
        s = parse(compose_cfg(["model=smollm2-135m", *extra]))
        return memory_estimate(s, 134_515_008, [(1_000_000,)])["activations"]

    kept, checkpointed = activations("method=lora"), activations("method=lora", "train.gradient_checkpointing=true")
    assert activations("method=zero_shot") < checkpointed < kept / 5


def test_memory_benchmark_rows_with_checkpointing(data_dir):
    assert {"lora_gc", "tt_adapter_gc"} <= set(bench_memory.METHODS)
    assert bench_memory.row_overrides("lora_gc") == ["method=lora", "train.gradient_checkpointing=true"]
    args = argparse.Namespace(model="tiny-llama", task="rte", batch_size=4, steps=1, set=[f"data.dir={data_dir}"])
    row = bench_memory.worker("tt_adapter_gc", args)
    assert row["method"] == "tt_adapter_gc" and row["trainable_params"] > 0 and row["peak_mem_mb"] > 0
    with pytest.raises(ConfigError, match="method 'adazeta' takes no backward pass"):
        bench_memory.worker("adazeta_gc", args)
