"""Generation tasks and the LM objective: SQuAD-style F1 / exact match, greedy generation, -F1 as a ZO loss,
and the LM loss on the gold candidate (COPA, ReCoRD)."""

from __future__ import annotations

import csv
import json

import datasets
import pytest
import torch

from adazeta.scoring import generation
from adazeta.errors import ConfigError
from adazeta.scoring.generation import GenerationSet, answer_text, generation_metrics, greedy_generate, stop_token_ids
from adazeta.models import ModelConfig, load_model
from adazeta.runs.record import main_score
from adazeta.tracking import eval_columns
from adazeta.run import run
from adazeta.scoring import Scorer, objective_loss
from adazeta.tasks.metrics import best_exact_match, best_f1, exact_match, normalize_answer, token_f1
from adazeta.tasks.objectives import Objective, gold_only
from adazeta.tasks.spec import Example
from helpers import compose_cfg
from test_scoring import TINY_LLAMA


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelConfig(name="t", random_init=True, architecture=TINY_LLAMA, device="cpu"), seed=3)


def test_squad_normalisation_and_exact_match():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert exact_match("the Eiffel tower.", "Eiffel Tower") == 1.0
    assert exact_match("Eiffel", "Eiffel Tower") == 0.0
    assert best_exact_match("Paris", ["Lyon", "paris"]) == 1.0


def test_token_f1_on_hand_made_cases():
    # pred {big, red, dog} vs gold {red, dog, barks}: 2 common tokens, precision = recall = 2/3.
    assert token_f1("the big red dog", "red dog barks") == pytest.approx(2 / 3)
    # pred {red}, gold {red, dog}: precision 1, recall 1/2 -> F1 2/3.
    assert token_f1("red", "a red dog") == pytest.approx(2 / 3)
    assert token_f1("blue", "red dog") == 0.0
    assert token_f1("the", "a") == 1.0  # both normalise to nothing
    assert token_f1("", "red") == 0.0
    assert best_f1("red dog", ["cat", "red dog"]) == 1.0
    assert best_f1("anything", []) == 0.0


def test_answer_is_the_text_before_the_first_newline():
    assert answer_text(" Paris\nQuestion: next") == "Paris"
    assert answer_text("\n\n  1887 \n") == "1887"
    assert answer_text("") == ""


def test_stop_tokens_are_every_token_holding_a_newline(tiny):
    tok = tiny.tokenizer
    stops = set(stop_token_ids(tok))
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert set(newline) <= stops and tok.eos_token_id in stops
    assert all("\n" in tok.decode([i]) for i in stops - {tok.eos_token_id})


def test_batched_greedy_generation_equals_one_prompt_at_a_time(tiny):
    tok = tiny.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("a", "the movie was great and", "plot")]
    stops = stop_token_ids(tok)
    batched = greedy_generate(tiny.model, prompts, tok, stops, max_new_tokens=12, batch_size=3)
    single = [greedy_generate(tiny.model, [p], tok, stops, max_new_tokens=12)[0] for p in prompts]
    assert batched == single
    assert all("\n" not in t for t in batched)


def test_generation_metrics_average_the_best_match(tiny, monkeypatch):
    monkeypatch.setattr(generation, "greedy_generate", lambda *a, **k: ["Paris", "red", "nothing"])
    gen = GenerationSet([[1], [2], [3]], [["paris", "Lyon"], ["a red dog"], ["x"]], tiny.tokenizer, [0])
    metrics = generation_metrics(tiny.model, gen)
    assert metrics["em"] == pytest.approx(1 / 3)
    assert metrics["f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)


def test_generation_prompts_leave_room_for_the_answer(tiny):
    gen = GenerationSet.build([list(range(10, 100))], [["a"]], tiny.tokenizer, max_length=64, stop_ids=[0])
    assert gen.prompts[0] == list(range(86, 100))  # cut from the left: the question stays whole
    with pytest.raises(ConfigError, match="leaves no room"):
        GenerationSet.build([[1]], [["a"]], tiny.tokenizer, max_length=40)


def test_lm_loss_on_gold_only_items_equals_the_gold_score(tiny):
    examples = [
        Example("The man fell because", [" he tripped.", " the floor was wet and slippery."], 1),
        Example("It rained so", [" the grass grew.", " we stayed in."], 0),
    ]
    scorer = Scorer.of(tiny.model, tiny.tokenizer)
    lm = Scorer.of(tiny.model, tiny.tokenizer, objective=Objective("lm"))
    enc = scorer.encode(examples, 128)
    with torch.no_grad():
        full = scorer.scores(scorer.collate(enc))
        gold = lm.loss(lm.collate(gold_only(enc)))
    expected = -(full[0, 1] + full[1, 0]) / 2  # minus the gold choices' mean token log-likelihoods
    assert gold.item() == pytest.approx(expected.item(), rel=1e-5)
    assert objective_loss(full, torch.tensor([1, 0]), "lm").item() == pytest.approx(expected.item(), rel=1e-5)


def squad_hub(monkeypatch, n: int = 24) -> None:
    rows = [{"id": str(i), "title": "Numbers", "context": f"The number is {i}.", "question": "Which number?",
             "answers": {"text": [str(i)], "answer_start": [14]}} for i in range(n)]
    ds = datasets.Dataset.from_list(rows)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: ds)


def squad_run(tmp_path, *extra: str) -> dict:
    overrides = ["model=tiny-llama", "task=squad", "data.num_train=8", "data.num_dev=4", "data.num_eval=4",
                 "train.max_steps=2", "train.eval_every=2", "train.batch_size=2", "wandb.mode=disabled", *extra]
    return run(compose_cfg(overrides), tmp_path)


def test_generation_task_records_f1_and_em(monkeypatch, tmp_path):
    squad_hub(monkeypatch)
    record = squad_run(tmp_path, "method=mezo")
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["status"] == "finished" and saved["metric"] == "f1"
    for split in ("dev", "test"):
        assert 0.0 <= saved[f"{split}_em"] <= saved[f"{split}_f1"] <= 1.0
    assert "test_accuracy" not in saved and "dev_accuracy" not in saved  # F1 is not called accuracy
    assert main_score(saved, "test") == saved["test_f1"] and main_score(saved, "initial_dev") is not None
    with open(tmp_path / "eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == eval_columns("f1") == ["step", "split", "loss", "f1", "tied"]
    assert float(rows[-1]["f1"]) == pytest.approx(record["test_f1"])
    assert float(rows[-1]["loss"]) > 0  # the LM loss of the gold answer


def test_f1_objective_trains_zo_methods_on_minus_f1(monkeypatch, tmp_path):
    squad_hub(monkeypatch)
    squad_run(tmp_path, "method=mezo", "task.f1_objective=true")
    with open(tmp_path / "metrics.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) == 2 and all(-1.0 <= x <= 0.0 for x in losses)


def test_f1_objective_refuses_first_order_methods(monkeypatch, tmp_path):
    squad_hub(monkeypatch)
    with pytest.raises(ConfigError, match="f1_objective=true .* no gradient"):
        squad_run(tmp_path, "method=ft", "task.f1_objective=true")


def test_f1_objective_refuses_the_forward_gradient_before_any_work(monkeypatch, tmp_path):
    squad_hub(monkeypatch)
    with pytest.raises(ConfigError, match="estimator=forward_grad cannot train on it"):
        squad_run(tmp_path / "run", "method=mezo", "task.f1_objective=true", "optimizer@method.optimizer=forward_grad")
    assert not (tmp_path / "run").exists()
