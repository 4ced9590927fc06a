"""Reference parity: the reference scripts' behaviour, computed in each test from the reference's own rule or
constants (LM-BFF, MeZO, AdaZeta's code), against what the project does in the experiment that reproduces it."""

from __future__ import annotations

import csv

import pytest
import torch

from adazeta.run import run
from adazeta.settings import parse
from adazeta.tracking import DivergenceConfig, DivergenceMonitor
from helpers import compose_cfg, tiny_overrides


def dev_rows(run_dir):
    with open(run_dir / "eval.csv") as f:
        return [r for r in csv.DictReader(f) if r["split"] == "dev"]


@pytest.mark.parametrize("select_on,select_from", [("metric", 0), ("loss", 4), ("metric", 4)])
def test_the_kept_state_follows_the_selection_rule(select_on, select_from, fixture_data, tmp_path):
    """LM-BFF / MeZO (RoBERTa) keep the first evaluation with the best dev accuracy (`if metric > best`); MeZO's
    large-model trainer the lowest dev loss; both among the evaluations from their first eval step on."""
    record = run(compose_cfg(tiny_overrides(
        fixture_data, "method=adazeta", "train.max_steps=12", "train.eval_every=2", "method.optimizer.lr=3e-2",
        "divergence.rule=none", f"train.select_on={select_on}", f"train.select_from={select_from}")), tmp_path)
    rows = [r for r in dev_rows(tmp_path) if int(r["step"]) >= select_from]
    if select_on == "metric":  # the reference: strictly greater replaces, so the first of equal accuracies stays
        best = rows[0]
        for r in rows[1:]:
            if float(r["accuracy"]) > float(best["accuracy"]):
                best = r
    else:
        best = min(rows, key=lambda r: float(r["loss"]))
    assert record["best_step"] == int(best["step"])
    assert record["dev_accuracy"] == pytest.approx(float(best["accuracy"]))


def test_divergence_rule_none_trains_every_step_as_the_reference_does():
    monitor = DivergenceMonitor(DivergenceConfig(rule="none"))
    assert [monitor.update(loss) for loss in (1.0, 0.5, 5.0, 9.0, 20.0, 50.0)] == [None] * 6
    assert monitor.update(float("nan")) is not None  # a non-finite loss still ends the run
    assert DivergenceMonitor(DivergenceConfig(rule="none", collapse=False)).update(0.69, tied=1.0) is None


def test_without_the_collapse_rule_a_collapsed_evaluation_can_be_kept_as_the_reference_keeps_it(fixture_data,
                                                                                                  tmp_path):
    """The reference trainers keep the best dev loss whatever the scores look like. Identical candidates tie on
    every example (every evaluation "collapsed"): with collapse off, the first eligible evaluation is kept."""
    overrides = ("method=mezo", "train.max_steps=6", "train.select_from=2", "divergence.rule=none",
                 "task.causal.candidates=[Yes,Yes]")
    record = run(compose_cfg(tiny_overrides(fixture_data, *overrides, "divergence.collapse=false")), tmp_path / "off")
    rows = dev_rows(tmp_path / "off")
    assert {float(r["tied"]) for r in rows} == {1.0} and record["status"] == "finished"
    assert record["best_step"] == 2  # ties to the earlier, from select_from on
    record = run(compose_cfg(tiny_overrides(fixture_data, *overrides)), tmp_path / "on")
    assert record["status"] == "diverged" and "collapsed" in record["reason"]


def test_later_added_settings_at_their_old_value_are_the_same_setting():
    from adazeta.tools.tables import setting_id, setting_of

    old = {"method": {"name": "m", "optimizer": {"lr": 1e-3}}, "train": {"max_steps": 5}}
    new = {"method": {"name": "m", "optimizer": {"lr": 1e-3}, "calibration": "none"},
           "train": {"max_steps": 5, "select_on": "loss", "select_from": 0}}
    assert setting_id(setting_of(old)) == setting_id(setting_of(new))
    new["train"]["select_on"] = "metric"
    assert setting_id(setting_of(old)) != setting_id(setting_of(new))


def test_bad_selection_settings_are_one_line_errors(fixture_data):
    from adazeta.errors import ConfigError

    with pytest.raises(ConfigError, match="train.select_on='acc' is not one of loss, metric"):
        parse(compose_cfg(tiny_overrides(fixture_data, "train.select_on=acc")))
    with pytest.raises(ConfigError, match="train.select_from=-1 must be >= 0"):
        parse(compose_cfg(tiny_overrides(fixture_data, "train.select_from=-1")))



# --- item by item: the reference's constants and rules, written out here -------------------------------------


def settings(*overrides: str):
    return parse(compose_cfg(list(overrides)))


def test_mezo_lora_rank_per_table():
    # AdaZeta large_models/run.py:677 `args.lora_r = args.rank`, run_all_large_exp.sh RANK=5, lora_alpha default 16;
    # medium_models/run.py:271-272 lora_r = 8, lora_alpha = 16 (mezo.sh passes no --lora_r)
    llama = settings("experiment=table2_llama", "method=mezo_lora", "task=rte").adapter.config
    roberta = settings("experiment=table1_roberta", "method=mezo_lora", "task=sst2").adapter.config
    assert (llama.r, llama.alpha, llama.train_head) == (5, 16, False)
    assert (roberta.r, roberta.alpha, roberta.train_head) == (8, 16, True)
    # MeZO medium_models/run.py 939-942: --apply_lora (first-order LoRA too) freezes roberta.* without "lora" only
    assert settings("experiment=table1_roberta", "method=lora", "task=sst2").adapter.config.train_head


def roberta_with(method: str):
    from transformers import AutoConfig, AutoModelForMaskedLM

    from adazeta.adapters import ADAPTERS

    config = AutoConfig.for_model("roberta", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, vocab_size=100)
    model = AutoModelForMaskedLM.from_config(config).eval()
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    s = settings("experiment=table1_roberta", f"method={method}", "task=sst2")
    return names, ADAPTERS.get(s.adapter.kind).builder(model, s.adapter.config)


def test_roberta_mezo_lora_trains_lora_and_the_untied_lm_head_as_the_reference():
    _, model = roberta_with("mezo_lora")
    trainable = {n.removeprefix("base_model.model.") for n, p in model.named_parameters() if p.requires_grad}
    every = {n.removeprefix("base_model.model.") for n, _ in model.named_parameters()}
    # medium_models/run.py 989-992: freeze `roberta.*` parameters whose name holds no "lora"; the rest trains
    expected = {n for n in every if not (n.startswith("roberta") and "lora" not in n)}
    assert trainable == expected
    assert any(n.startswith("lm_head.decoder") or n == "lm_head.bias" for n in trainable)
    base = model.get_base_model()
    assert base.lm_head.decoder.weight is not base.roberta.embeddings.word_embeddings.weight  # untied
    assert torch.equal(base.lm_head.decoder.weight, base.roberta.embeddings.word_embeddings.weight)  # same values


def test_roberta_full_methods_train_everything_but_the_frozen_untied_head():
    _, model = roberta_with("mezo")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # medium_models/run.py 1046-1049: `if "lm_head" in name: param.requires_grad = False` (tuning_type != lora)
    expected = {n for n, _ in model.named_parameters() if "lm_head" not in n}
    assert trainable == expected
    assert model.lm_head.decoder.weight is not model.roberta.embeddings.word_embeddings.weight
    assert not model.config.tie_word_embeddings


def test_lm_loss_is_the_cross_entropy_over_all_gold_tokens_of_the_batch():
    """MeZO large_models/utils.py: shift_labels masked to the option tokens, one CrossEntropyLoss over the batch."""
    import torch.nn.functional as F

    from adazeta.models import load_model
    from adazeta.scoring import Encoded, Scorer

    s = settings("model=tiny-llama", "task=copa", "train.lm_reduction=token")
    loaded = load_model(s.model, seed=0)
    model = loaded.model.eval()
    items = [Encoded([1, 5, 6, 7], [[8]], 0), Encoded([1, 9, 10], [[11, 12, 13]], 0), Encoded([1, 4], [[2, 3]], 0)]
    from adazeta.tasks.objectives import Objective

    scorer = Scorer.of(model, loaded.tokenizer, "causal", objective=Objective("lm", token_weighted=True))
    ours = float(scorer.loss(scorer.collate(items)))
    # the reference, written out: every row is prompt + gold option; CE on the option tokens only, pooled
    nll, count = 0.0, 0
    with torch.no_grad():
        for it in items:
            ids = torch.tensor([it.prompt + it.candidates[0]])
            logits = model(input_ids=ids).logits[0, :-1]
            labels = ids[0, 1:].clone()
            labels[: -len(it.candidates[0])] = -100
            nll += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += len(it.candidates[0])
    assert ours == pytest.approx(nll / count, rel=1e-5)
    per_example = Scorer.of(model, loaded.tokenizer, "causal", objective=Objective("lm"))
    assert float(per_example.loss(per_example.collate(items))) != pytest.approx(ours, rel=1e-3)  # the other reduction
    assert settings("experiment=table2_llama", "method=mezo", "task=copa").train.lm_reduction == "token"


@pytest.mark.parametrize("experiment,method", [(e, m) for e in ("table1_roberta", "table2_llama") for m in ("ft", "lora")])
def test_first_order_baselines_clip_at_hf_trainers_default(experiment, method):
    # transformers.TrainingArguments.max_grad_norm = 1.0; no reference script passes --max_grad_norm
    from transformers import TrainingArguments

    assert settings(f"experiment={experiment}", f"method={method}", "task=rte").optimizer.config.grad_clip == \
        TrainingArguments.__dataclass_fields__["max_grad_norm"].default


def test_icl_per_example_demonstrations_are_mezos_draws():
    """MeZO tasks.py sample_train_sets: under temp_seed(0), seeds = np.random.randint(0, 10000, n_eval); each eval
    sample's train set is sample_subset(train, seed=seeds[i], 32): np.random.seed(seed); permutation(len)[:32]."""
    import numpy as np

    from adazeta.tasks.demonstrations import per_example_indices

    n_eval, n_train = 6, 500
    state = np.random.get_state()
    np.random.seed(0)
    seeds = np.random.randint(0, 10000, n_eval)
    expected = []
    for seed in seeds:
        np.random.seed(seed)
        expected.append(np.random.permutation(n_train).tolist()[:32])
    np.random.set_state(state)
    assert per_example_indices(n_eval, n_train, 32) == expected
    assert settings("experiment=table2_llama", "method=icl", "task=rte").demonstrations.protocol == "per_example"


def test_an_icl_run_gives_every_test_prompt_its_own_demonstrations(fixture_data, tmp_path):
    from adazeta.build import build

    s = settings(*tiny_overrides(fixture_data, "method=icl", "method.demonstrations.k=2",
                                 "method.demonstrations.protocol=per_example", "model.max_length=2048"))
    b = build(s)
    prompts = [e.prompt for e in b.data.eval]
    assert len(set(p.split("\n\n")[0] for p in prompts)) > 1  # not one shared set
    assert all(p.count("\n\n") >= 2 and p == p.lstrip() for p in prompts)


def multinomial_logistic(x, y, c: float, classes: int):
    """The reference's model written out: softmax regression without intercept, loss sum CE + ||W||^2 / 2C (what
    LogisticRegressionCV(multi_class="multinomial", fit_intercept=False) minimises at one C), by L-BFGS."""
    import numpy as np
    from scipy.optimize import minimize
    from scipy.special import log_softmax

    onehot = np.eye(classes)[y]

    def objective(w):
        weights = w.reshape(x.shape[1], classes)
        logp = log_softmax(x @ weights, axis=1)
        grad = x.T @ (np.exp(logp) - onehot) + weights / c
        return -(logp * onehot).sum() + (weights ** 2).sum() / (2 * c), grad.ravel()

    fit = minimize(objective, np.zeros(x.shape[1] * classes), jac=True, method="L-BFGS-B",
                   options={"maxiter": 5000, "gtol": 1e-10, "ftol": 1e-15})
    return fit.x.reshape(x.shape[1], classes)


def test_mezo_linear_probe_is_the_references_multinomial_logistic_regression_cv():
    """MeZO large_models/trainer.py 281: LogisticRegressionCV(max_iter=5000, fit_intercept=False,
    multi_class="multinomial", random_state=0, tol=1e-4). On two classes the multinomial model is a binary one at
    twice the C; the installed scikit-learn (no multi_class) fits binary, so the grid must be doubled."""
    import numpy as np

    from adazeta.probe import ProbeConfig, fit_probe

    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 6))
    y = (x[:, 0] + 1.5 * rng.normal(size=80) > 0).astype(int)
    probe, grid = fit_probe(x, y, x[:10], y[:10], ProbeConfig(variant="mezo"), 2)
    assert probe.scaler is None and list(grid) == pytest.approx(np.logspace(-4, 4, 10).tolist())
    weights = multinomial_logistic(x, y, probe.C, 2)  # the reference's fit at the C it reports
    assert probe.classifier.coef_[0] == pytest.approx(weights[:, 1] - weights[:, 0], rel=1e-3, abs=1e-6)

    y3 = np.digitize(x[:, 0] + 0.5 * rng.normal(size=80), [-0.4, 0.4])  # three classes: multinomial as it is
    probe3, _ = fit_probe(x, y3, x[:10], y3[:10], ProbeConfig(variant="mezo"), 3)
    weights3 = multinomial_logistic(x, y3, probe3.C, 3)
    assert np.array_equal(probe3.probabilities(x).argmax(1), (x @ weights3).argmax(1))


def test_templates_as_mezos():
    boolq = settings("task=boolq").task
    row = {"passage": "Water boils at 100 C", "question": "does water boil at 100 c", "label": True}
    ex = boolq.for_family("causal").render(row, boolq.labels.index(True))
    # templates.py BoolQTemplateV3: f"{passage} {question}\n", candidates ["Yes", "No"], correct "Yes" if answer
    assert ex.prompt == "Water boils at 100 C Does water boil at 100 c?\n"
    assert ex.candidates == ["Yes", "No"] and ex.candidates[ex.gold] == "Yes"
    drop = settings("task=drop").task
    ex = drop.for_family("causal").render({"context": "C.", "question": "  How many?  ", "answers": ["2"]}, 0)
    assert ex.prompt == "Passage: C.\nQuestion: How many?\nAnswer:"  # question.strip(), context as is
    multirc = settings("task=multirc").task
    ex = multirc.for_family("causal").render({"paragraph": "\n  Para.", "question": "Q?", "answer": "A", "label": 1},
                                             1)
    mezo = f"{chr(10)}  Para.\nQuestion: Q?\nI found this answer \"A\". Is that correct? Yes or No?\n".lstrip()
    assert ex.prompt == mezo  # encode_prompt: (demos + "\n\n" + text).lstrip()


def test_table1_ft_is_mezos_finetune_sh():
    """MeZO medium_models/finetune.sh: BS=8, STEP=1000, EVAL_STEP=100, run_fewshot.sh --evaluate_during_training;
    src/trainer.py 805-815 keeps the state of the best dev objective (strictly greater), from the first evaluation."""
    ft = settings("experiment=table1_roberta", "method=ft", "task=sst2").train
    assert (ft.batch_size, ft.max_steps, ft.eval_every, ft.keep_best, ft.select_on, ft.select_from) == \
        (8, 1000, 100, True, "metric", 100)


def test_table_experiments_select_and_never_stop_as_the_reference():
    t1 = settings("experiment=table1_roberta", "method=mezo", "task=sst2")
    t2 = settings("experiment=table2_llama", "method=mezo", "task=rte")
    assert (t1.train.select_on, t1.train.select_from, t1.divergence.rule, t1.divergence.collapse) == \
        ("metric", t1.train.eval_every, "none", False)
    assert (t2.train.select_on, t2.train.select_from, t2.divergence.rule, t2.divergence.collapse) == \
        ("loss", t2.train.eval_every, "none", False)
    assert t1.guard.stall_checks == t2.guard.stall_checks == 0  # no stall stop in the reference trainers
    ft = settings("experiment=table2_llama", "method=ft", "task=rte")
    assert not ft.train.keep_best  # 3 epochs at batch 16 never reach finetune.sh's step-200 evaluation
    assert settings("experiment=table2_llama", "method=lp", "task=rte").probe.variant == "mezo"


# The first rows of GLUE SST-2's train split in the Hub's order (nyu-mll/glue sst2, column idx); the fixture puts
# them at their idx and fills the rest with sentences named by their idx, so a drawn row says where it came from.
GLUE_SST2_FIRST = [
    ("hide new secretions from the parental units ", 0),
    ("contains no wit , only labored gags ", 0),
    ("that loves its characters and communicates something rather beautiful about human nature ", 1),
    ("remains utterly satisfied to remain the same throughout ", 0),
]


def glue_sst2_hub(n: int):
    import datasets

    sentences = [s for s, _ in GLUE_SST2_FIRST] + [f"row {i} of the split " for i in range(len(GLUE_SST2_FIRST), n)]
    labels = [y for _, y in GLUE_SST2_FIRST] + [i % 2 for i in range(len(GLUE_SST2_FIRST), n)]
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"]),
                                  "idx": datasets.Value("int32")})
    return datasets.Dataset.from_dict({"sentence": sentences, "label": labels, "idx": list(range(n))}, features)


@pytest.mark.parametrize("seed", [0, 1])
def test_sst2_from_the_hub_draws_mezos_train_dev_and_test_rows(monkeypatch, seed):
    """MeZO large_models: load_dataset('glue', 'sst2'); sample_subset("train", seed, 1000 + 500) is
    np.random.seed(seed); np.random.permutation(n)[:1500]; dev = the last 500 of it, train the first 1000
    (run.py: train_samples[-num_dev:]); test = sample_subset("valid", seed, 1000) on the validation split."""
    import datasets
    import numpy as np

    from adazeta.tasks.loaders import DataConfig, load_task

    train_split, valid_split = glue_sst2_hub(3000), glue_sst2_hub(872)
    asked = []

    def load_dataset(path, name=None, split=None, **kwargs):  # the Hub, answered from the fixture (no network)
        asked.append((path, name, split))
        return {"train": train_split, "validation": valid_split}[split]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    task = settings("task=sst2").task
    data = load_task(task.for_family("causal"), DataConfig(num_train=1000, num_dev=500, num_eval=1000), seed=seed)
    assert asked == [("nyu-mll/glue", "sst2", "train"), ("nyu-mll/glue", "sst2", "validation")]

    np.random.seed(seed)
    drawn = np.random.permutation(3000).tolist()[:1500]
    train_idx, dev_idx = drawn[:-500], drawn[-500:]
    np.random.seed(seed)
    test_idx = np.random.permutation(872).tolist()[:1000]  # all 872, in the seed's order

    def mezo_prompt(split, i):  # templates.py SST2Template: f"{text.strip()} It was"
        return split["sentence"][i].strip() + " It was"

    assert [e.prompt for e in data.train] == [mezo_prompt(train_split, i) for i in train_idx]
    assert [e.prompt for e in data.dev] == [mezo_prompt(train_split, i) for i in dev_idx]
    assert [e.prompt for e in data.eval] == [mezo_prompt(valid_split, i) for i in test_idx]
    assert [e.gold for e in data.train] == [train_split["label"][i] for i in train_idx]
    assert [e.row for e in data.dev] == dev_idx


def test_a_small_train_split_is_split_as_mezos_run_py_splits_wsc(fixture_data):
    """MeZO large_models run.py 468-488: sample_subset("train", seed, TRAIN + DEV) = np.random.seed(seed);
    permutation(n)[:TRAIN + DEV]; dev = the last DEV of it, train the rest. WSC (554 rows, DEV=500 in mezo.sh):
    54 train, 500 dev. The fixture's 120 RTE rows with DEV=100 are the same case: 20 train, 100 dev."""
    import numpy as np

    from adazeta.tasks.loaders import DataConfig, load_task

    task = settings("task=rte").task.for_family("causal")
    data = load_task(task, DataConfig(num_train=1000, num_dev=100, num_eval=8, dir=str(fixture_data),
                                      dev_at_most_half=False), seed=0)
    np.random.seed(0)
    drawn = np.random.permutation(120).tolist()[:1100]
    assert [e.row for e in data.train] == drawn[:-100] and [e.row for e in data.dev] == drawn[-100:]
    assert not settings("experiment=table2_llama", "method=mezo", "task=wsc").data.dev_at_most_half
    assert settings("experiment=cpu_table2", "method=mezo", "task=wsc").data.dev_at_most_half  # unchanged


def test_every_fidelity_page_the_configs_and_readme_point_to_exists_and_covers_both_tables():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    texts = [root / "README.md", *sorted((root / "conf").rglob("*.yaml"))]
    linked = {m for p in texts for m in re.findall(r"docs/[\w./-]+\.md", p.read_text())}
    assert "docs/fidelity.md" in linked
    for doc in linked:
        assert (root / doc).is_file(), doc
    page = (root / "docs/fidelity.md").read_text()
    for section in ("## Table 1", "## Table 2", "### Differences that remain", "loralib"):
        assert section in page
