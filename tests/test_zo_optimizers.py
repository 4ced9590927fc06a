"""The field's ZO optimizers on the engine (adazeta.optim.engine): each update against its paper's formula.

For each optimizer, an independent few-line implementation of its rule, written here from the paper (not the
project's code: only the directions are taken from ``spsa.directions``, the seeded stream every estimator shares),
steps a small float64 problem (a quadratic and a logistic regression) beside the optimizer, with Q = 1 and Q = 3,
and the parameters agree after several steps to float rounding. Each optimizer also reduces an ill-conditioned
quadratic from a held-out start, resumes bit for bit from its state_dict, counts the forwards its config declares,
and refuses what it cannot do with a one-line error.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.spsa import directions, query_seed

EPS = 1e-3
SEED = 5


class Quadratic(nn.Module):
    """f(W, b) = 1/2 sum_ij a_ij (W - W*)_ij^2 + 1/2 |b - b*|^2 on a 2-D weight and a 1-D bias."""

    def __init__(self, scales: torch.Tensor, start: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(100 + start)
        self.register_buffer("scales", scales)
        self.weight = nn.Parameter(torch.randn(scales.shape, generator=g, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(scales.shape[0], generator=g, dtype=torch.float64))
        self.register_buffer("target", torch.randn(scales.shape, generator=torch.Generator().manual_seed(7),
                                                   dtype=torch.float64))

    def loss(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.scales * (weight - self.target) ** 2).sum() + 0.5 * ((bias - 0.5) ** 2).sum()

    def forward(self) -> torch.Tensor:
        return self.loss(self.weight, self.bias)


class Logistic(nn.Module):
    """Mean logistic loss of a linear classifier (weight 1 x d, bias 1) on fixed separable-ish data."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.register_buffer("x", torch.randn(32, 6, generator=g, dtype=torch.float64))
        self.register_buffer("y", (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).double())
        self.weight = nn.Parameter(torch.zeros(1, 6, dtype=torch.float64))
        self.bias = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def loss(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        logits = self.x @ weight[0] + bias[0]
        return nn.functional.binary_cross_entropy_with_logits(logits, self.y)

    def forward(self) -> torch.Tensor:
        return self.loss(self.weight, self.bias)


class Closure:
    """The loss of ``model`` as the training loop hands it to a ZO step (with its model, for forward_grad)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.model()


def problems() -> dict[str, nn.Module]:
    return {"quadratic": Quadratic(torch.tensor([[1.0, 4.0, 9.0], [0.5, 2.0, 3.0]], dtype=torch.float64)),
            "logistic": Logistic()}


def build(kind: str, model: nn.Module, **values):
    cfg = OPTIMIZERS.config(kind, {"eps": EPS, **values})
    return OPTIMIZERS.get(kind).builder(list(model.named_parameters()), cfg, SEED), cfg


# --- the papers' rules, written independently -----------------------------------------------------------------

def central(model, w, b, zs):
    """(losses, g_q) of central differences at (w, b) along each z = (z_w, z_b)."""
    losses, grads = [], []
    for zw, zb in zs:
        plus, minus = model.loss(w + EPS * zw, b + EPS * zb), model.loss(w - EPS * zw, b - EPS * zb)
        losses += [plus, minus]
        grads.append((plus - minus) / (2 * EPS))
    return torch.stack(losses), grads


def directions_of(w, b, step, q):
    """The step's z: the project's seeded stream (the one thing taken from it), for parameters in its order."""
    return [tuple(directions([w, b], query_seed(SEED, step, i))) for i in range(q)]


def estimate(coefs, zs):
    q = len(zs)
    return (sum(c * z[0] for c, z in zip(coefs, zs)) / q, sum(c * z[1] for c, z in zip(coefs, zs)) / q)


def reference(kind: str, model: nn.Module, steps: int, q: int, lr: float):
    """The parameters after ``steps`` steps of ``kind``'s paper rule, from the model's starting point."""
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    state: dict[str, list[torch.Tensor]] = {}
    for t in range(steps):
        zs = directions_of(w, b, t, q)
        if kind == "forward_grad":  # grad . z exactly (autograd here, forward mode in the optimizer)
            wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
            gw, gb = torch.autograd.grad(model.loss(wg, bg), [wg, bg])
            coefs = [(gw * zw).sum() + (gb * zb).sum() for zw, zb in zs]
        else:
            losses, coefs = central(model, w, b, zs)
            if kind == "es":  # z-scored fitness of the 2q members; member -z_q enters with a minus sign
                s = (losses - losses.mean()) / losses.std(unbiased=False)
                coefs = [(s[2 * i] - s[2 * i + 1]) / 2 for i in range(q)]
        g = estimate(coefs, zs)
        if kind in ("zo_sgd", "es", "forward_grad"):
            w, b = w - lr * g[0], b - lr * g[1]
        elif kind == "zo_sign":
            w, b = w - lr * torch.sign(g[0]), b - lr * torch.sign(g[1])
        elif kind == "zo_momentum":
            mu = 0.9
            state["m"] = list(g) if t == 0 else [mu * m + gi for m, gi in zip(state["m"], g)]
            w, b = w - lr * state["m"][0], b - lr * state["m"][1]
        elif kind == "zo_adam":
            b1, b2, e = 0.9, 0.999, 1e-8
            m = [(1 - b1) * gi + (b1 * mi if t else 0) for gi, mi in zip(g, state.get("m", g))]
            v = [(1 - b2) * gi**2 + (b2 * vi if t else 0) for gi, vi in zip(g, state.get("v", g))]
            state["m"], state["v"] = m, v
            new = [p - lr * (mi / (1 - b1 ** (t + 1))) / ((vi / (1 - b2 ** (t + 1))).sqrt() + e)
                   for p, mi, vi in zip((w, b), m, v)]
            w, b = new
        elif kind == "zo_cons":  # ZO-Bench's three candidates and tie rule
            l0 = model.loss(w, b)
            l1 = model.loss(w - lr * g[0], b - lr * g[1])
            l2 = model.loss(w + lr * g[0], b + lr * g[1])
            sign = (0 if l0 < l2 else 1) if l1 > l0 else (-1 if l1 < l2 else 1)
            w, b = w + sign * lr * g[0], b + sign * lr * g[1]
    return w, b


KINDS = ["zo_sign", "zo_momentum", "zo_adam", "zo_cons", "es", "forward_grad"]
LR = {"zo_sign": 1e-3, "zo_momentum": 2e-3, "zo_adam": 1e-2, "zo_cons": 2e-2, "es": 1e-2, "forward_grad": 2e-2}


@pytest.mark.parametrize("problem", ["quadratic", "logistic"])
@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_each_update_is_its_papers_formula(kind, q, problem):
    model = problems()[problem]
    expected = reference(kind, model, steps=6, q=q, lr=LR[kind])
    opt, _ = build(kind, model, lr=LR[kind])
    closure = Closure(model)
    for _ in range(6):
        opt.step(closure, n_queries=q)
    for got, want in zip((model.weight, model.bias), expected):
        assert torch.allclose(got.detach(), want, rtol=1e-9, atol=1e-11), (kind, got, want)
    assert not torch.equal(model.weight.detach(), problems()[problem].weight.detach())  # it moved


def es_authors(model: nn.Module, steps: int, n: int, lr: float):
    """The ES fine-tuning authors' step (es_fine-tuning_conciseness.py 219-309), written out: N independent members
    w + sigma z_n, rewards R_n = -L_n normalised by (R - mean R) / (std R + 1e-8) (numpy's population std), then
    w <- w + alpha / N sum_n R_norm_n z_n. Only the directions come from the project's seeded stream."""
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    for t in range(steps):
        zs = directions_of(w, b, t, n)
        rewards = torch.stack([-model.loss(w + EPS * zw, b + EPS * zb) for zw, zb in zs])
        normalised = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-8)
        w = w + lr * sum(r * zw for r, (zw, _) in zip(normalised, zs)) / n
        b = b + lr * sum(r * zb for r, (_, zb) in zip(normalised, zs)) / n
    return w, b


@pytest.mark.parametrize("problem", ["quadratic", "logistic"])
@pytest.mark.parametrize("n", [2, 5])
def test_es_independent_is_the_es_authors_population_rule(problem, n):
    model = problems()[problem]
    expected = es_authors(model, steps=6, n=n, lr=1e-2)
    opt, cfg = build("es", model, lr=1e-2, estimator="es_independent")
    assert cfg.forwards(n) == n  # one forward per member
    for _ in range(6):
        opt.step(Closure(model), n_queries=n)
    for got, want in zip((model.weight, model.bias), expected):
        assert torch.allclose(got.detach(), want, rtol=1e-9, atol=1e-11), (got, want)


def test_es_with_one_antithetic_pair_is_zo_benchs_sign_rule():
    """Two members z-score to +1 and -1: the step is lr sign(L+ - L-) z (ZO-Bench's zo_sign_opt), not lr g z."""
    model = problems()["quadratic"]
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    (zw, zb), = directions_of(w, b, 0, 1)
    sign = torch.sign(model.loss(w + EPS * zw, b + EPS * zb) - model.loss(w - EPS * zw, b - EPS * zb))
    opt, _ = build("es", model, lr=1e-2)
    opt.step(Closure(model), n_queries=1)
    assert torch.allclose(model.weight.detach(), w - 1e-2 * sign * zw, rtol=1e-9, atol=1e-12)
    assert torch.allclose(model.bias.detach(), b - 1e-2 * sign * zb, rtol=1e-9, atol=1e-12)


def test_zo_sgd_reference_agrees_with_the_engine():
    """The independent rules above are checked against the existing ZO-SGD too (the harness itself is right)."""
    model = problems()["quadratic"]
    expected = reference("zo_sgd", model, steps=5, q=2, lr=1e-2)
    opt, _ = build("zo_sgd", model, lr=1e-2)
    for _ in range(5):
        opt.step(Closure(model), n_queries=2)
    assert torch.allclose(model.weight.detach(), expected[0], rtol=1e-9, atol=1e-11)


ILL_LR = {"zo_sign": 1e-2, "zo_momentum": 1e-3, "zo_adam": 3e-2, "zo_cons": 1e-2, "es": 3e-2, "forward_grad": 3e-3}


@pytest.mark.parametrize("kind", KINDS)
def test_each_reduces_an_ill_conditioned_quadratic_from_a_held_out_start(kind):
    scales = torch.logspace(0, 2, 12, dtype=torch.float64).reshape(3, 4)  # condition number 100
    model = Quadratic(scales, start=1)
    start = float(model().detach())
    opt, _ = build(kind, model, lr=ILL_LR[kind])
    for _ in range(300):
        opt.step(Closure(model), n_queries=2)
    assert float(model()) < 0.2 * start, (kind, start, float(model()))


@pytest.mark.parametrize("kind", KINDS)
def test_resume_from_state_dict_continues_bit_for_bit(kind):
    a, b = problems()["quadratic"], problems()["quadratic"]
    opt_a, _ = build(kind, a, lr=LR[kind])
    for _ in range(3):
        opt_a.step(Closure(a), n_queries=2)
    state = opt_a.state_dict()
    b.load_state_dict(a.state_dict())
    opt_b, _ = build(kind, b, lr=LR[kind])
    opt_b.load_state_dict(state)
    for _ in range(3):
        opt_a.step(Closure(a), n_queries=2)
        opt_b.step(Closure(b), n_queries=2)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("kind", KINDS + ["zo_sgd"])
@pytest.mark.parametrize("q", [1, 4])
def test_forward_passes_are_what_the_config_declares(kind, q):
    model = problems()["logistic"]
    opt, cfg = build(kind, model, lr=LR.get(kind, 1e-3))
    closure = Closure(model)
    opt.step(closure, n_queries=q)
    assert opt.forward_passes == cfg.forwards(q)
    if kind != "forward_grad":  # a jvp runs the closure once, as its forward-mode pass
        assert closure.calls == cfg.forwards(q)


def test_state_bytes_are_each_rules_buffers():
    entries, width = 1000, 4
    declared = {k: OPTIMIZERS.config(k).state_bytes(entries, width) for k in KINDS + ["zo_sgd"]}
    assert declared["zo_adam"] == 2 * entries * width and declared["zo_momentum"] == entries * width
    assert declared["zo_sgd"] == declared["zo_sign"] == declared["es"] == declared["forward_grad"] == 0
    # the measured state of a stepped optimizer is what its config declares
    for kind in ("zo_adam", "zo_momentum"):
        model = Quadratic(torch.ones(10, 100, dtype=torch.float64)).float()
        opt, cfg = build(kind, model)
        opt.step(Closure(model), n_queries=1)
        kept = sum(t.numel() * t.element_size() for slot in opt.rule.state for t in slot.values() if t.dim())
        trained = sum(p.numel() for p in model.parameters())
        assert kept == cfg.state_bytes(trained, 4), kind


def test_sign_moves_every_unmasked_entry_by_exactly_lr():
    model = problems()["quadratic"]
    before = model.weight.detach().clone()
    opt, _ = build("zo_sign", model, lr=1e-3)
    opt.step(Closure(model), n_queries=1)
    moved = (model.weight.detach() - before).abs()
    assert torch.allclose(moved, torch.full_like(moved, 1e-3), rtol=0, atol=1e-15)


def test_cons_never_ends_a_step_above_where_it_started():
    model = problems()["logistic"]
    opt, _ = build("zo_cons", model, lr=5.0)  # a step far too large: the candidates must refuse it
    for _ in range(10):
        before = float(model())
        opt.step(Closure(model), n_queries=1)
        assert float(model()) <= before


def test_es_step_does_not_scale_with_the_loss():
    a, b = problems()["logistic"], problems()["logistic"]
    scaled_call = lambda: 1000.0 * b()  # noqa: E731
    scaled_call.model = b  # type: ignore[attr-defined]
    opt_a, _ = build("es", a, lr=1e-2)
    opt_b, _ = build("es", b, lr=1e-2)
    opt_a.step(Closure(a), n_queries=3)
    opt_b.step(scaled_call, n_queries=3)
    assert torch.allclose(a.weight, b.weight, rtol=1e-12, atol=1e-14)


def test_forward_grad_matches_the_exact_directional_derivative_on_a_tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [model.model.layers[0].self_attn.q_proj.weight, model.lm_head.weight]
    for p in trained:
        p.requires_grad_(True)
    ids = torch.randint(0, 64, (2, 8))
    closure = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    closure.model = model  # type: ignore[attr-defined]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = OPTIMIZERS.get("forward_grad").builder(named, OPTIMIZERS.config("forward_grad", {"lr": 1e-3}), SEED)
    order = [p for g in opt.param_groups for p in g["params"]]
    z = directions(order, query_seed(SEED, 0, 0))
    grads = torch.autograd.grad(closure(), order)
    exact = sum(float((g * zi).sum()) for g, zi in zip(grads, z))
    with torch.no_grad():
        opt.step(closure, n_queries=1)
    assert math.isclose(float(opt.last_projected_grads[0]), exact, rel_tol=1e-4)
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())  # the jvp's swap is undone


@pytest.mark.parametrize("values, field", [
    ({"momentum": 1.0}, "momentum"), ({"betas": [0.9, 1.2]}, "betas"), ({"adam_eps": 0.0}, "adam_eps"),
    ({"estimator": "nosuch"}, "estimator"),
])
def test_config_errors_name_the_field(values, field):
    kind = {"momentum": "zo_momentum", "betas": "zo_adam", "adam_eps": "zo_adam", "estimator": "zo_sgd"}[field]
    with pytest.raises(ConfigError, match=f"method.optimizer.{field}"):
        OPTIMIZERS.config(kind, values)


def test_forward_grad_refuses_batched_queries_and_objectives_without_a_model():
    with pytest.raises(ConfigError, match="method.optimizer.batched_queries=false"):
        OPTIMIZERS.config("forward_grad", {"batched_queries": True})
    model = problems()["quadratic"]
    opt, _ = build("forward_grad", model)
    with pytest.raises(ConfigError, match="closure exposes its model"):
        opt.step(lambda: model(), n_queries=1)


def test_capabilities_are_declared_not_inferred():
    assert OPTIMIZERS.config("zo_cons").parallel_modes == ()
    assert OPTIMIZERS.config("forward_grad").parallel_modes == ()
    assert OPTIMIZERS.config("es").parallel_modes == OPTIMIZERS.config("zo_sgd").parallel_modes
    assert OPTIMIZERS.config("forward_grad").forwards_per_query == 1
    assert OPTIMIZERS.config("es").forwards_per_query == 2
    assert OPTIMIZERS.config("zo_cons").forwards(2) == 4 + 3
    assert OPTIMIZERS.config("zo_sgd", {"estimator": "one_sided"}).forwards(3) == 4


# --- through the runner: every trainable set, any schedule, resume ----------------------------------------------

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from helpers import write_fixture_data

    return write_fixture_data(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("kind, method", [
    ("zo_adam", "adazeta"), ("zo_momentum", "mezo_lora"), ("zo_sign", "mezo"), ("zo_cons", "mezo_adapter"),
    ("es", "adazeta"), ("forward_grad", "mezo_lora"),
])
def test_each_optimizer_runs_end_to_end_on_any_trainable_set(kind, method, data_dir, tmp_path):
    import csv

    from adazeta.run import run
    from helpers import compose_cfg, tiny_overrides

    overrides = tiny_overrides(
        data_dir, f"method={method}", f"optimizer@method.optimizer={kind}", "schedule=adaptive", "schedule.alpha=2",
        "schedule.beta=1", "data.num_train=8", "data.num_dev=8", "data.num_eval=8")
    record = run(compose_cfg(overrides), tmp_path / "run")
    assert record["status"] == "finished", record.get("reason")
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    queries = [int(r["n_queries"]) for r in rows]
    assert queries == [1, 1, 2, 2]
    declared = OPTIMIZERS.config(kind)
    assert int(rows[-1]["forward_passes"]) == sum(declared.forwards(q) for q in queries)


@pytest.mark.parametrize("kind", ["zo_cons", "forward_grad"])
def test_an_optimizer_without_a_parallel_mode_is_refused_on_several_processes(kind, data_dir, tmp_path, monkeypatch):
    from adazeta.run import run
    from helpers import compose_cfg, tiny_overrides

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=f"optimizer '{kind}' cannot spread its work over processes"):
        run(compose_cfg(tiny_overrides(data_dir, "method=mezo_lora", f"optimizer@method.optimizer={kind}")),
            tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before any work


def test_memory_benchmark_has_a_row_per_optimizer_with_its_forwards(data_dir):
    import argparse

    from adazeta.tools import bench_memory

    assert {f"adazeta+{k}" for k in KINDS} <= set(bench_memory.METHODS)
    assert bench_memory.row_overrides("adazeta+zo_adam") == ["method=adazeta", "optimizer@method.optimizer=zo_adam"]
    args = argparse.Namespace(model="tiny-llama", task="rte", batch_size=4, steps=2, set=[f"data.dir={data_dir}"])
    for kind in ("zo_cons", "forward_grad"):
        row = bench_memory.worker(f"adazeta+{kind}", args)
        # the adazeta method's schedule asks one query a step at its first epoch
        assert row["forwards_per_step"] == OPTIMIZERS.config(kind).forwards(1), row
        assert row["s_per_forward"] > 0 and row["peak_mem_mb"] > 0


def test_every_zo_optimizer_is_zosgd_composed_of_an_estimator_and_a_rule():
    """Every registered ZO optimizer is a ``ZOSGD`` built from its config that composes an estimator and an update
    rule and overrides none of ZOSGD's step: the shared estimators are the registered objects themselves, the
    optimizers with directions of their own (HiZOO, LOZO, ZO-Muon) bring theirs, and a config's estimator name
    picks the estimator of a plain ZO-SGD."""
    from adazeta.optim.engine import Estimator, UpdateRule, estimator
    from adazeta.optim.own_directions import OwnDirections
    from adazeta.optim.zo_sgd import ZOSGD

    kinds = [k for k in OPTIMIZERS.names() if OPTIMIZERS.get(k).config_cls.zeroth_order]
    assert {"zo_sgd", "hizoo", "lozo", "zo_muon", "es", "forward_grad", "zo_adam"} <= set(kinds)
    for kind in kinds:
        cfg = OPTIMIZERS.config(kind, {})
        opt = OPTIMIZERS.get(kind).builder([("w", nn.Parameter(torch.zeros(3, 2)))], cfg, SEED)
        assert isinstance(opt, ZOSGD) and opt.config is cfg, kind
        assert isinstance(opt.estimator, Estimator) and isinstance(opt.rule, UpdateRule), kind
        assert all(getattr(type(opt), name) is getattr(ZOSGD, name) for name in ("step", "intended_update")), kind
        if kind in ("hizoo", "lozo", "zo_muon"):
            assert isinstance(opt.estimator, OwnDirections) and opt.estimator.name == kind
        else:
            assert opt.estimator is estimator(cfg.estimator), kind
    one_sided = OPTIMIZERS.config("zo_sgd", {"estimator": "one_sided"})
    assert OPTIMIZERS.get("zo_sgd").builder([("w", nn.Parameter(torch.zeros(2)))], one_sided, 0).estimator.forwards(3) == 4
