"""ZO-SGD and its pure SPSA pieces (MeZO's estimator, Q queries): estimate, restore, reproducibility, update rules."""

import copy

import pytest
import torch
from torch import nn

import adazeta.optim.first_order  # noqa: F401  (registers "adamw")
from adazeta.errors import ConfigError
from adazeta.optim import OPTIMIZERS
from adazeta.optim.spsa import decay_groups, perturb_, projected_gradient, query_seed, zo_update_
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.down = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(x))))


def small_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SmallNet()


def regression(device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    return x.to(device), (x @ torch.randn(8, 3, generator=g)).to(device)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# --- estimator ---------------------------------------------------------------------------------------------


def test_many_query_estimate_points_along_the_true_gradient() -> None:
    torch.manual_seed(0)
    d = 50
    basis, _ = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))
    a = basis @ torch.diag(torch.linspace(0.5, 5.0, d, dtype=torch.float64)) @ basis.T
    w = nn.Parameter(torch.randn(d, dtype=torch.float64))
    w0 = w.detach().clone()
    true_grad = a @ w0  # grad of 0.5 w^T A w

    lr = 1.0
    opt = ZOSGD([w], ZOSGDConfig(lr=lr), n_queries=2000, seed=3)
    opt.step(lambda: 0.5 * w @ a @ w)
    estimate = (w0 - w.detach()) / lr

    assert torch.cosine_similarity(estimate, true_grad, dim=0) > 0.9
    # For a quadratic the central difference is exact: each projected gradient is <A w0, z_q>.
    assert opt.last_projected_grads.shape == (2000,)


def test_projected_gradient_is_the_central_difference() -> None:
    g = projected_gradient(torch.tensor(3.0), torch.tensor(1.0), eps=0.5)
    assert g.item() == pytest.approx(2.0)


def test_query_seeds_are_distinct_deterministic_and_63_bit() -> None:
    seeds = {query_seed(7, step, q) for step in range(100) for q in range(20)}
    assert len(seeds) == 2000
    assert all(0 <= s < 2**63 for s in seeds)
    assert query_seed(7, 3, 1) == query_seed(7, 3, 1)
    assert query_seed(7, 3, 1) != query_seed(8, 3, 1)


# --- perturbation ------------------------------------------------------------------------------------------


def test_plus_minus_plus_perturbation_restores_the_parameters() -> None:
    net = small_net()
    params = list(net.parameters())
    before = flat(net).clone()
    eps = 1e-3
    perturb_(params, seed=123, scale=eps)
    assert not torch.equal(flat(net), before)  # it did move
    perturb_(params, seed=123, scale=-2 * eps)
    perturb_(params, seed=123, scale=eps)
    assert (flat(net) - before).norm() / before.norm() <= 1e-6


def test_a_step_with_zero_lr_leaves_the_parameters_in_place() -> None:
    net = small_net()
    x, y = regression()
    before = flat(net).clone()
    opt = ZOSGD(net.parameters(), ZOSGDConfig(lr=0.0), n_queries=4)
    opt.step(lambda: nn.functional.mse_loss(net(x), y))
    assert (flat(net) - before).norm() / before.norm() <= 1e-6


def test_masks_restrict_perturbation_and_update_to_masked_entries() -> None:
    w = torch.zeros(4, 5)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[1, 2] = mask[3, 0] = True
    perturb_([w], seed=5, scale=1.0, masks=[mask])
    assert (w[~mask] == 0).all() and (w[mask] != 0).all()

    v = torch.zeros(4, 5)
    zo_update_([v], seeds=[5], grads=[torch.tensor(-1.0)], lr=1.0, weight_decays=[0.0], masks=[mask])
    assert torch.equal(v, w)  # the update regenerates the very z of the perturbation


# --- optimisation ------------------------------------------------------------------------------------------


def test_zo_sgd_decreases_a_convex_loss() -> None:
    torch.manual_seed(0)
    x, y = regression()
    model = nn.Linear(8, 3)
    opt = ZOSGD(model.parameters(), ZOSGDConfig(lr=0.02), seed=1)

    def closure() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    with torch.no_grad():
        start = closure().item()
    for _ in range(200):
        opt.step(closure)
    with torch.no_grad():
        end = closure().item()
    assert end < 0.25 * start


def run_steps(seed: int, steps: int = 5, global_seed: int = 0, device: str = "cpu") -> torch.Tensor:
    net = small_net().to(device)
    x, y = regression(device)
    opt = ZOSGD(net.parameters(), ZOSGDConfig(lr=1e-2, weight_decay=0.01), seed=seed, n_queries=2)
    torch.manual_seed(global_seed)  # the optimizer must not depend on the global RNG
    for _ in range(steps):
        opt.step(lambda: nn.functional.mse_loss(net(x), y))
    return flat(net).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_is_bitwise_reproducible_and_ignores_the_global_rng(device: str) -> None:
    a = run_steps(seed=0, device=device)
    assert torch.equal(a, run_steps(seed=0, global_seed=123, device=device))
    assert not torch.equal(a, run_steps(seed=1, device=device))


def test_step_leaves_the_global_rng_untouched() -> None:
    net = small_net()
    x, y = regression()
    opt = ZOSGD(net.parameters(), ZOSGDConfig(lr=1e-2), n_queries=3)
    state = torch.get_rng_state()
    opt.step(lambda: nn.functional.mse_loss(net(x), y))
    assert torch.equal(state, torch.get_rng_state())


def test_state_dict_round_trip_resumes_the_same_directions() -> None:
    x, y = regression()
    net = small_net()
    opt = ZOSGD(net.parameters(), ZOSGDConfig(lr=1e-2), seed=4)
    for _ in range(3):
        opt.step(lambda: nn.functional.mse_loss(net(x), y))

    resumed_net = copy.deepcopy(net)
    resumed = ZOSGD(resumed_net.parameters(), ZOSGDConfig(lr=1e-2), seed=99)
    resumed.load_state_dict(opt.state_dict())
    assert (resumed.state_step, resumed.seed, resumed.forward_passes) == (3, 4, 6)

    opt.step(lambda: nn.functional.mse_loss(net(x), y))
    resumed.step(lambda: nn.functional.mse_loss(resumed_net(x), y))
    assert torch.equal(flat(net), flat(resumed_net))


# --- update rule -------------------------------------------------------------------------------------------


def test_weight_decay_spares_biases_and_norms() -> None:
    net = small_net()
    named = list(net.named_parameters())
    before = {name: p.detach().clone() for name, p in named}
    lr, wd = 0.1, 0.5
    opt = OPTIMIZERS.get("zo_sgd").builder(named, ZOSGDConfig(lr=lr, weight_decay=wd), seed=0)
    opt.step(lambda: torch.tensor(1.0))  # constant loss: zero projected gradient, only decay acts

    for name, p in named:
        if name.endswith("bias") or name.startswith("norm."):
            # Only the +eps, -2 eps, +eps round trip's rounding may show; a 5 % decay would not pass.
            torch.testing.assert_close(p.detach(), before[name], rtol=1e-6, atol=1e-7)
        else:
            torch.testing.assert_close(p.detach(), before[name] * (1 - lr * wd), rtol=1e-6, atol=1e-7)


def test_decay_groups_split_by_name() -> None:
    names = ["layers.0.mlp.down.weight", "layers.0.mlp.down.bias", "model.norm.weight", "h.0.ln_1.weight",
             "encoder.LayerNorm.weight", "layers.0.input_layernorm.weight"]
    groups = decay_groups([(n, nn.Parameter(torch.zeros(1))) for n in names], weight_decay=0.01)
    by_decay = {g["weight_decay"]: g["param_names"] for g in groups}
    assert by_decay[0.01] == ["layers.0.mlp.down.weight"]
    assert by_decay[0.0] == names[1:]


def test_sum_reduction_takes_q_times_the_mean_step() -> None:
    x, y = (t.double() for t in regression())  # fp64: the tiny deltas must not drown in rounding
    deltas = {}
    for reduction in ("mean", "sum"):
        net = small_net().double()
        before = flat(net).clone()
        opt = ZOSGD(net.parameters(), ZOSGDConfig(lr=1e-3, reduction=reduction), n_queries=4)
        opt.step(lambda: nn.functional.mse_loss(net(x), y))
        deltas[reduction] = flat(net) - before
    torch.testing.assert_close(deltas["sum"], 4 * deltas["mean"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("estimator", "expected"), [("central", 6), ("one_sided", 4)])
def test_forward_pass_count(estimator: str, expected: int) -> None:
    net = small_net()
    x, y = regression()
    calls = []

    def closure() -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return nn.functional.mse_loss(net(x), y)

    opt = ZOSGD(net.parameters(), ZOSGDConfig(lr=1e-3, estimator=estimator))
    loss = opt.step(closure, n_queries=3)
    assert len(calls) == expected == opt.forward_passes
    assert opt.last_losses.shape == (expected,) and opt.last_projected_grads.shape == (3,)
    torch.testing.assert_close(loss, opt.last_losses.mean())
    assert not any(calls), "the closure ran with autograd enabled"


def test_one_sided_estimate_is_the_forward_difference() -> None:
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = ZOSGD([w], ZOSGDConfig(lr=0.0, eps=1e-4, estimator="one_sided"), n_queries=2)
    opt.step(lambda: (w * torch.tensor([3.0, 1.0, -2.0], dtype=torch.float64)).sum())
    losses, grads = opt.last_losses, opt.last_projected_grads
    torch.testing.assert_close(grads, (losses[1:] - losses[0]) / 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_never_syncs_with_the_host_on_cuda() -> None:
    net = small_net().cuda()
    x, y = regression("cuda")
    opt = ZOSGD(net.parameters(), ZOSGDConfig(lr=1e-3, weight_decay=0.01), n_queries=3)
    closure = lambda: nn.functional.mse_loss(net(x), y)  # noqa: E731
    opt.step(closure)  # warm-up: lazy CUDA initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = opt.step(closure)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.device.type == "cuda"


# --- configuration -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps": 0.0}, "eps=0.0 must be > 0"),
        ({"weight_decay": -1.0}, "weight_decay=-1.0 must be >= 0"),
        ({"reduction": "max"}, "reduction='max' must be one of mean, sum"),
        ({"estimator": "forward"}, "estimator='forward' must be one of central, es, es_independent, forward_grad, one_sided"),
        ({"query_chunk": 0}, "query_chunk=0 must be an int >= 1"),
        ({"query_memory": 0}, "query_memory=0 must be a number > 0"),
        ({"noise": "pink"}, "noise='pink' must be one of"),
    ],
)
def test_bad_hyper_parameters_fail_when_the_config_is_made(kwargs: dict, message: str) -> None:
    """Each ZO-SGD setting is checked once, by its config: the optimizer built from it checks nothing again."""
    with pytest.raises(ConfigError, match=message):
        ZOSGDConfig(**kwargs)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.eps=0(\.0)? must be > 0"):
        OPTIMIZERS.config("zo_sgd", {"eps": 0})
    with pytest.raises(ConfigError, match=r"optimizer\.betas"):
        OPTIMIZERS.config("adamw", {"betas": [0.9, 1.5]})


def test_a_run_refuses_a_learning_rate_of_zero_that_the_optimizer_config_takes(fixture_data) -> None:
    """A run's lr=0 would never move a weight (and stall with a misleading hint): the settings refuse it, once, for
    every optimizer; the config and the class take 0, for a tool that estimates without stepping."""
    from adazeta.settings import parse
    from helpers import compose_cfg, tiny_overrides

    for method in ("mezo", "lora"):
        with pytest.raises(ConfigError, match=r"method\.optimizer\.lr=0(\.0)? must be > 0: a learning rate of"):
            parse(compose_cfg(tiny_overrides(fixture_data, f"method={method}", "method.optimizer.lr=0")))
    for kind in ("zo_sgd", "adamw"):
        assert OPTIMIZERS.config(kind, {"lr": 0}).lr == 0
    w = nn.Parameter(torch.ones(2))
    ZOSGD([w], ZOSGDConfig(lr=0.0)).step(lambda: (w * w).sum())
    assert torch.equal(w.detach(), torch.ones(2))


def test_a_bad_query_count_from_the_loop_fails_at_step() -> None:
    w = nn.Parameter(torch.zeros(2))
    opt = ZOSGD([w])
    with pytest.raises(ConfigError, match="n_queries=0"):
        opt.step(lambda: w.sum(), n_queries=0)


def test_adamw_builder_decays_weights_only_and_is_first_order() -> None:
    named = list(small_net().named_parameters())
    opt = OPTIMIZERS.get("adamw").builder(named, OPTIMIZERS.config("adamw", {"weight_decay": 0.1}), seed=0)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.zeroth_order is False
    decays = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert decays == {
        "up.weight": 0.1, "up.bias": 0.0, "norm.weight": 0.0, "norm.bias": 0.0, "down.weight": 0.1, "down.bias": 0.0
    }


def test_an_optimizer_must_declare_its_side_of_the_loops_contract() -> None:
    from adazeta.optim import check_contract, zeroth_order

    w = nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match="'sgd' built a SGD without a bool `zeroth_order`"):
        check_contract("sgd", torch.optim.SGD([w], lr=0.1))
    assert zeroth_order(check_contract("zo_sgd", ZOSGD([w]))) is True
    assert zeroth_order(None) is False
