"""The ZO noise streams: the default ``per_tensor`` stream gives, bit for bit, the directions, losses and updates
of the per-parameter implementation it replaced (kept below as the reference), for every kind of trainable set
and mask, whatever the chunking or the keeping of z; ``flat`` is its own, documented stream."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from adazeta.adapters import ADAPTERS
from adazeta.errors import ConfigError
from adazeta.models import ModelConfig, load_model
from adazeta.optim import spsa
from adazeta.optim.batched import ReplicaClosure
from adazeta.optim.sparse_mezo import SparseZOSGD, SparseZOSGDConfig
from adazeta.optim.spsa import PackedMask, RandomMask, directions, perturb_, projected_gradient, zo_update_
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig
from adazeta.scoring import Scorer
from adazeta.tasks.spec import Example


@pytest.fixture(autouse=True)
def _restore_by_the_opposite_perturbation(monkeypatch):
    """The reference implementations here restore w by the opposite perturbation, as every trainable set did before
    small sets were restored exactly from a copy (ZOSGD.KEEP_WEIGHTS_BYTES, tests/test_guards.py): the streams are
    compared on that path, bit for bit."""
    monkeypatch.setattr(ZOSGD, "KEEP_WEIGHTS_BYTES", 0)

# --- the per-parameter implementation of earlier releases: the reference the per_tensor stream must match ------


def _reference_masks(params, masks):
    if masks is None:
        return [None] * len(params)
    if isinstance(masks, RandomMask):
        return masks.for_params(params)
    return [m.dense() if isinstance(m, PackedMask) else m for m in masks]  # the bools earlier releases kept


class _ReferenceNoise:
    def __init__(self, seed):
        self.streams = spsa.Streams(seed)

    def draw(self, p, mask):
        z = torch.randn(p.shape, generator=self.streams.on(p.device), device=p.device, dtype=p.dtype)
        if mask is not None:
            z.mul_(mask)
        return z


@torch.no_grad()
def reference_perturb_(params, seed, scale, masks=None):
    noise = _ReferenceNoise(seed)
    for p, m in zip(params, _reference_masks(params, masks)):
        p.add_(noise.draw(p, m), alpha=scale)


@torch.no_grad()
def reference_update_(params, seeds, grads, lrs, wds, masks=None):
    coefs = torch.stack(list(grads)) * (1.0 / len(seeds))  # the mean reduction, as it was computed
    for p, p_lr, wd in zip(params, lrs, wds):
        if wd > 0:
            p.mul_(1.0 - p_lr * wd)
    for q, seed in enumerate(seeds):
        noise = _ReferenceNoise(seed)
        for p, p_lr, m in zip(params, lrs, _reference_masks(params, masks)):
            z = noise.draw(p, m)
            z.mul_(coefs[q] * -p_lr)
            p.add_(z)


@torch.no_grad()
def reference_step(opt: ZOSGD, closure):
    """One central-difference step of ``opt`` as the per-parameter implementation ran it."""
    params = [p for g in opt.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in opt.param_groups for _ in g["params"]]
    wds = [g["weight_decay"] for g in opt.param_groups for _ in g["params"]]
    seeds = [spsa.query_seed(opt.seed, opt.state_step, q) for q in range(opt.n_queries)]
    masks = opt.masks(params)
    losses, grads = [], []
    for seed in seeds:
        reference_perturb_(params, seed, opt.eps, masks)
        plus = closure().detach().float()
        reference_perturb_(params, seed, -2 * opt.eps, masks)
        minus = closure().detach().float()
        reference_perturb_(params, seed, opt.eps, masks)
        losses += [plus, minus]
        grads.append(projected_gradient(plus, minus, opt.eps))
    reference_update_(params, seeds, grads, lrs, wds, masks)
    opt.state_step += 1
    return torch.stack(losses), torch.stack(grads)


# --- models --------------------------------------------------------------------------------------------------

TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
EXAMPLES = [
    Example("the movie was", [" great fun", " bad"], 0),
    Example("a long plot, and then", [" it ended", " nothing happened"], 1),
    Example("short", ["Yes", "No"], 0),
]
KINDS = {  # adapter kind -> its config; "full": every weight (MeZO, Sparse-MeZO)
    "tt": {"bottleneck": 8, "rank": 2},
    "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
    "bottleneck": {"bottleneck": 8},
    "full": None,
}


def model_and_closure(kind: str):
    loaded = load_model(ModelConfig(name="t", random_init=True, architecture=TINY_LLAMA, device="cpu"), 1)
    if kind == "full":
        model = loaded.model.requires_grad_(True)
    else:
        entry = ADAPTERS.get(kind)
        torch.manual_seed(0)
        model = entry.builder(loaded.model, entry.config_cls(**KINDS[kind]))
        with torch.no_grad():  # move every adapter off its (possibly zero) init, so that each of them matters
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p), alpha=0.1)
    scorer = Scorer.of(model, loaded.tokenizer)
    batch = scorer.collate(scorer.encode(EXAMPLES, 64))
    return model, ReplicaClosure(model, functools.partial(scorer.replica_losses, batch))


def closure_of(model, closure):
    """``closure``'s losses, of the same batch, on another model (a copy)."""
    return ReplicaClosure(model, functools.partial(Scorer(model).replica_losses, *closure.losses.args))


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def optimizer(model, kind: str, mask: str | None, **kwargs):
    groups = [{"params": trainable(model)[::2], "weight_decay": 0.01},
              {"params": trainable(model)[1::2], "lr": 3e-3, "weight_decay": 0.0}]
    n_queries = kwargs.pop("n_queries", 3)
    settings = dict(lr=1e-2, eps=1e-2, **kwargs)
    if mask is not None:
        for g in groups:
            g["weight_decay"] = 0.0
        return SparseZOSGD(groups, SparseZOSGDConfig(sparsity=0.75, mask=mask, **settings), seed=7, n_queries=n_queries)
    return ZOSGD(groups, ZOSGDConfig(weight_decay=0.01, **settings), seed=7, n_queries=n_queries)


CASES = [("tt", None), ("lora", None), ("bottleneck", None), ("full", None), ("full", "magnitude"),
         ("full", "random")]


@pytest.mark.parametrize("draw_slice", [None, 48], ids=["whole draws", "sliced draws"])
@pytest.mark.parametrize("queries", [3, 1])  # one query and z regenerated: the restore is fused into the update
@pytest.mark.parametrize("keep", [True, False], ids=["z kept", "z regenerated"])
@pytest.mark.parametrize("kind,mask", CASES)
def test_per_tensor_steps_equal_the_per_parameter_implementation_bit_for_bit(kind, mask, keep, queries, draw_slice,
                                                                              monkeypatch):
    model, closure = model_and_closure(kind)
    twin = copy.deepcopy(model)
    twin_closure = closure_of(twin, closure)
    monkeypatch.setattr(ZOSGD, "KEEP_DIRECTION_BYTES", 2**30 if keep else 0)
    monkeypatch.setattr(spsa, "CHUNK_BYTES", 4096)  # many chunks, boundaries between and around tensors
    # Sliced: every weight of more than 96 entries drawn and moved 48 entries at a time (one pass's slice buffer).
    monkeypatch.setattr(spsa, "DRAW_SLICE", draw_slice or 2**40)
    new, old = optimizer(model, kind, mask, n_queries=queries), optimizer(twin, kind, mask, n_queries=queries)
    for _ in range(2):
        new.step(closure)
        losses, grads = reference_step(old, twin_closure)
        assert torch.equal(new.last_losses, losses) and torch.equal(new.last_projected_grads, grads)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(trainable(model), trainable(model_and_closure(kind)[0])))


@pytest.mark.parametrize("noise", ["per_tensor", "flat", "blocks"])
@pytest.mark.parametrize("estimator", ["central", "one_sided"])
@pytest.mark.parametrize("mask", [None, "magnitude", "random"])
def test_the_restore_fused_into_the_update_changes_no_number(mask, estimator, noise, monkeypatch):
    """A full model at Q = 1 undoes its last perturbation in the update's pass (one draw of z fewer): the weights,
    losses and projected gradients equal those of the separate restoring pass, with weight decay on some groups."""
    monkeypatch.setattr(ZOSGD, "KEEP_DIRECTION_BYTES", 0)
    monkeypatch.setattr(spsa, "CHUNK_BYTES", 4096)
    model, closure = model_and_closure("full")
    twin = copy.deepcopy(model)
    twin_closure = closure_of(twin, closure)
    fused = optimizer(model, "full", mask, n_queries=1, estimator=estimator, noise=noise)
    apart = optimizer(twin, "full", mask, n_queries=1, estimator=estimator, noise=noise)
    apart.FUSE_RESTORE = False
    monkeypatch.setattr(spsa, "DRAW_SLICE", 64)  # the larger weights drawn a slice at a time, the others whole
    draws = []
    real, real_sliced = spsa._draw_chunk, spsa._apply_sliced
    monkeypatch.setattr(spsa, "_draw_chunk", lambda *a: draws.append(1) or real(*a))
    monkeypatch.setattr(spsa, "_apply_sliced", lambda *a: draws.append(1) or real_sliced(*a))
    for _ in range(3):
        before = len(draws)
        fused.step(closure)
        fused_draws = len(draws) - before
        apart.step(twin_closure)
        passes = 4 if estimator == "central" else 3  # passes over z apart: +eps, -2eps, +eps, update (one-sided: 3)
        assert fused_draws * passes == (len(draws) - before - fused_draws) * (passes - 1)
        assert torch.equal(fused.last_losses, apart.last_losses)
        assert torch.equal(fused.last_projected_grads, apart.last_projected_grads)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["tt", "lora", "bottleneck"])
def test_batched_steps_draw_the_per_parameter_directions(kind):
    """Batched queries (replica weights) keep the same z: their update equals the reference's to rounding."""
    model, closure = model_and_closure(kind)
    twin = copy.deepcopy(model)
    twin_closure = closure_of(twin, closure)
    new, old = optimizer(model, kind, None, batched_queries=True, query_chunk=4), optimizer(twin, kind, None)
    new.step(closure)
    _, grads = reference_step(old, twin_closure)
    torch.testing.assert_close(new.last_projected_grads, grads, atol=2e-4, rtol=1e-3)
    for a, b in zip(trainable(model), trainable(twin)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_functions_match_the_reference_under_every_mask_and_chunking(monkeypatch):
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 8, 5), (5, 8, 5), (64,), (3,), (7, 11), (300,), (16,)] * 3
    params = [torch.randn(s, generator=g) for s in shapes] + [torch.randn(33, generator=g)]
    fixed = [torch.rand(p.shape, generator=g) < 0.3 for p in params]
    fixed[2] = PackedMask.pack(fixed[2])
    for chunk, draw_slice in ((64, 2**40), (1000, 2**40), (2**24, 2**40), (64, 16), (2**24, 32)):
        monkeypatch.setattr(spsa, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(spsa, "DRAW_SLICE", draw_slice)
        for masks in (None, fixed, RandomMask(3, 0.3)):
            new, old = [p.clone() for p in params], [p.clone() for p in params]
            perturb_(new, 11, 1e-3, masks)
            reference_perturb_(old, 11, 1e-3, masks)
            assert all(torch.equal(a, b) for a, b in zip(new, old))
            lrs = [1e-2 if i % 3 else 5e-3 for i in range(len(params))]
            wds = [0.1 if i % 2 else 0.0 for i in range(len(params))]
            grads = [torch.tensor(0.7), torch.tensor(-1.3)]
            zo_update_(new, [4, 5], grads, lrs, wds, masks=masks)
            reference_update_(old, [4, 5], grads, lrs, wds, masks)
            assert all(torch.equal(a, b) for a, b in zip(new, old))
            z, ref = directions(params, 9, masks), []
            reference_noise = _ReferenceNoise(9)
            ref = [reference_noise.draw(p, m) for p, m in zip(params, _reference_masks(params, masks))]
            assert all(torch.equal(a, b) for a, b in zip(z, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [97, 160, 1000, 1009, 4096 + 15, 3 * 1024 + 1])
def test_a_cpu_draw_in_slices_is_the_draw_of_one_call(numel, dtype, monkeypatch):
    """What sliced passes rest on: a CPU generator's ``normal_`` over consecutive slices of a multiple of 16
    entries, the last holding the remainder, fills the numbers of one ``torch.randn`` call, in every dtype."""
    monkeypatch.setattr(spsa, "DRAW_SLICE", 32)
    cuts = spsa._slices(numel)
    assert cuts[0] == (0, 32) and sum(n for _, n in cuts) == numel and min(n for _, n in cuts) >= 16
    assert all(start + n == nxt for (start, n), (nxt, _) in zip(cuts, cuts[1:]))
    whole = torch.randn(numel, generator=torch.Generator().manual_seed(3), dtype=dtype)
    sliced, gen = torch.empty(numel, dtype=dtype), torch.Generator().manual_seed(3)
    for start, n in cuts:
        sliced[start : start + n].normal_(generator=gen)
    assert torch.equal(whole, sliced)
    for bad in (0, 8, 40):
        monkeypatch.setattr(spsa, "DRAW_SLICE", bad)
        with pytest.raises(ValueError, match="multiple of 16"):
            spsa._slices(numel)


def test_a_sliced_pass_holds_no_draw_the_size_of_a_weight(monkeypatch):
    """A large CPU weight's noise is drawn into one small buffer per thread, never whole: a pass allocates no
    tensor of more than a slice (MeZO's embedding is 113 MB in fp32)."""
    monkeypatch.setattr(spsa, "DRAW_SLICE", 256)
    params = [torch.randn(100_000), torch.randn(50)]
    before = [p.clone() for p in params]
    sizes = []
    real_empty, real_randn = torch.empty, torch.randn

    def spy(factory):
        def made(*shape, **kwargs):
            out = factory(*shape, **kwargs)
            sizes.append(out.numel())
            return out
        return made

    monkeypatch.setattr(torch, "empty", spy(real_empty))
    monkeypatch.setattr(torch, "randn", spy(real_randn))
    perturb_(params, 4, 1e-2)
    zo_update_(params, [4], [torch.tensor(0.5)], 1e-2, [0.1, 0.0], restore=(4, -1e-2))
    monkeypatch.undo()
    assert sizes and max(sizes) <= 256 + 16
    reference_perturb_(before, 4, 1e-2)
    reference_perturb_(before, 4, -1e-2)
    reference_update_(before, [4], [torch.tensor(0.5)], [1e-2, 1e-2], [0.1, 0.0])
    assert all(torch.equal(a, b) for a, b in zip(params, before))


# --- the flat stream -----------------------------------------------------------------------------------------


def test_flat_stream_is_blocks_of_the_concatenated_parameters(monkeypatch):
    """Its definition: per (device, dtype), parameters concatenated in order, ``FLAT_BLOCK`` entries per draw."""
    monkeypatch.setattr(spsa, "FLAT_BLOCK", 100)  # parameters straddle blocks
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in [(7, 11), (3,), (250,), (20, 2)]]
    params.insert(2, torch.randn(30, generator=g, dtype=torch.float64))  # its own group, drawn after the fp32 one
    z = directions(params, 5, noise="flat")
    gen = torch.Generator().manual_seed(5)
    fp32 = torch.cat([torch.randn(n, generator=gen) for n in (100, 100, 100, 70)])
    fp64 = torch.randn(30, generator=gen, dtype=torch.float64)
    expected = list(fp32.split([77, 3, 250, 40]))
    expected.insert(2, fp64)
    assert all(torch.equal(a.reshape(-1), b) for a, b in zip(z, expected))
    per_tensor = directions(params, 5)
    assert not torch.equal(per_tensor[0], z[0])  # a different stream, hence a versioned choice


@pytest.mark.parametrize("noise", ["flat", "blocks"])
def test_flat_and_blocks_stream_steps_are_consistent(noise, monkeypatch):
    """perturb_, the update, kept z and batched replicas all see the same z; +eps/-2eps/+eps restores."""
    monkeypatch.setattr(spsa, "FLAT_BLOCK", 1000)
    monkeypatch.setattr(spsa, "BLOCKS_BLOCK", 1000)
    monkeypatch.setattr(spsa, "DRAW_SLICE", 48)  # regenerated z drawn in slices, kept z in whole blocks
    model, closure = model_and_closure("tt")
    kept_model, batched_model = copy.deepcopy(model), copy.deepcopy(model)
    monkeypatch.setattr(ZOSGD, "KEEP_DIRECTION_BYTES", 0)
    regenerated = optimizer(model, "tt", None, noise=noise)
    regenerated.step(closure)
    monkeypatch.setattr(ZOSGD, "KEEP_DIRECTION_BYTES", 2**30)
    kept = optimizer(kept_model, "tt", None, noise=noise)
    kept.step(closure_of(kept_model, closure))
    assert torch.equal(regenerated.last_projected_grads, kept.last_projected_grads)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), kept_model.parameters()))
    batched = optimizer(batched_model, "tt", None, noise=noise, batched_queries=True, query_chunk=6)
    batched.step(closure_of(batched_model, closure))
    torch.testing.assert_close(batched.last_projected_grads, kept.last_projected_grads, atol=2e-4, rtol=1e-3)
    for a, b in zip(trainable(model), trainable(batched_model)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    params = trainable(model)
    before = [p.clone() for p in params]
    perturb_(params, 3, 1e-2, noise=noise)
    perturb_(params, 3, -2e-2, noise=noise)
    perturb_(params, 3, 1e-2, noise=noise)
    for a, b in zip(params, before):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_noise_is_checked_and_survives_a_resume():
    with pytest.raises(ConfigError, match="noise"):
        ZOSGDConfig(noise="philox")
    w = nn.Parameter(torch.randn(10))
    opt = ZOSGD([w], ZOSGDConfig(noise="flat"))
    opt.step(lambda: (w**2).sum())
    with pytest.raises(ConfigError, match="noise='flat'"):
        ZOSGD([nn.Parameter(torch.randn(10))]).load_state_dict(opt.state_dict())
    ZOSGD([nn.Parameter(torch.randn(10))], ZOSGDConfig(noise="flat")).load_state_dict(opt.state_dict())
    old = opt.state_dict()
    del old["zo"]["noise"]  # a checkpoint from before the choice: per_tensor
    ZOSGD([nn.Parameter(torch.randn(10))]).load_state_dict(old)


# --- the blocks stream ---------------------------------------------------------------------------------------


def test_blocks_stream_is_independent_generators_per_block(monkeypatch):
    """Its definition: as flat, ``BLOCKS_BLOCK`` entries per draw, block b from ``block_seed(seed, b)``."""
    monkeypatch.setattr(spsa, "BLOCKS_BLOCK", 100)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in [(7, 11), (3,), (250,), (20, 2)]]
    params.insert(2, torch.randn(30, generator=g, dtype=torch.float64))  # its own group, drawn after the fp32 one
    z = directions(params, 5, noise="blocks")
    fp32 = torch.cat([torch.randn(n, generator=torch.Generator().manual_seed(spsa.block_seed(5, b)))
                      for b, n in enumerate((100, 100, 100, 70))])
    fp64 = torch.randn(30, generator=torch.Generator().manual_seed(spsa.block_seed(5, 4)), dtype=torch.float64)
    expected = list(fp32.split([77, 3, 250, 40]))
    expected.insert(2, fp64)
    assert all(torch.equal(a.reshape(-1), b) for a, b in zip(z, expected))
    assert len({spsa.block_seed(5, b) for b in range(100)} | {spsa.block_seed(6, b) for b in range(100)}) == 200
    assert not torch.equal(directions(params, 5, noise="flat")[0], z[0])  # a stream of its own


@pytest.fixture
def threads():
    """Set torch's CPU threads for a test (the blocks stream draws on as many), restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind,mask", [("full", None), ("full", "magnitude"), ("full", "random"), ("bottleneck", None)])
def test_blocks_stream_gives_the_same_numbers_on_any_number_of_threads(kind, mask, threads, monkeypatch):
    """Blocks drawn and applied on threads (in any order) or one after another: the same steps bit for bit, with
    z kept or regenerated, the restore fused, weight decay and two learning rates, under every mask."""
    monkeypatch.setattr(spsa, "BLOCKS_BLOCK", 500)  # dozens of blocks, straddling parameters
    monkeypatch.setattr(spsa, "DRAW_SLICE", 112)  # each block drawn and moved in slices, cut across parameters
    used = []
    real_pool = spsa._draw_pool
    monkeypatch.setattr(spsa, "_draw_pool", lambda: used.append(torch.get_num_threads()) or real_pool())
    runs = []
    for n_threads in (1, 3):
        threads(n_threads)
        for keep, queries in ((False, 1), (False, 2), (True, 2)):
            model, closure = model_and_closure(kind)
            monkeypatch.setattr(ZOSGD, "KEEP_DIRECTION_BYTES", 2**30 if keep else 0)
            opt = optimizer(model, kind, mask, n_queries=queries, noise="blocks")
            for _ in range(2):
                opt.step(closure)
            runs.append((n_threads, keep, queries, opt.last_losses, [p.detach().clone() for p in model.parameters()]))
    assert 3 in used  # the threaded path ran
    one, three = runs[: len(runs) // 2], runs[len(runs) // 2 :]
    for (_, _, _, losses_a, weights_a), (_, _, _, losses_b, weights_b) in zip(one, three):
        assert torch.equal(losses_a, losses_b)
        assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
    assert torch.equal(one[1][3], one[2][3])  # kept or regenerated z: the same losses


def test_blocks_stream_threads_finish_before_an_error_is_raised(threads, monkeypatch):
    """A failing block on one thread raises in the caller, after every other block's work is done."""
    threads(2)
    monkeypatch.setattr(spsa, "BLOCKS_BLOCK", 10)
    params = [torch.zeros(100)]
    layout = spsa.NoiseLayout(params, "blocks")
    assert layout.threaded
    done = []

    def apply(index, views, zs):
        if views[0].data_ptr() == params[0].data_ptr():  # the first block fails
            raise RuntimeError("boom")
        done.append(1)

    with pytest.raises(RuntimeError, match="boom"):
        spsa.each_draw(layout, 3, None, apply)
    assert len(done) == 9
