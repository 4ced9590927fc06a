"""HiZOO, LOZO and ZO-Muon: each registered optimizer moves the parameters as an independent few-line
implementation of its paper's rule does (same directions, float64, several steps, Q = 1, 3 and a varying Q),
reduces an ill-conditioned quadratic, resumes bit for bit, counts its forwards and refuses what it cannot do.

The reference implementations below use nothing of the project's but the seeds (``query_seed``, ``subspace_seed``),
to draw the same directions from the same ``torch.Generator``s in the same order: the engine's per-tensor Gaussian
stream for HiZOO; for LOZO and ZO-Muon, per query one generator drawing U (m x r) / u (r x n) for each matrix and z
for each vector in the parameters' order, and per window one drawing V (n x r) / the Gaussian behind P.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.spsa import mask_seed, query_seed, subspace_seed
from adazeta.optim.zo_muon import newton_schulz5, orthonormal_basis

F64 = torch.float64
SEED = 7
KINDS = ("hizoo", "lozo", "zo_muon")
# Settings that make every part of each rule count: Sigma moves (hessian_smooth), the window changes within the
# steps (step_interval), P's rank is clamped on the 2 x 6 view of the 3-D core, weights decay, biases do not.
SETTINGS = {
    "hizoo": {"lr": 1e-3, "eps": 1e-2, "weight_decay": 0.1, "hessian_smooth": 0.1},
    "lozo": {"lr": 1e-3, "eps": 1e-2, "weight_decay": 0.1, "rank": 2, "step_interval": 2},
    "zo_muon": {"lr": 1e-2, "vector_lr": 1e-3, "eps": 1e-2, "weight_decay": 0.1, "rank": 3, "step_interval": 2},
}
SCHEDULES = {"Q=1": [1] * 5, "Q=3": [3] * 5, "Q varies": [1, 3, 2, 1, 3]}


# ---- problems: named float64 parameters and a loss of the parameter list --------------------------------------

def quadratic(kappa: float = 100.0, start_seed: int = 1):
    """0.5 sum_i h_i (x_i - x*_i)^2 over a TT-like 3-D core, a 2-D weight and a 1-D bias; h log-spaced in [1, kappa]."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"core": (2, 3, 2), "weight": (4, 6), "bias": (4,)}
    n = sum(math.prod(s) for s in shapes.values())
    h = torch.logspace(0, math.log10(kappa), n, dtype=F64)[torch.randperm(n, generator=gen)]
    target = torch.randn(n, generator=gen, dtype=F64)
    start = torch.Generator().manual_seed(start_seed)  # held out: not the seed of the problem or the directions
    named = [(k, nn.Parameter(torch.randn(s, generator=start, dtype=F64))) for k, s in shapes.items()]

    def loss(ws):
        x = torch.cat([w.reshape(-1) for w in ws])
        return 0.5 * (h * (x - target) ** 2).sum()

    return named, loss


def logistic():
    """Multinomial logistic regression (a Linear(6, 3): 2-D weight, 1-D bias) on 64 separable points."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=gen, dtype=F64)
    y = (x @ torch.randn(3, 6, generator=gen, dtype=F64).T).argmax(1)
    model = nn.Linear(6, 3).double()
    with torch.no_grad():
        model.weight.copy_(0.1 * torch.randn(3, 6, generator=gen, dtype=F64))
        model.bias.zero_()
    return list(model.named_parameters()), lambda ws: F.cross_entropy(x @ ws[0].T + ws[1], y)


PROBLEMS = {"quadratic": quadratic, "logistic": logistic}


def build(kind: str, named, settings: dict, seed: int = SEED):
    return OPTIMIZERS.get(kind).builder(named, OPTIMIZERS.config(kind, settings), seed)


def run(kind: str, named, loss, schedule, settings: dict, still: bool = False, **attrs) -> list[torch.Tensor]:
    """The parameters after steps of ``schedule``; ``still``: every rate set to 0 on the built optimizer (a run's
    config refuses lr = 0, the class takes it), so the steps only perturb and restore."""
    opt = build(kind, named, settings)
    if still:
        for group in opt.param_groups:
            group["lr"] = 0.0
        if hasattr(opt.rule, "vector_lr"):  # ZO-Muon's vectors step with a rate of their own
            opt.rule.vector_lr = 0.0
    for key, value in attrs.items():
        setattr(opt, key, value)
    params = [p for _, p in named]
    for q in schedule:
        opt.step(lambda: loss(params), n_queries=q)
    return [p.detach().clone() for p in params]


# ---- the papers' rules, written again ---------------------------------------------------------------------------

def ref_hizoo(loss, ws, decays, schedule, lr, eps, weight_decay, hessian_smooth):
    """HiZOO (Zhao et al. 2025, Algorithm 1); Q > 1: Sigma from the mean estimate, then the mean of the g's."""
    a = hessian_smooth
    ws = [w.detach().clone() for w in ws]
    sigma = [torch.ones_like(w) for w in ws]
    for k, n in enumerate(schedule):
        l0 = loss(ws)
        zs, gs, hs = [], [], []
        for q in range(n):
            gen = torch.Generator().manual_seed(query_seed(SEED, k, q))
            z = [torch.randn(w.shape, generator=gen, dtype=F64) for w in ws]
            plus = loss([w + eps * zi / s.sqrt() for w, zi, s in zip(ws, z, sigma)])
            minus = loss([w - eps * zi / s.sqrt() for w, zi, s in zip(ws, z, sigma)])
            zs.append(z)
            gs.append((plus - minus) / (2 * eps))
            hs.append((plus + minus - 2 * l0).abs() / (2 * eps**2))
        sigma = [(1 - a) * s + a * sum(h * s * z[i] ** 2 for h, z in zip(hs, zs)) / n for i, s in enumerate(sigma)]
        ws = [w - lr * (sum(g * z[i] for g, z in zip(gs, zs)) / n / sigma[i].sqrt() + weight_decay * d * w)
              for i, (w, d) in enumerate(zip(ws, decays))]
    return ws


def ref_lozo(loss, ws, decays, schedule, lr, eps, weight_decay, rank, step_interval, divide_by_rank=True):
    """LOZO (Chen et al. 2025, Algorithm 1): d = U V^T, V per window, central differences; g divided by r as in
    ZO-Muon's copy of the trainer, or (``divide_by_rank=False``) by 2 eps alone, as the authors' LOZOtrainer.py 790:
    ``projected_grad = ((loss1 - loss2) / (2 * self.args.zo_eps)).item()``."""
    scale = rank if divide_by_rank else 1
    ws = [w.detach().clone() for w in ws]
    for k, n in enumerate(schedule):
        window = torch.Generator().manual_seed(subspace_seed(SEED, k // step_interval))
        vs = [torch.randn(w.numel() // w.shape[0], rank, generator=window, dtype=F64) if w.dim() >= 2 else None
              for w in ws]
        ds, gs = [], []
        for q in range(n):
            gen = torch.Generator().manual_seed(query_seed(SEED, k, q))
            d = [(torch.randn(w.shape[0], rank, generator=gen, dtype=F64) @ v.T).reshape(w.shape) if v is not None
                 else torch.randn(w.shape, generator=gen, dtype=F64) for w, v in zip(ws, vs)]
            plus = loss([w + eps * di for w, di in zip(ws, d)])
            minus = loss([w - eps * di for w, di in zip(ws, d)])
            ds.append(d)
            gs.append((plus - minus) / (2 * eps * scale))
        ws = [w - lr * (sum(g * d[i] for g, d in zip(gs, ds)) / n + weight_decay * dec * w)
              for i, (w, dec) in enumerate(zip(ws, decays))]
    return ws


def ns5(g, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = g.shape[0] > g.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        xx = x @ x.T
        x = a * x + (b * xx + c * xx @ xx) @ x
    return x.T if tall else x


def ref_zo_muon(loss, ws, decays, schedule, lr, vector_lr, eps, weight_decay, rank, step_interval, central=False):
    """ZO-Muon: P (QR, signs of R) per window, d = P u, one-sided with a shared L(w), w -= lr (P NS5(R) + wd w)."""
    ws = [w.detach().clone() for w in ws]
    for k, n in enumerate(schedule):
        window = torch.Generator().manual_seed(subspace_seed(SEED, k // step_interval))
        ps = []
        for w in ws:
            if w.dim() < 2:
                ps.append(None)
                continue
            q_, r_ = torch.linalg.qr(torch.randn(w.shape[0], min(rank, w.shape[0]), generator=window, dtype=F64))
            ps.append(q_ * torch.sign(torch.diagonal(r_)))
        l0 = loss(ws)
        us, gs = [], []
        for q in range(n):
            gen = torch.Generator().manual_seed(query_seed(SEED, k, q))
            u = [torch.randn(p.shape[1], w.numel() // w.shape[0], generator=gen, dtype=F64) if p is not None
                 else torch.randn(w.shape, generator=gen, dtype=F64) for w, p in zip(ws, ps)]
            d = [(p @ ui).reshape(w.shape) if p is not None else ui for w, p, ui in zip(ws, ps, u)]
            plus = loss([w + eps * di for w, di in zip(ws, d)])
            if central:
                gs.append((plus - loss([w - eps * di for w, di in zip(ws, d)])) / (2 * eps))
            else:
                gs.append((plus - l0) / eps)
            us.append(u)
        new = []
        for i, (w, p, dec) in enumerate(zip(ws, ps, decays)):
            r_hat = sum(g * u[i] for g, u in zip(gs, us)) / n
            step, step_lr = ((p @ ns5(r_hat)).reshape(w.shape), lr) if p is not None else (r_hat, vector_lr)
            new.append(w - step_lr * (step + weight_decay * dec * w))
        ws = new
    return ws


def reference(kind, named, loss, schedule, settings, **extra):
    ws = [p.detach().clone() for _, p in named]
    decays = [0.0 if "bias" in name else 1.0 for name, _ in named]
    rule = {"hizoo": ref_hizoo, "lozo": ref_lozo, "zo_muon": ref_zo_muon}[kind]
    return rule(loss, ws, decays, schedule, **settings, **extra)


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_registered_optimizer_follows_the_papers_rule(kind, problem, schedule):
    named, loss = PROBLEMS[problem]()
    expected = reference(kind, named, loss, schedule, SETTINGS[kind])
    got = run(kind, named, loss, schedule, SETTINGS[kind])
    start = [p.detach() for _, p in PROBLEMS[problem]()[0]]
    assert all(not torch.allclose(g, s) for g, s in zip(got, start))  # every parameter moved
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("problem", PROBLEMS)
def test_lozo_at_the_authors_scale_takes_r_times_the_step(problem):
    """divide_by_rank=false: the LOZO authors' projected gradient (LOZOtrainer.py 790), no 1/r."""
    named, loss = PROBLEMS[problem]()
    settings = {**SETTINGS["lozo"], "divide_by_rank": False}
    expected = reference("lozo", named, loss, SCHEDULES["Q=1"], settings)
    for g, e in zip(run("lozo", named, loss, SCHEDULES["Q=1"], settings), expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    named, loss = PROBLEMS[problem]()  # afresh: run() moved the parameters
    start = [p.detach() for _, p in named]
    scaled = reference("lozo", named, loss, [1], {**settings, "weight_decay": 0.0})
    divided = reference("lozo", named, loss, [1], {**SETTINGS["lozo"], "weight_decay": 0.0})
    for s0, a, b in zip(start, scaled, divided):  # one step: r x the displacement of the divided rule
        torch.testing.assert_close(a - s0, SETTINGS["lozo"]["rank"] * (b - s0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("schedule", [[1] * 4, [3] * 4], ids=["Q=1", "Q=3"])
def test_zo_muon_central_is_the_references_single_sample_branch(schedule):
    named, loss = quadratic()
    settings = {**SETTINGS["zo_muon"], "estimator": "central"}
    expected = reference("zo_muon", named, loss, schedule, SETTINGS["zo_muon"], central=True)
    for g, e in zip(run("zo_muon", named, loss, schedule, settings), expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_a_large_set_restored_by_subtraction_and_redrawn_directions_follow_the_rule_too(kind):
    """Above KEEP_WEIGHTS_BYTES the perturbation is undone by the opposite one (ulps of drift), and above
    KEEP_DIRECTION_BYTES HiZOO redraws z a piece at a time: the same rule to rounding."""
    named, loss = quadratic()
    schedule = SCHEDULES["Q varies"]
    expected = reference(kind, named, loss, schedule, SETTINGS[kind])
    got = run(kind, named, loss, schedule, SETTINGS[kind], KEEP_WEIGHTS_BYTES=0, KEEP_DIRECTION_BYTES=0)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_each_perturbation_is_undone_exactly(kind):
    """lr = 0: the weights after the steps are the weights before, bit for bit (float32, where w + d - d is not w);
    the subtracting path, for a set too large to copy, is not exact, which is why small sets are copied."""
    settings = {**SETTINGS[kind], "weight_decay": 0.0}

    def float32_problem():
        named, loss = quadratic()
        return [(n, nn.Parameter(p.detach().float())) for n, p in named], lambda ws: loss([w.double() for w in ws])

    named, loss = float32_problem()
    before = [p.detach().clone() for _, p in named]
    assert all(torch.equal(a, b) for a, b in zip(run(kind, named, loss, [2, 1, 3], settings, still=True), before))
    named, loss = float32_problem()
    after = run(kind, named, loss, [2, 1, 3], settings, still=True, KEEP_WEIGHTS_BYTES=0)
    assert not all(torch.equal(a, b) for a, b in zip(after, before))


# Settings that reduce the quadratic (condition number 100) from a held-out start; hessian_smooth is HiZOO's default.
DESCENT = {
    "hizoo": {"lr": 3e-4, "eps": 1e-3},
    "lozo": {"lr": 1e-3, "eps": 1e-3, "rank": 2, "step_interval": 10},
    "zo_muon": {"lr": 1e-1, "vector_lr": 3e-4, "eps": 1e-3, "rank": 2, "step_interval": 10},
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_optimizer_reduces_an_ill_conditioned_quadratic(kind):
    named, loss = quadratic(kappa=100.0, start_seed=5)
    params = [p for _, p in named]
    first = loss(params).item()
    opt = build(kind, named, DESCENT[kind], seed=3)
    for _ in range(200):
        opt.step(lambda: loss(params), n_queries=2)
    assert loss(params).item() < 0.25 * first


@pytest.mark.parametrize("kind", KINDS)
def test_resume_continues_bit_for_bit(kind):
    """state_dict after 4 steps, loaded into a new optimizer (built with another seed: the checkpoint's wins) over a
    copy of the weights: the next 4 steps (across a window change) equal the uninterrupted run's."""
    settings = {**SETTINGS[kind], **({"step_interval": 3} if kind != "hizoo" else {})}
    named, loss = quadratic()
    params = [p for _, p in named]
    opt = build(kind, named, settings)
    for q in (1, 3, 2, 1):
        opt.step(lambda: loss(params), n_queries=q)
    saved = copy.deepcopy(opt.state_dict())
    copies = [(n, nn.Parameter(p.detach().clone())) for n, p in named]
    fresh = [(n, nn.Parameter(p.detach().clone())) for n, p in named]
    resumed = build(kind, copies, settings, seed=123)
    resumed.load_state_dict(saved)
    unloaded = build(kind, fresh, settings, seed=123)
    for q in (3, 1, 2, 3):
        for o, ps in ((opt, params), (resumed, [p for _, p in copies]), (unloaded, [p for _, p in fresh])):
            o.step(lambda ps=ps: loss(ps), n_queries=q)
    assert all(torch.equal(a, b) for a, (_, b) in zip(params, copies))
    assert resumed.forward_passes == opt.forward_passes and resumed.state_step == opt.state_step == 8
    assert not all(torch.equal(a, b) for a, (_, b) in zip(params, fresh))  # without the checkpoint: another run


@pytest.mark.parametrize("kind,estimator", [("hizoo", "central"), ("lozo", "central"), ("zo_muon", "one_sided"),
                                            ("zo_muon", "central")])
def test_forward_passes_are_what_the_config_declares(kind, estimator):
    named, loss = logistic()
    params = [p for _, p in named]
    cfg = OPTIMIZERS.config(kind, {"estimator": estimator})
    opt = OPTIMIZERS.get(kind).builder(named, cfg, SEED)
    calls = 0

    def closure():
        nonlocal calls
        calls += 1
        return loss(params)

    spent = 0
    for q in (1, 2, 4):
        opt.step(closure, n_queries=q)
        spent += cfg.forwards(q)
        assert opt.forward_passes == calls == spent
    expected = {"hizoo": (7, 2), "lozo": (6, 2), "zo_muon": (4, 1) if estimator == "one_sided" else (6, 2)}[kind]
    assert (cfg.forwards(3), cfg.forwards_per_query) == expected
    assert cfg.parallel_modes == () and cfg.batches_queries is False


@pytest.mark.parametrize("kind", KINDS)
def test_what_the_optimizers_cannot_do_is_refused_in_one_line(kind):
    with pytest.raises(ConfigError, match=r"method\.optimizer\.batched_queries=true: .*set method\.optimizer\."
                                          r"batched_queries=false") as err:
        OPTIMIZERS.config(kind, {"batched_queries": True})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"method\.optimizer\.estimator=es"):
        OPTIMIZERS.config(kind, {"estimator": "es"})
    key = {"hizoo": "hessian_smooth", "lozo": "rank", "zo_muon": "rank"}[kind]
    with pytest.raises(ConfigError, match=rf"method\.optimizer\.{key}="):
        OPTIMIZERS.config(kind, {key: 2.0 if kind == "hizoo" else 0})
    if kind == "hizoo":  # HiZOO's z is the engine's stream: every noise stream applies
        assert OPTIMIZERS.config(kind, {"noise": "flat"}).noise == "flat"
    else:
        with pytest.raises(ConfigError, match=r"method\.optimizer\.noise=flat"):
            OPTIMIZERS.config(kind, {"noise": "flat"})
    named, loss = logistic()
    opt = build(kind, named, {})
    with pytest.raises(ConfigError, match="one process"):  # a share of a distributed step
        opt.step(lambda: loss([p for _, p in named]), n_queries=2, plan=object())


@pytest.mark.parametrize("kind", KINDS)
def test_the_yaml_option_lists_the_dataclass_defaults(kind):
    from adazeta.settings import parse
    from helpers import compose_cfg

    s = parse(compose_cfg([f"optimizer@method.optimizer={kind}"]))
    assert s.optimizer.kind == kind and s.optimizer.config == OPTIMIZERS.config(kind, {})


def test_hizoo_keeps_one_sigma_per_parameter_in_its_checkpoint():
    named, loss = logistic()
    opt = build("hizoo", named, SETTINGS["hizoo"])
    opt.step(lambda: loss([p for _, p in named]), n_queries=2)
    state = opt.state_dict()["rule"]
    assert state["name"] == "hizoo"
    assert [tuple(s["hessian"].shape) for s in state["state"]] == [(3, 6), (3,)]
    assert all(not torch.equal(s["hessian"], torch.ones_like(s["hessian"])) for s in state["state"])
    assert OPTIMIZERS.config("hizoo", {}).state_bytes(10, 2) == 40  # Sigma in at least float32
    assert OPTIMIZERS.config("lozo", {}).state_bytes(10, 4) == OPTIMIZERS.config("zo_muon", {}).state_bytes(10, 4) == 0


def test_newton_schulz5_approximates_the_orthogonal_polar_factor():
    gen = torch.Generator().manual_seed(0)
    for shape in ((4, 9), (9, 4)):
        g = torch.randn(shape, generator=gen, dtype=F64)
        x = newton_schulz5(g)
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        singular = torch.linalg.svdvals(x)
        assert singular.min() > 0.6 and singular.max() < 1.25  # Muon's quintic: ~[0.7, 1.2], not exactly 1
        assert F.cosine_similarity(x.reshape(-1), (u @ vh).reshape(-1), dim=0) > 0.95
    torch.testing.assert_close(newton_schulz5(g.T), newton_schulz5(g).T)


def test_orthonormal_basis_is_q_of_qr_with_a_positive_r_diagonal():
    a_gen, p_gen = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    a = torch.randn(7, 3, generator=a_gen, dtype=F64)
    p = orthonormal_basis(7, 3, p_gen, F64, torch.device("cpu"))
    torch.testing.assert_close(p.T @ p, torch.eye(3, dtype=F64))
    r = p.T @ a  # a = P R with R upper-triangular, diagonal > 0: the unique such factorisation
    torch.testing.assert_close(r, r.triu())
    assert bool((torch.diagonal(r) > 0).all())


def test_the_subspace_seed_is_a_stream_of_its_own():
    seeds = {subspace_seed(0, k) for k in range(50)}
    assert len(seeds) == 50
    assert not seeds & ({mask_seed(0, k) for k in range(50)} | {query_seed(0, k, 0) for k in range(50)})
    assert subspace_seed(3, 2) == subspace_seed(3, 2) != subspace_seed(4, 2)


def test_zo_muon_at_one_query_keeps_only_the_sign_of_the_projected_gradient():
    """Q = 1: the matrices' step is sign(g) P NS5(u), so a loss passed through an increasing map (L^3: the same
    sign of every difference, other sizes) leaves every matrix where the plain loss puts it, while the vectors'
    ZO-SGD step changes; at Q = 3 the sizes of the g's mix, and the matrices move elsewhere too."""
    settings = {**SETTINGS["zo_muon"], "weight_decay": 0.0}

    def one_step(power, q):
        named, loss = quadratic()
        return run("zo_muon", named, lambda ws: loss(ws) ** power, [q], settings)

    start = [p.detach() for _, p in quadratic()[0]]
    plain, cubed = one_step(1, 1), one_step(3, 1)
    for name, a, b, w0 in zip(("core", "weight", "bias"), plain, cubed, start):
        assert not torch.allclose(a, w0) and not torch.allclose(b, w0)
        if name == "bias":
            assert not torch.allclose(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    plain3, cubed3 = one_step(1, 3), one_step(3, 3)
    assert not torch.allclose(plain3[1], cubed3[1]) and not torch.allclose(plain3[0], cubed3[0])
