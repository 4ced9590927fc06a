"""Batched queries: one forward over a replicated batch, each copy with its own perturbed adapter weights,
gives the sequential estimator's losses and projected gradients (fp32), for TT, LoRA and dense adapters."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from torch import nn

from adazeta.adapters import ADAPTERS
from adazeta.errors import ConfigError
from adazeta.models import ModelConfig, load_model
from adazeta.optim.batched import ReplicaClosure, replica_sites, replicas_installed, replica_weights
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig
from adazeta.build import preflight
from adazeta.run import run
from adazeta.settings import parse
from adazeta.scoring import Scorer
from adazeta.tasks.spec import Example
from helpers import compose_cfg, tiny_overrides

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
EXAMPLES = [
    Example("the movie was", [" great fun", " bad"], 0),
    Example("a long plot, and then", [" it ended", " nothing happened"], 1),
    Example("short", ["Yes", "No"], 0),
    Example("the film is a good story", [" great", " terrible"], 0),
]
ADAPTER_CONFIGS = {
    "tt": {"bottleneck": 8, "rank": 2},
    "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
    "bottleneck": {"bottleneck": 8},
}


def adapted(kind: str, dtype: str = "fp32", device: str = "cpu"):
    loaded = load_model(ModelConfig(name="t", random_init=True, architecture=TINY_LLAMA, device=device, dtype=dtype), 1)
    entry = ADAPTERS.get(kind)
    torch.manual_seed(0)
    model = entry.builder(loaded.model, entry.config_cls(**ADAPTER_CONFIGS[kind]))
    if kind == "bottleneck":  # its up projection starts at zero; move it so that the adapter matters
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.normal_(0, 0.1)
    scorer = Scorer.of(model, loaded.tokenizer, device=loaded.device)
    return model, scorer.collate(scorer.encode(EXAMPLES, 64))


def closure_for(model, batch) -> ReplicaClosure:
    return ReplicaClosure(model, functools.partial(Scorer(model).replica_losses, batch))


def trainable(model) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def one_step(model, batch, batched: bool, estimator: str = "central", n_queries: int = 3, chunk: int = 3):
    # eps 0.05: the losses agree to fp32 rounding (~1e-7), which a projected gradient divides by eps.
    settings = ZOSGDConfig(lr=1e-2, eps=5e-2, estimator=estimator, batched_queries=batched, query_chunk=chunk)
    opt = ZOSGD(trainable(model), settings, seed=5, n_queries=n_queries)
    opt.step(closure_for(model, batch))
    return opt


@pytest.mark.parametrize("estimator", ["central", "one_sided"])
@pytest.mark.parametrize("kind", sorted(ADAPTER_CONFIGS))
def test_batched_step_equals_the_sequential_step(kind, estimator):
    model, batch = adapted(kind)
    twin = copy.deepcopy(model)
    # chunk 4 of 6 (central) or 4 (one-sided) evaluations: a query's +/- pair may straddle two forwards.
    seq = one_step(model, batch, batched=False, estimator=estimator, chunk=4)
    bat = one_step(twin, batch, batched=True, estimator=estimator, chunk=4)
    assert bat.forward_passes == seq.forward_passes == (6 if estimator == "central" else 4)
    torch.testing.assert_close(bat.last_losses, seq.last_losses, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(bat.last_projected_grads, seq.last_projected_grads, atol=1e-5, rtol=1e-5)
    assert seq.last_projected_grads.abs().max() > 1e-4  # the adapters do move the loss
    for a, b in zip(trainable(model), trainable(twin)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_batched_estimate_leaves_the_parameters_bitwise_untouched_and_restores_forward():
    model, batch = adapted("tt")
    before = [p.detach().clone() for p in trainable(model)]
    opt = ZOSGD(trainable(model), ZOSGDConfig(lr=0.0, batched_queries=True, query_chunk=2), n_queries=2)
    opt.step(closure_for(model, batch))
    assert all(torch.equal(a, b) for a, b in zip(before, trainable(model)))
    assert not any("forward" in m.__dict__ for m in model.modules())  # no replica forward left behind


def test_replica_forward_is_removed_even_when_the_forward_fails():
    model, _ = adapted("lora")
    params = trainable(model)
    sites = replica_sites(model, params)
    stacks = replica_weights(params, [(1, (0.1,)), (None, ())])
    with pytest.raises(RuntimeError), replicas_installed(sites, stacks):
        assert any("forward" in m.__dict__ for m in model.modules())
        raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_each_replica_sees_its_own_weights():
    model, batch = adapted("tt")
    params = trainable(model)
    plan = [(11, (0.5,)), (None, ()), (12, (0.5, -1.0))]
    stacks = replica_weights(params, plan)
    with torch.no_grad():
        batched = closure_for(model, batch).replicated(params, stacks)
        one_by_one = []
        for r in range(len(plan)):
            saved = [p.detach().clone() for p in params]
            for p, s in zip(params, stacks):
                p.copy_(s[r])
            one_by_one.append(closure_for(model, batch)())
            for p, s in zip(params, saved):
                p.copy_(s)
    torch.testing.assert_close(batched, torch.stack(one_by_one), atol=1e-6, rtol=1e-6)
    assert len(set(batched.tolist())) == 3


def test_bf16_backbone_with_fp32_adapters_runs_batched():
    model, batch = adapted("tt", dtype="bf16")
    assert all(p.dtype == torch.float32 for p in trainable(model))
    seq = one_step(copy.deepcopy(model), batch, batched=False)
    bat = one_step(model, batch, batched=True)
    assert torch.isfinite(bat.last_losses).all()
    torch.testing.assert_close(bat.last_losses, seq.last_losses, atol=2e-2, rtol=2e-2)  # bf16 rounding only


def test_a_plain_closure_falls_back_to_sequential_queries(caplog):
    model, batch = adapted("tt")
    twin = copy.deepcopy(model)
    opt = ZOSGD(trainable(model), ZOSGDConfig(lr=1e-2, eps=5e-2, batched_queries=True), seed=5, n_queries=2)
    with caplog.at_level("WARNING", logger="adazeta"):
        opt.step(lambda: Scorer(model).loss(batch))  # no way to evaluate replicas
    assert "sequential" in caplog.text
    seq = one_step(twin, batch, batched=False, n_queries=2)
    torch.testing.assert_close(opt.last_projected_grads, seq.last_projected_grads, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_batched_step_on_cuda_matches_the_sequential_step(dtype, tol):
    model, batch = adapted("tt", dtype=dtype, device="cuda")
    seq = one_step(copy.deepcopy(model), batch, batched=False)
    bat = one_step(model, batch, batched=True)
    assert bat.last_losses.device.type == "cuda"
    torch.testing.assert_close(bat.last_losses, seq.last_losses, atol=tol, rtol=tol)


def test_full_fine_tuning_cannot_run_replicas_and_says_so():
    model, batch = adapted("tt")
    model.requires_grad_(True)
    with pytest.raises(ConfigError, match="batched_queries=false"):
        replica_sites(model, trainable(model))


@pytest.mark.parametrize("chunk", [0, -1, True, 1.5])
def test_bad_query_chunk_is_one_config_error(chunk):
    with pytest.raises(ConfigError, match="query_chunk"):
        ZOSGDConfig(query_chunk=chunk)


def test_batched_full_fine_tuning_fails_before_the_model_loads(fixture_data):
    s = parse(compose_cfg(tiny_overrides(fixture_data, "method=mezo", "method.optimizer.batched_queries=true")))
    with pytest.raises(ConfigError, match="adapter method"):
        preflight(s)


def test_batched_run_equals_sequential_run_and_is_recorded(fixture_data, tmp_path):
    """End to end on tiny-llama: the same losses and accuracies, and result.json says how they were computed."""
    records = {}
    for batched in (False, True):
        overrides = tiny_overrides(fixture_data, "method=adazeta", "schedule=constant", "schedule.q=3",
                                   "method.optimizer.eps=5e-2", f"method.optimizer.batched_queries={batched}",
                                   "method.optimizer.query_chunk=4")
        records[batched] = run(compose_cfg(overrides), tmp_path / str(batched))
    seq, bat = records[False], records[True]
    assert bat["zo"] == {"estimator": "central", "batched_queries": True, "query_chunk": 4}
    assert seq["zo"]["batched_queries"] is False and bat["scoring_layout"] == "packed"
    for key in ("dev_loss", "test_loss"):
        assert bat[key] == pytest.approx(seq[key], abs=1e-5)
    for key in ("dev_accuracy", "test_accuracy", "forward_passes"):
        assert bat[key] == seq[key]
    stored = json.loads((tmp_path / "True" / "result.json").read_text())
    assert stored["config"]["method"]["optimizer"]["batched_queries"] is True


def test_auto_chunk_takes_as_many_replicas_as_the_memory_budget_allows():
    from adazeta.optim.batched import auto_chunk, forward_bytes

    model, batch = adapted("tt")
    closure = ReplicaClosure(model, functools.partial(Scorer(model).replica_losses, batch), batch)
    params = trainable(model)
    one = forward_bytes(model, batch)
    assert one > 0 and forward_bytes(model, batch.repeat(2)) == pytest.approx(2 * one, rel=0.05)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    copy_ = sum(p.numel() * p.element_size() for p in params)
    chunks = [auto_chunk(closure, params, budget, 64) for budget in (1e-6, 0.05, 0.5, 2.0, 1e6)]
    assert chunks[0] == 1 and chunks[-1] == 64 and chunks == sorted(chunks)
    for budget, chunk in zip((1e-6, 0.05, 0.5, 2.0), chunks):  # the largest chunk within the budget
        extra = lambda r: (r - 1) * one + r * copy_  # noqa: E731
        assert chunk == 1 or extra(chunk) <= budget * (weights + one)
        assert extra(chunk + 1) > budget * (weights + one)


@pytest.mark.parametrize("budget, expected", [(1e-6, 1), (1e6, 6)])
def test_an_auto_chunked_step_equals_the_sequential_step(budget, expected):
    model, batch = adapted("tt")
    twin = copy.deepcopy(model)
    seq = one_step(model, batch, batched=False, chunk=4)
    settings = ZOSGDConfig(lr=1e-2, eps=5e-2, batched_queries=True, query_chunk="auto", query_memory=budget)
    opt = ZOSGD(trainable(twin), settings, seed=5, n_queries=3)
    opt.step(ReplicaClosure(twin, functools.partial(Scorer(twin).replica_losses, batch), batch))
    assert min(opt.last_chunk, 6) == expected  # 6 evaluations in all: a larger chunk is one forward
    torch.testing.assert_close(opt.last_losses, seq.last_losses, atol=1e-6, rtol=1e-6)
    for a, b in zip(trainable(model), trainable(twin)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("memory", [0, -0.1, "lots", True])
def test_bad_query_memory_is_one_config_error(memory):
    assert ZOSGDConfig(query_chunk="auto").query_chunk == "auto"
    with pytest.raises(ConfigError, match="query_memory"):
        ZOSGDConfig(query_memory=memory)
