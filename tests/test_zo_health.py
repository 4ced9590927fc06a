"""What keeps a ZO run honest: identity adapter init, the divergence rules, collapse detection, budget schedules."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from adazeta.adapters.bottleneck import BottleneckAdapterConfig, add_bottleneck_adapters
from adazeta.adapters.tt import TTAdapter, TTAdapterConfig, add_tt_adapters
from adazeta.errors import ConfigError
from adazeta.scoring.evaluate import Dependence, Predictions, dependence, evaluate
from adazeta.models import ModelConfig, load_model
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig
from adazeta.schedules import AdaptiveOfficialConfig, budget_steps, build_adaptive_official
from adazeta.scoring import Scorer
from adazeta.tasks.spec import Example
from adazeta.tracking import DivergenceConfig, DivergenceMonitor

TINY_LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, vocab_size=300)
EXAMPLES = [
    Example(prompt=f"the movie was {w} and the plot", candidates=[" bad", " great"], gold=g)
    for w, g in (("dull", 0), ("bright", 1), ("long", 0), ("fine", 1), ("short", 0), ("good", 1))
]


def tiny():
    cfg = ModelConfig(name="t", random_init=True, architecture=dict(TINY_LLAMA), device="cpu")
    return load_model(cfg, seed=1)


def tiny_batch(loaded):
    scorer = Scorer.of(loaded.model, loaded.tokenizer)
    return scorer.collate(scorer.encode(EXAMPLES, 128))


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def with_adapters(kind: str, init: str):
    loaded = tiny()
    torch.manual_seed(0)
    if kind == "tt":
        cfg = TTAdapterConfig(bottleneck=8, rank=3, init=init, targets=[{"pattern": r"mlp\.down_proj$", "position": "output"},
                                                                      {"pattern": r"mlp\.up_proj$", "position": "input"}])
        gen = torch.Generator().manual_seed(0)
        model = add_tt_adapters(loaded.model, cfg, generator=gen)
    else:
        cfg = BottleneckAdapterConfig(bottleneck=8, init=init, placement="official")
        model = add_bottleneck_adapters(loaded.model, cfg)
    return loaded, model


@pytest.mark.parametrize("kind", ["tt", "bottleneck"])
def test_identity_init_starts_exactly_at_the_backbone(kind):
    backbone = tiny()
    batch = tiny_batch(backbone)
    expected = logits(backbone.model, batch)
    loaded, model = with_adapters(kind, "identity")
    torch.testing.assert_close(logits(model, batch), expected, atol=1e-6, rtol=1e-6)
    _, reference = with_adapters(kind, "reference")
    assert (logits(reference, batch) - expected).abs().max() > 1e-3  # the reference init moves the model


def test_identity_init_zeroes_one_up_core_and_the_up_bias_only():
    _, model = with_adapters("tt", "identity")
    adapters = [m for m in model.modules() if isinstance(m, TTAdapter)]
    assert len(adapters) == 4
    for a in adapters:
        assert torch.count_nonzero(a.up.cores[-1]) == 0 and torch.count_nonzero(a.up.bias) == 0
        assert all(torch.count_nonzero(c) == c.numel() for c in a.up.cores[:-1])
        assert all(torch.count_nonzero(c) == c.numel() for c in a.down.cores)


@pytest.mark.parametrize("kind", ["tt", "bottleneck"])
def test_a_few_zo_steps_from_identity_move_every_parameter_and_change_the_output(kind):
    loaded, model = with_adapters(kind, "identity")
    batch = tiny_batch(loaded)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    before = {n: p.detach().clone() for n, p in named}
    start = logits(model, batch)
    opt = ZOSGD([p for _, p in named], ZOSGDConfig(lr=1e-3, eps=1e-3), seed=0, n_queries=2)
    scorer = Scorer.of(model, loaded.tokenizer)
    for _ in range(3):
        opt.step(lambda: scorer.loss(batch))
    for n, p in named:
        assert not torch.equal(p, before[n]), f"{n} did not move"
    assert (logits(model, batch) - start).abs().max() > 0


def test_adapter_init_is_validated():
    with pytest.raises(ConfigError, match="adapter.init='zero'"):
        TTAdapterConfig(init="zero")
    with pytest.raises(ConfigError, match="adapter.init"):
        BottleneckAdapterConfig(init="zero")


# ---- divergence rules on synthetic dev curves ---------------------------------------------------------------


def first_reason(monitor: DivergenceMonitor, curve, tied=None):
    tied = tied or [0.0] * len(curve)
    for i, (loss, t) in enumerate(zip(curve, tied)):
        reason = monitor.update(loss, t)
        if reason is not None:
            return i, reason
    return None, None


FIGURE1 = [0.69, 0.55, 0.45, 0.40, 0.36, 0.38, 0.45, 0.55, 0.62, 0.70, 0.70, 0.71]  # learns, then climbs back


def test_the_best_rule_catches_a_climb_back_that_the_initial_rule_misses():
    at, reason = first_reason(DivergenceMonitor(DivergenceConfig(rule="best", factor=1.5, patience=3)), FIGURE1)
    assert at == 9 and "best dev loss 0.3600" in reason  # 0.55, 0.62, 0.70 are all > 1.5 x 0.36 = 0.54
    at, _ = first_reason(DivergenceMonitor(DivergenceConfig(rule="initial", factor=2.0, patience=3)), FIGURE1)
    assert at is None


def test_noise_around_the_best_is_not_divergence():
    noisy = [1.13, 0.80, 0.70, 0.75, 0.68, 0.90, 0.72, 1.05, 0.70, 0.69]  # single spikes, never three in a row
    assert first_reason(DivergenceMonitor(DivergenceConfig()), noisy) == (None, None)


def test_a_collapse_to_tied_candidates_is_divergence_although_its_loss_looks_fine():
    # The run: 1.13 -> 0.64, then every candidate ties and the loss sits at ln 2 (< 2 x 1.13, < 1.5 x 0.64).
    curve = [1.13, 0.80, 0.64, 0.66, math.log(2), math.log(2)]
    tied = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    at, reason = first_reason(DivergenceMonitor(DivergenceConfig()), curve, tied)
    assert at == 4 and reason.startswith("collapsed")
    at, _ = first_reason(DivergenceMonitor(DivergenceConfig(collapse=False)), curve, tied)
    assert at is None


def answers(golds: list[int], first: list[float], second: list[float]) -> Predictions:
    """Two-candidate predictions from each example's scores."""
    return Predictions.from_scores([[a, b] for a, b in zip(first, second)], golds)


def test_input_dependence_measures_one_answer_and_a_constant_gap():
    golds = [i % 2 for i in range(100)]
    healthy = dependence(answers(golds, [-1.0] * 100, [-1.0 + (0.8 if g else -0.8) + 0.1 * (i % 3)
                                                        for i, g in enumerate(golds)]))
    assert healthy.examples == 100 and healthy.answer_share == 0.5 and healthy.gap_std > 0.8
    # The collapsed first-order TT run: every sentence "positive" by an almost constant margin, its loss near ln 2.
    stuck = dependence(answers(golds, [-1.0] * 100, [-0.99 + 1e-4 * (i % 3) for i in range(100)]))
    assert (stuck.answer, stuck.answer_share, stuck.gold_share) == (1, 1.0, 0.5)
    assert stuck.gap_std == pytest.approx(1e-4 * math.sqrt(2 / 3), rel=1e-2)  # 0, 1, 2 x 1e-4 in thirds
    assert dependence(Predictions(texts=["a"], f1=[1.0], em=[1.0])) is None  # generation: nothing to measure


def dependences(monitor: DivergenceMonitor, curve: list[Dependence]) -> tuple[int | None, str | None]:
    for i, d in enumerate(curve):
        reason = monitor.update(0.69, 0.0, d)
        if reason is not None:
            return i, reason
    return None, None


def test_answers_that_stop_depending_on_the_input_end_a_run_told_to_stop(caplog):
    healthy = Dependence(examples=200, answer=0, answer_share=0.6, gold_share=0.55, gap_std=1.0)
    one_answer = Dependence(examples=200, answer=1, answer_share=1.0, gold_share=0.545, gap_std=0.5)
    flat_gap = Dependence(examples=200, answer=1, answer_share=0.9, gold_share=0.545, gap_std=0.024)
    for collapsed, measured in ((one_answer, "100.0% of 200 dev examples answer candidate 1 (54.5% of their gold "
                                             "labels are it)"),
                                (flat_gap, "the score gap varies by 0.024 (std) across 200 dev examples, 2.4% of "
                                           "its 1 at the first evaluation")):
        caplog.clear()
        at, reason = dependences(DivergenceMonitor(DivergenceConfig(independent="stop")),
                                 [healthy, healthy, collapsed, collapsed])
        assert at == 2 and reason.startswith("collapsed: the answers no longer depend on the input") and \
            measured in reason
        assert measured in caplog.text  # logged once, with what was measured
        # warn (the default): logged and recorded, the run goes on
        assert dependences(DivergenceMonitor(DivergenceConfig()), [healthy, collapsed, collapsed]) == (None, None)
    # Labels that skewed, or too few examples to tell, are never judged; nor is an untrained model that already
    # answered one way (a biased pretrained model is not a collapse).
    skewed = Dependence(examples=200, answer=1, answer_share=0.99, gold_share=0.985, gap_std=0.9)
    few = Dependence(examples=16, answer=1, answer_share=1.0, gold_share=0.5, gap_std=0.9)
    stop = DivergenceConfig(independent="stop")
    assert dependences(DivergenceMonitor(stop), [healthy, skewed, few]) == (None, None)
    assert dependences(DivergenceMonitor(stop), [one_answer, one_answer, flat_gap]) == (None, None)


def test_an_untrained_model_that_answers_one_way_is_recorded_and_not_stopped(fixture_data, tmp_path, caplog):
    """A tiny random model answers one candidate for every input from the start: the run says so in its log and
    result.json (dev and test), and ``stop`` does not end it (training did not cause it)."""
    from adazeta.run import run
    from helpers import compose_cfg, tiny_overrides

    cfg = compose_cfg(tiny_overrides(fixture_data, "method=mezo_lora", "data.num_dev=50", "data.num_eval=20",
                                     "divergence.independent=stop"))
    record = run(cfg, tmp_path / "run")
    assert record["status"] == "finished"
    dev, test = record["dev_dependence"], record["test_dependence"]
    assert dev["examples"] == 50 and test["examples"] == 20 and dev["answer_share"] == 1.0 and dev["gap_std"] > 0
    assert json.loads((tmp_path / "run" / "result.json").read_text())["dev_dependence"] == dev
    assert "do not depend on the input before any training: 100.0% of 50 dev examples" in caplog.text


def test_divergence_config_is_validated():
    with pytest.raises(ConfigError, match="divergence.rule"):
        DivergenceConfig(rule="worst")
    with pytest.raises(ConfigError, match="divergence.collapse_fraction"):
        DivergenceConfig(collapse_fraction=0.0)
    with pytest.raises(ConfigError, match="divergence.independent='halt' is not one of warn, stop, off"):
        DivergenceConfig(independent="halt")
    with pytest.raises(ConfigError, match="divergence.independent_answer_share=0.5 must be in"):
        DivergenceConfig(independent_answer_share=0.5)


def test_an_overflowing_residual_stream_scores_every_candidate_equal():
    """The collapse mechanism itself: an adapter output above ~1.8e19 overflows RMSNorm's float32 mean square,
    the norm returns zeros, every logit is 0, and the loss is exactly ln 2 with all candidates tied."""
    loaded, model = with_adapters("tt", "identity")
    batches = [tiny_batch(loaded)]
    scorer = Scorer.of(model, loaded.tokenizer)
    healthy = evaluate(scorer, batches)
    assert healthy.tied == 0.0
    with torch.no_grad():
        for a in model.modules():
            if isinstance(a, TTAdapter):
                a.up.bias.fill_(1e20)
    broken = evaluate(scorer, batches)
    assert broken.tied == 1.0
    assert broken.loss == pytest.approx(math.log(2), abs=1e-6)


# ---- the reference schedule under a forward-pass budget ----------------------------------------------------


@pytest.mark.parametrize("budget", [200, 2000, 8000])
def test_budget_steps_is_a_fixed_point_of_the_schedule(budget):
    build = lambda e: build_adaptive_official(AdaptiveOfficialConfig(), e)  # noqa: E731
    per_epoch = 63
    steps = budget_steps(build, per_epoch, 62.5, budget, lambda q: 2 * q, 10**6)
    schedule = build(steps / 62.5)
    spent = [0]
    for k in range(steps):
        spent.append(spent[-1] + 2 * schedule(k // per_epoch))
    assert spent[-2] < budget <= spent[-1]  # this schedule spends the budget exactly at its last step
    if budget >= 2000:  # long enough to leave epoch 1 (where 1^beta = 1): Q has grown by the run's end
        assert schedule((steps - 1) // per_epoch) >= 3


def test_a_run_with_a_budget_derives_the_reference_schedule_from_it(tmp_path):
    from helpers import compose_cfg, tiny_overrides, write_fixture_data
    from adazeta.build import run_length
    from adazeta.settings import parse

    data = write_fixture_data(tmp_path)
    s = parse(compose_cfg(tiny_overrides(data, "method=adazeta", "schedule=adaptive_official",
                                         "train.max_steps=100000", "train.max_forward_passes=400")))
    length = run_length(s, 32)  # batch 4: 8 steps an epoch
    assert length.budget_steps is not None and length.schedule_epochs == length.budget_steps / 8
    assert 1 < length.schedule_epochs < 100000 / 8  # far fewer epochs than max_steps would give
    assert (length.steps_per_epoch, length.max_forward_passes, length.planned_steps) == (8, 400, length.budget_steps)
    s2 = dataclasses.replace(s, train=dataclasses.replace(s.train, max_forward_passes=None))
    assert run_length(s2, 32).schedule_epochs == 100000 / 8 and run_length(s2, 32).budget_steps is None
    assert run_length(s2, 32).planned_steps == 100000


# ---- the loop: collapse ends the run, and a collapsed state is never the one tested -------------------------


class Saboteur(torch.optim.Optimizer):
    """A ZO 'optimizer' that overflows every adapter on its third step (the collapse, made to order)."""

    zeroth_order = True

    def __init__(self, params, adapters):
        super().__init__(params, dict(lr=0.0))
        self.adapters, self.n_queries, self.forward_passes, self.calls = adapters, 1, 0, 0

    @torch.no_grad()
    def step(self, closure, n_queries=1):  # the ZO contract: the loop passes the step's Q
        self.calls += 1
        self.forward_passes += 2
        if self.calls == 3:
            for a in self.adapters:
                a.up.bias.fill_(1e20)
        return closure()


def test_a_collapse_ends_the_run_as_diverged_and_test_uses_the_state_before_it(tmp_path):
    from adazeta.tracking import Tracker, WandbConfig
    from adazeta.train import Loop, Splits, TrainConfig, train

    loaded, model = with_adapters("tt", "identity")
    tok = loaded.tokenizer
    scorer = Scorer.of(model, tok)
    items = scorer.encode(EXAMPLES * 4, 128)
    dev = scorer.batches(scorer.encode(EXAMPLES, 128), 8, sort=True)
    adapters = [m for m in model.modules() if isinstance(m, TTAdapter)]
    opt = Saboteur([p for p in model.parameters() if p.requires_grad], adapters)
    tracker = Tracker(tmp_path, WandbConfig(mode="disabled"), "t", {}, [])
    cfg = TrainConfig(max_steps=10, batch_size=4, eval_every=1)
    outcome = train(scorer, opt, Splits(items, dev, dev), cfg, Loop(tracker, DivergenceMonitor(DivergenceConfig()), 0))
    tracker.close()
    assert outcome.status == "diverged" and outcome.reason.startswith("collapsed")
    assert outcome.steps == 3 and outcome.best_step < 3
    assert outcome.test.tied == 0.0  # restored to the best state before the collapse
    rows = (tmp_path / "eval.csv").read_text().splitlines()
    assert rows[0] == "step,split,loss,accuracy,tied" and rows[-2].startswith("3,dev,") and rows[-2].endswith(",1.0")


def test_dev_is_evaluated_every_n_forward_passes_when_asked(tmp_path):
    import csv

    from helpers import compose_cfg, tiny_overrides, write_fixture_data
    from adazeta.run import run

    data = write_fixture_data(tmp_path / "data")
    # 8 examples at batch 4: Q = 1, 1, 2, 2, 4, 4 -> forwards 2, 4, 8, 12, 20, 28; every 8 forwards: steps 3, 5, 6
    run(compose_cfg(tiny_overrides(data, "method=adazeta", "data.num_train=8", "train.max_steps=6",
                                   "schedule.alpha=2", "schedule.beta=1", "train.eval_every_forwards=8")),
        tmp_path / "run")
    with open(tmp_path / "run" / "eval.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r["split"] == "dev"]
    assert steps == [0, 3, 5, 6]
