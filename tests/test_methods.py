"""The method matrix (the AdaZeta paper's tables) on tiny models: what each method trains, that training moves only
that and lowers the loss, Sparse-MeZO's masks, gradient accumulation, in-context learning, linear probing, memory
estimates."""

from __future__ import annotations

import copy
import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from adazeta.adapters import ADAPTERS
from adazeta.adapters.bottleneck import (
    BottleneckAdapter,
    BottleneckAdapterConfig,
    adapter_params,
    add_bottleneck_adapters,
)
from adazeta.adapters.tt import TTAdapter, count_adapters
from adazeta.dryrun import memory_estimate
from adazeta.errors import ConfigError
from adazeta.tasks.demonstrations import DemonstrationConfig, demonstration_text, fits_in, prepend_demonstrations, sample_demonstrations
from adazeta.models import byte_tokenizer, count_parameters, load_model
from adazeta.optim import OPTIMIZERS, spsa
from adazeta.optim.sparse_mezo import (SparseZOSGD, SparseZOSGDConfig, kth_smallest_abs, magnitude_mask,
                                       packed_magnitude_mask)
from adazeta.optim.batched import replica_weights
from adazeta.optim.spsa import PackedMask, RandomMask, directions, perturb_
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig
from adazeta.probe import ProbeConfig, fit_probe, prompt_features
from adazeta.build import seed_everything
from adazeta.run import run
from adazeta.settings import parse
from adazeta.scoring import Scorer
from adazeta.tasks.loaders import load_task
from adazeta.tasks.spec import Example
from adazeta.train import first_order_step
from helpers import compose_cfg, tiny_overrides, write_fixture_data

ZO_METHODS = ["adazeta", "mezo", "mezo_lora", "mezo_adapter", "sparse_mezo"]
FO_METHODS = ["ft", "lora", "adapter", "tt_adapter"]
TRAINING_FREE = ["zero_shot", "icl", "lp"]
# Learning rates for a visible drop within a few steps on the tiny model (the methods' defaults are for real LMs).
TEST_LR = {"adazeta": 3e-2, "mezo": 1e-3, "mezo_lora": 3e-2, "mezo_adapter": 3e-2, "sparse_mezo": 3e-3,
           "ft": 1e-3, "lora": 1e-2, "adapter": 1e-3, "tt_adapter": 1e-2}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (and the suite shares its cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_fixture_data(tmp_path_factory.mktemp("data"))


def build(data_dir: Path, method: str, *extra: str, seed: int = 0):
    """Settings, the adapted tiny-llama, its tokenizer and the trainable (name, parameter) pairs of ``method``."""
    s = parse(compose_cfg(tiny_overrides(data_dir, f"method={method}", f"seed={seed}", *extra)))
    seed_everything(seed)
    loaded = load_model(s.model, seed=seed)
    model = ADAPTERS.get(s.adapter.kind).builder(loaded.model, s.adapter.config)
    return s, model, loaded.tokenizer, [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# --- trainable sets ----------------------------------------------------------------------------------------

# tiny-llama: hidden 32, 2 layers, 4 heads of 8, 2 key-value heads (v_proj: 32 -> 16).
LORA_COUNT = {"mezo_lora": 2 * 5 * ((32 + 32) + (32 + 16)), "lora": 2 * 8 * ((32 + 32) + (32 + 16))}


@pytest.mark.parametrize("method", ZO_METHODS + FO_METHODS + TRAINING_FREE)
def test_each_method_trains_exactly_its_parameters(method, data_dir):
    s, model, _, named = build(data_dir, method)
    names = [n for n, _ in named]
    total, trainable = count_parameters(model)
    if method in ("mezo", "ft", "sparse_mezo"):
        assert trainable == total and len(names) == len(list(model.parameters()))
    elif method in TRAINING_FREE:
        assert trainable == 0
    elif method in ("adazeta", "tt_adapter"):
        # AdaZeta's trainable set: TT cores and biases only; no norm, no head, no embedding.
        assert count_adapters(model) == 6 and all(".adapter." in n for n in names)
        assert not any("norm" in n or "lm_head" in n or "embed" in n for n in names)
        owners = [m for m in model.modules() if isinstance(m, TTAdapter)]
        assert trainable == sum(p.numel() for m in owners for p in m.parameters())
    elif method in ("mezo_adapter", "adapter"):
        # Dense adapters after attention (o_proj) and FFN (down_proj) of both layers.
        assert sum(isinstance(m, BottleneckAdapter) for m in model.modules()) == 4
        assert all(".adapter." in n and ("o_proj" in n or "down_proj" in n) for n in names)
        assert trainable == 4 * adapter_params(32, 64)
    else:  # LoRA: A and B of the q and v projections only
        assert all(("lora_A" in n or "lora_B" in n) and ("q_proj" in n or "v_proj" in n) for n in names)
        assert trainable == LORA_COUNT[method]
    assert s.optimizer is None if method in TRAINING_FREE else s.optimizer is not None


@pytest.mark.parametrize("method", ZO_METHODS + FO_METHODS)
def test_training_lowers_the_loss_and_leaves_frozen_weights_bitwise_unchanged(method, data_dir):
    s, model, tok, named = build(data_dir, method, f"method.optimizer.lr={TEST_LR[method]}")
    data = load_task(s.bound_task(), s.data, 0)
    # A tiny learnable task: one class only, so any trainable set that reaches the scores can fit it.
    scorer = Scorer.of(model, tok)
    items = scorer.encode([e for e in data.train if e.gold == 0][:8], 256)
    batch = scorer.collate(items)
    optimizer = OPTIMIZERS.get(s.optimizer.kind).builder(named, s.optimizer.config, 0)
    trainable = {n for n, _ in named}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        loss_before = float(scorer.loss(batch))
    for _ in range(10 if method in ZO_METHODS else 3):
        if method in ZO_METHODS:
            optimizer.step(lambda: scorer.loss(batch), n_queries=2)
        else:
            first_order_step(scorer, optimizer, items)
    model.eval()
    with torch.no_grad():
        loss_after = float(scorer.loss(batch))
    assert loss_after < loss_before - 0.02, (loss_before, loss_after)
    after = dict(model.named_parameters())
    for name, value in before.items():
        if name not in trainable:
            assert torch.equal(after[name], value), f"{name} is frozen but changed"
    assert any(not torch.equal(after[n], before[n]) for n in trainable)
    if method == "sparse_mezo":
        names = {id(p): n for n, p in named}
        for p, mask in optimizer.param_masks():
            name = names[id(p)]
            assert torch.equal(p.detach()[~mask], before[name][~mask]), f"{name} moved outside its mask"
            assert not torch.equal(p.detach()[mask], before[name][mask]), f"{name} did not move inside its mask"


# --- Sparse-MeZO -------------------------------------------------------------------------------------------


def test_magnitude_mask_keeps_the_smallest_weights_per_tensor():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 50, generator=g)
    mask = magnitude_mask(w, 0.25)
    assert mask.dtype == torch.bool and int(mask.sum()) == 500  # ceil(0.25 * 2000), no ties in random data
    assert w[mask].abs().max() < w[~mask].abs().min()
    assert magnitude_mask(w, 1.0).all()


def test_random_mask_is_seeded_and_has_the_requested_density():
    params = [torch.randn(100, 100), torch.randn(500)]
    a = list(RandomMask(1, 0.25).for_params(params))
    b = list(RandomMask(1, 0.25).for_params(params))
    c = list(RandomMask(2, 0.25).for_params(params))
    assert all(x.dtype == torch.bool and x.shape == p.shape for x, p in zip(a, params))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0].reshape(-1)[:500], a[1])  # each parameter gets its own draw
    assert abs(float(a[0].float().mean()) - 0.25) < 0.02


def _moved(before: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach() != b for p, b in zip(params, before)]


def test_random_mask_is_redrawn_every_step_and_shared_within_a_step():
    """mask=random (the AdaZeta reference baseline): one mask per step, for its +eps, -eps and update passes."""
    params = [torch.nn.Parameter(torch.randn(40, 30)), torch.nn.Parameter(torch.randn(60))]
    opt = SparseZOSGD(params, SparseZOSGDConfig(sparsity=0.75, mask="random", lr=1e-2), seed=3)
    assert "sparse_masks" not in opt.state_dict()  # nothing stored: the mask follows from the seed and the step
    step_masks = []
    for _ in range(3):
        masks = [m for _, m in opt.param_masks()]
        step_masks.append(masks)
        before = [p.detach().clone() for p in params]
        evaluated = []

        def closure():
            evaluated.append(_moved(before, params))  # which entries this +eps / -eps pass perturbed
            return sum((p**2).sum() for p in params)

        opt.step(closure, n_queries=2)
        # Every pass of the step (2 queries x +eps, -eps) perturbed exactly the step's mask, and so did the update.
        assert len(evaluated) == 4
        for moved in evaluated:
            assert all(torch.equal(mv, m) for mv, m in zip(moved, masks))
        assert all(torch.equal(mv, m) for mv, m in zip(_moved(before, params), masks))
        # Outside the mask the weights are bitwise what they were.
        assert all(torch.equal(p.detach()[~m], b[~m]) for p, m, b in zip(params, masks, before))
    assert not torch.equal(step_masks[0][0], step_masks[1][0]) and not torch.equal(step_masks[1][0], step_masks[2][0])
    assert all(abs(float(m[0].float().mean()) - 0.25) < 0.08 for m in step_masks)
    # A resumed optimizer draws the same masks for the same step: the step count is in its state.
    twin = SparseZOSGD([torch.nn.Parameter(p.detach().clone()) for p in params],
                       SparseZOSGDConfig(sparsity=0.75, mask="random"), seed=3)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(twin.param_masks(), opt.param_masks()))


def test_every_pass_over_the_weights_sees_the_same_random_mask():
    """Sequential perturbation, batched replicas and the fidelity instrument's z all redraw one mask alike."""
    params = [torch.randn(20, 10), torch.randn(7)]
    mask = RandomMask(5, 0.25)
    masks = list(mask.for_params(params))
    z = directions(params, 11, mask)
    assert all(torch.equal(zi != 0, m) for zi, m in zip(z, masks))
    shifted = [p.clone() for p in params]
    perturb_(shifted, 11, 1e-3, mask)
    stacks = replica_weights(params, [(11, (1e-3,))], mask)
    assert all(torch.equal(stack[0], w) for stack, w in zip(stacks, shifted))


def test_sparse_masks_are_fixed_at_start_and_survive_a_resume():
    w = torch.nn.Parameter(torch.randn(30, 30))
    opt = SparseZOSGD([w], SparseZOSGDConfig(sparsity=0.5, lr=1.0), seed=0)
    start_mask = opt.param_masks()[0][1].clone()
    for _ in range(3):
        opt.step(lambda: (w**2).sum())
    assert torch.equal(opt.param_masks()[0][1], start_mask)  # not recomputed from the moved weights
    assert not torch.equal(magnitude_mask(w, 0.5), start_mask)  # (which would differ by now)
    w2 = torch.nn.Parameter(w.detach().clone())
    resumed = SparseZOSGD([w2], SparseZOSGDConfig(sparsity=0.5, lr=1.0), seed=0)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch.equal(resumed.param_masks()[0][1], start_mask)


@pytest.mark.parametrize(
    "values,field",
    [({"sparsity": 1.0}, "optimizer.sparsity"), ({"mask": "top"}, "optimizer.mask"),
     ({"weight_decay": 0.01}, "optimizer.weight_decay"), ({"eps": 0.0}, "optimizer.eps")],
)
def test_sparse_mezo_config_errors_name_the_field(values, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SparseZOSGDConfig(**values)


def test_sparse_mezo_with_the_adaptive_schedule_end_to_end(data_dir, tmp_path):
    # Any method with any schedule: 8 examples at batch 4 = 2 steps an epoch; Q = 1, 1, 2, 2.
    record = run(compose_cfg(tiny_overrides(
        data_dir, "method=sparse_mezo", "method.optimizer.mask=random", "schedule=adaptive", "schedule.alpha=2",
        "schedule.beta=1", "data.num_train=8", "data.num_dev=8", "data.num_eval=8",
    )), tmp_path)
    assert record["status"] == "finished"
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["n_queries"]) for r in rows] == [1, 1, 2, 2]


# --- dense bottleneck adapters ------------------------------------------------------------------------------


def test_bottleneck_adapter_starts_as_the_identity_and_follows_the_placements():
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100)).eval()
    ids = torch.randint(0, 100, (2, 5))
    before = model(ids).logits
    model = add_bottleneck_adapters(model, BottleneckAdapterConfig(bottleneck=8))
    assert torch.allclose(model(ids).logits, before, atol=1e-6)  # zero up-projection
    assert sum(isinstance(m, BottleneckAdapter) for m in model.modules()) == 4  # attn.c_proj + mlp.c_proj, 2 layers
    model.config.model_type = "mystery"
    with pytest.raises(ConfigError, match=r"adapter\.targets"):
        add_bottleneck_adapters(model, BottleneckAdapterConfig())


@pytest.mark.parametrize(
    "values,field",
    [({"bottleneck": 0}, "adapter.bottleneck"), ({"placement": "everywhere"}, "adapter.placement"),
     ({"targets": [{"pattern": "x"}]}, r"adapter.targets\[0\]")],
)
def test_bottleneck_config_errors_name_the_field(values, field):
    with pytest.raises(ConfigError, match=field):
        BottleneckAdapterConfig(**values)


# --- gradient accumulation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_accum", [2, 3])
def test_gradient_accumulation_equals_one_big_batch(grad_accum, data_dir):
    s, model, tok, named = build(data_dir, "ft", "method.optimizer.lr=1e-12")  # the gradients alone are compared
    data = load_task(s.bound_task(), s.data, 0)
    items = Scorer.of(model, tok).encode(data.train[:8], 256)  # different lengths: padding differs per micro-batch
    other = copy.deepcopy(model)
    grads = {}
    for m, accum in ((model, 1), (other, grad_accum)):
        opt = OPTIMIZERS.get("adamw").builder([(n, p) for n, p in m.named_parameters() if p.requires_grad],
                                             s.optimizer.config, 0)
        loss = first_order_step(Scorer.of(m, tok), opt, items, accum)
        grads[accum] = (float(loss), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    (loss_one, g_one), (loss_acc, g_acc) = grads[1], grads[grad_accum]
    assert loss_acc == pytest.approx(loss_one, rel=1e-5)
    assert g_one.keys() == g_acc.keys() and len(g_one) == len(named)
    for name in g_one:
        assert torch.allclose(g_acc[name], g_one[name], rtol=1e-4, atol=1e-7), name


# --- in-context learning -----------------------------------------------------------------------------------


def _examples(n: int) -> list[Example]:
    return [Example(f"review {i} It was", [" terrible", " great"], i % 2) for i in range(n)]


def _sst2(family: str, mask_token: str | None = None):
    return parse(compose_cfg(["task=sst2"])).task.for_family(family, mask_token)


def test_demonstrations_are_seeded_distinct_train_examples():
    train = _examples(50)
    a, b, c = (sample_demonstrations(train, 8, seed) for seed in (0, 0, 1))
    assert a == b and a != c and len({e.prompt for e in a}) == 8
    with pytest.raises(ConfigError, match="demonstrations.k=51"):
        sample_demonstrations(train, 51, 0)
    with pytest.raises(ConfigError, match="demonstrations.k=0"):
        DemonstrationConfig(k=0)


def test_demonstrations_precede_the_prompt_and_truncation_keeps_the_test_example_whole():
    tok = byte_tokenizer()
    demos, test = _examples(4), Example("the test sentence It was", [" terrible", " great"], 1)
    task = _sst2("causal")
    (full,) = prepend_demonstrations([test], demos, "\n\n", task, fits_in(tok, task, 384))
    blocks = [demonstration_text(d, task) for d in demos]
    assert blocks[1] == "review 1 It was great"  # the gold answer follows each demonstration's prompt
    assert full.prompt == "\n\n".join(blocks + [test.prompt]) and full.meta["demonstrations"] == 4
    # Room for about two demonstrations: the oldest are dropped whole, the test example stays whole.
    budget = len(tok("\n\n".join(blocks[2:] + [test.prompt]))["input_ids"]) + 1
    (cut,) = prepend_demonstrations([test], demos, "\n\n", task, fits_in(tok, task, budget))
    assert cut.prompt == "\n\n".join(blocks[2:] + [test.prompt]) and cut.meta["demonstrations"] == 2
    (none,) = prepend_demonstrations([test], demos, "\n\n", task, fits_in(tok, task, 8))
    assert none.prompt == test.prompt and none.meta["demonstrations"] == 0


def test_masked_demonstrations_fill_the_mask_with_the_gold_word():
    demo = Example("fine film It was<mask>.", ["terrible", "great"], 1)
    assert demonstration_text(demo, _sst2("masked", "<mask>")) == "fine film It was great."  # LM-BFF's " great"
    with pytest.raises(ConfigError, match="masked demonstrations need the tokenizer's mask token"):
        demonstration_text(demo, _sst2("masked"))  # bound before the tokenizer was known


def test_icl_run_prepends_demonstrations_to_dev_and_test(data_dir, tmp_path):
    record = run(compose_cfg(tiny_overrides(data_dir, "method=icl", "method.demonstrations.k=2")), tmp_path)
    assert record["status"] == "finished" and record["trainable_params"] == 0
    assert record["demonstrations"] == 2  # both fit in tiny-llama's 384 tokens
    with pytest.raises(ConfigError, match="training-free"):
        cfg = compose_cfg(tiny_overrides(data_dir, "method=icl"))
        cfg.method.optimizer = {"kind": "zo_sgd"}
        parse(cfg)


# --- linear probing ----------------------------------------------------------------------------------------


def test_probe_selects_c_on_dev_and_separates_separable_features():
    rng = np.random.RandomState(0)
    y = rng.randint(0, 3, 300)
    x = rng.randn(300, 5) + 3 * np.eye(3, 5)[y]
    probe, grid = fit_probe(x[:200], y[:200], x[200:], y[200:], ProbeConfig(C=[1e-4, 1.0]), num_classes=3)
    assert set(grid) == {1e-4, 1.0} and probe.C == max(grid, key=grid.get)
    result = probe.evaluate(x[200:], y[200:])
    assert result.score > 0.9 and result.loss < math.log(3) and result.n == 100
    with pytest.raises(ConfigError, match="single class"):
        fit_probe(x[:10], np.zeros(10, dtype=int), x[10:20], y[10:20], ProbeConfig(), num_classes=3)
    with pytest.raises(ConfigError, match="probe.C"):
        ProbeConfig(C=[0.0])


def test_probe_features_are_the_last_prompt_token_whatever_the_padding(data_dir):
    s, model, tok, _ = build(data_dir, "lp")
    data = load_task(s.bound_task(), s.data, 0)
    scorer = Scorer.of(model, tok)
    items = scorer.encode(data.train[:5], 256)
    batched = prompt_features(scorer, items, 5)
    alone = prompt_features(scorer, items[2:3], 1)
    assert batched.shape == (5, 32)
    assert np.allclose(batched[2], alone[0], atol=1e-5)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([items[2].prompt])).last_hidden_state[0, -1]
    assert np.allclose(alone[0], hidden.numpy(), atol=1e-5)


def test_lp_run_writes_dev_and_test_results(data_dir, tmp_path):
    record = run(compose_cfg(tiny_overrides(data_dir, "method=lp", "method.probe.C=[0.1,10]")), tmp_path)
    assert record["status"] == "finished" and record["steps"] == 0 and record["trainable_params"] == 0
    assert record["probe"]["C"] in (0.1, 10.0) and set(record["probe"]["dev_accuracy_per_C"]) == {"0.1", "10.0"}
    saved = json.loads((tmp_path / "result.json").read_text())
    assert 0 <= saved["dev_accuracy"] <= 1 and 0 <= saved["test_accuracy"] <= 1
    with open(tmp_path / "eval.csv") as f:
        assert [r["split"] for r in csv.DictReader(f)] == ["dev", "test"]
    with pytest.raises(ConfigError, match="classifies"):
        parse(compose_cfg(tiny_overrides(data_dir, "method=lp", "task=squad")))


# --- memory estimates --------------------------------------------------------------------------------------


def _estimate(method: str, *extra: str) -> dict[str, float]:
    """The dry-run estimate for SmolLM2 with illustrative shapes: 134.5 M weights, the largest the 49,152 x 576
    embedding, the others MLP-sized; an adapter method trains 1 M entries in tensors of at most 36,864."""
    s = parse(compose_cfg([f"method={method}", "model=smollm2-135m", *extra]))
    total = 134_515_008
    backbone = [(49_152, 576)] + [(576, 1_536)] * 120 + [(total - 28_311_552 - 120 * 884_736,)]
    trained = {"full": backbone, "none": []}.get(
        s.adapter.kind, [(36_864,)] * 27 + [(1_000_000 - 27 * 36_864,)])
    added = 0 if s.adapter.kind in ("full", "none") else 1_000_000
    return memory_estimate(s, total + added, trained, largest_weight=28_311_552)


def test_memory_estimate_per_method():
    est = {m: _estimate(m) for m in ZO_METHODS + FO_METHODS + ["zero_shot"]}
    inference = est["zero_shot"]
    for m in ZO_METHODS:  # no backward: no stored activations, no gradients
        assert est[m]["activations"] == inference["activations"] and est[m]["gradients"] == 0, m
    for m in FO_METHODS:  # backward runs through every frozen layer too
        assert est[m]["activations"] == est["ft"]["activations"] > 10 * inference["activations"], m
        assert est[m]["gradients"] > 0 and est[m]["optimizer_state"] == pytest.approx(2 * est[m]["gradients"], abs=2e-3)
    assert est["sparse_mezo"]["optimizer_state"] == pytest.approx(134_515_008 / 8 / 2**30, abs=1e-3)  # a bit a weight
    random_mask = _estimate("sparse_mezo", "method.optimizer.mask=random")
    assert random_mask["optimizer_state"] == 0  # redrawn every step, never kept
    assert est["mezo"]["optimizer_state"] == 0
    # a pass's noise: a GPU draws the embedding's z whole (108 MiB), a CPU a slice at a time
    assert _estimate("mezo", "model.device=cuda")["step_temporaries"] == pytest.approx(28_311_552 * 4 / 2**30, abs=1e-3)
    assert _estimate("mezo", "model.device=cpu")["step_temporaries"] < 0.01
    assert est["adazeta"]["total"] <= 1.1 * inference["total"]
    assert est["ft"]["total"] > 3 * inference["total"]
    batched = _estimate("adazeta", "method.optimizer.batched_queries=true", "method.optimizer.query_chunk=4")
    assert batched["activations"] == pytest.approx(4 * est["adazeta"]["activations"], rel=1e-2)
    bf16 = _estimate("ft", "model.dtype=bf16")
    assert bf16["gradients"] == pytest.approx(est["ft"]["gradients"] / 2, abs=1e-3)  # grads in the weights' dtype
    # a rule on the dense estimate holds g_hat, an fp32 tensor per weight, during its step (ZO-Sign on SmolLM2:
    # measured 1,676 MiB against the 1.08 GiB estimated before it counted the step's temporaries)
    sign = _estimate("mezo", "optimizer@method.optimizer=zo_sign")
    assert sign["step_temporaries"] >= est["mezo"]["step_temporaries"] + 134_515_008 * 4 / 2**30


# --- every adapter on every architecture -------------------------------------------------------------------


def _tiny(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    extra = {
        "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=100),
        "opt": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=100,
                    word_embed_proj_dim=32),
    }
    kwargs = extra.get(model_type, {**common, "num_key_value_heads": 2, "head_dim": 8}
                       if model_type not in ("bert", "roberta") else common)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    auto = AutoModelForMaskedLM if model_type in ("bert", "roberta") else AutoModelForCausalLM
    return auto.from_config(config).eval()


ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "opt", "gpt2", "bert", "roberta"]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["tt", "bottleneck", "lora"])
def test_every_adapter_fits_every_architecture(kind, model_type, reference_targets):
    from adazeta.adapters.lora import LoraAdapterConfig
    from adazeta.adapters.tt import TTAdapterConfig

    # The reference sites of conf/model/hf.yaml, as a run on this model type gets them.
    tt_targets, dense_targets = reference_targets(model_type, "official"), reference_targets(model_type, "paper")
    cfg = {"tt": TTAdapterConfig(bottleneck=8, rank=2, targets=tt_targets),
           "bottleneck": BottleneckAdapterConfig(bottleneck=8, targets=dense_targets),
           "lora": LoraAdapterConfig(r=2)}[kind]
    model = ADAPTERS.get(kind).builder(_tiny(model_type), cfg)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if kind == "lora":  # peft's default targets: the attention's query and value projections
        assert names and all("lora_" in n and any(t in n for t in ("q_proj", "v_proj", "query", "value", "c_attn"))
                             for n in names)
    else:
        assert names and all(".adapter." in n for n in names)
        # TT (official): gate/up inputs and down output on the Llama family, 3 per layer; elsewhere 2 per layer.
        # Dense (paper): after the attention and feed-forward sub-layers, 2 per layer.
        per_layer = 3 if kind == "tt" and model_type not in ("opt", "gpt2", "bert", "roberta") else 2
        assert sum(isinstance(m, (TTAdapter, BottleneckAdapter)) for m in model.modules()) == 2 * per_layer
    ids = torch.randint(5, 100, (2, 6))
    out = model(input_ids=ids).logits
    assert out.shape == (2, 6, 100) and torch.isfinite(out).all()


def test_memory_benchmark_worker_runs_each_kind_of_step(data_dir):
    import argparse

    from adazeta.tools import bench_memory as bench

    args = argparse.Namespace(model="tiny-llama", task="rte", batch_size=4, steps=1, set=[f"data.dir={data_dir}"])
    rows = {m: bench.worker(m, args) for m in ("inference", "ft", "adazeta")}  # forward, AdamW step, ZO step
    trainable = {m: r["trainable_params"] for m, r in rows.items()}
    assert trainable["inference"] == 0 and trainable["ft"] > trainable["adazeta"] > 0
    assert all(r["peak_mem_mb"] > 0 and r["device"] == "cpu" for r in rows.values())


# --- Sparse-MeZO's mask storage: bits, and thresholds without full-size temporaries ------------------------


@pytest.mark.parametrize("shape", [(7,), (8,), (3, 5), (1000, 37), (2**20 + 13,)])
def test_packed_masks_unpack_to_the_same_entries_from_any_start(shape):
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(shape, generator=g) < 0.3
    packed = PackedMask.pack(mask)
    assert packed.bits.numel() == (mask.numel() + 7) // 8 and packed.bits.dtype == torch.uint8
    assert torch.equal(packed.dense(), mask)
    flat = mask.reshape(-1)
    for start, n in [(0, 1), (3, 11), (flat.numel() - 5, 5), (flat.numel() // 2 + 1, flat.numel() // 3)]:
        if 0 <= start and start + n <= flat.numel():
            assert torch.equal(packed.unpack(start, n), flat[start : start + n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_mask_products_are_the_bool_products_bit_for_bit(dtype, monkeypatch):
    """mul_into_ (a byte table for whole bytes, unpacked bools at the ragged ends) from any start, across slices:
    the numbers of z * mask, signed zeros included."""
    monkeypatch.setattr(spsa, "MASK_SLICE", 64)  # many slices, a short last one
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(1000, generator=g) < 0.4
    packed = PackedMask.pack(mask)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # compared as bit patterns
    for start, n in [(0, 1000), (0, 7), (3, 5), (5, 300), (8, 640), (13, 987), (999, 1), (16, 0)]:
        z = torch.randn(n, generator=g).to(dtype)
        expected = z * mask[start : start + n]
        packed.mul_into_(z, start)
        assert torch.equal(z.view(bits), expected.view(bits)), (start, n)


@pytest.mark.parametrize("numel", [10, 4096, 2**20 * 3 + 7])
def test_kth_smallest_abs_is_kthvalue(numel):
    g = torch.Generator().manual_seed(numel)
    p = torch.randn(numel, generator=g) * 0.02
    p[: numel // 10] = 0.0  # ties, and +0 / -0 alike
    p[numel // 10 : numel // 5] = -0.0
    for density in (0.05, 0.25, 0.5, 1.0 - 1.0 / numel):
        k = max(1, int(np.ceil(density * numel)))
        assert torch.equal(kth_smallest_abs(p, k), p.abs().float().kthvalue(k).values)
    half = p.to(torch.bfloat16)
    assert torch.equal(kth_smallest_abs(half, numel // 3), half.abs().float().kthvalue(numel // 3).values)


def test_packed_magnitude_mask_is_the_bool_mask_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    p = torch.randn(2**20 + 100, generator=g)
    for density in (0.25, 1.0):
        assert torch.equal(packed_magnitude_mask(p, density).dense(), magnitude_mask(p, density))


def test_sparse_steps_with_packed_masks_equal_steps_with_bool_masks():
    """The packed mask moves exactly what the bool mask it replaced moved (the per-parameter reference)."""
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(40, 30, generator=g), torch.randn(2**20 + 9, generator=g)]
    packed = [torch.nn.Parameter(w.clone()) for w in start]
    opt = SparseZOSGD(packed, SparseZOSGDConfig(sparsity=0.75, lr=1e-2), seed=4)
    assert all(isinstance(m, PackedMask) for m in opt.masks(packed))
    dense = [torch.nn.Parameter(w.clone()) for w in start]
    bool_masks = [magnitude_mask(w, 0.25) for w in start]
    ref = ZOSGD(dense, ZOSGDConfig(lr=1e-2), seed=4)
    ref.masks = lambda params: bool_masks  # the same optimizer with the masks as bools
    for _ in range(2):
        opt.step(lambda: sum((p**2).sum() for p in packed), n_queries=2)
        ref.step(lambda: sum((p**2).sum() for p in dense), n_queries=2)
    assert all(torch.equal(a, b) for a, b in zip(packed, dense))
    assert not torch.equal(packed[1], start[1])


def test_a_checkpoint_with_bool_masks_still_loads():
    w = torch.nn.Parameter(torch.randn(30, 30))
    opt = SparseZOSGD([w], SparseZOSGDConfig(sparsity=0.5, lr=1.0), seed=0)
    state = copy.deepcopy(opt.state_dict())
    assert state["sparse_masks"][0].dtype == torch.uint8 and state["sparse_masks"][0].numel() == 113
    old = dict(state, sparse_masks=[magnitude_mask(w, 0.5)])  # as earlier releases saved it
    resumed = SparseZOSGD([torch.nn.Parameter(w.detach().clone())], SparseZOSGDConfig(sparsity=0.5, lr=1.0), seed=0)
    resumed.load_state_dict(old)
    assert torch.equal(resumed.param_masks()[0][1], opt.param_masks()[0][1])


def test_random_masks_drawn_in_slices_equal_one_draw():
    """The CPU generator's stream does not depend on how a draw is cut: the sliced mask equals torch.rand's."""
    p = torch.empty(3 * 2**20 + 5)
    sliced = next(RandomMask(9, 0.25).for_params([p]))
    gen = torch.Generator().manual_seed(9)
    assert torch.equal(sliced, torch.rand(p.shape, generator=gen) < 0.25)
