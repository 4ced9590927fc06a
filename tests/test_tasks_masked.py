"""The LM-BFF protocol end to end on tiny-roberta: SST-2, SNLI and TREC-shaped k-shot folders written here."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from adazeta.errors import ConfigError
from adazeta.run import run
from helpers import WORDS, compose_cfg

K, SEED = 4, 21


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(3, 8)))


def write_sst2(folder: Path, rng: random.Random) -> None:
    for name, per_class in (("train.tsv", K), ("dev.tsv", K), ("test.tsv", 10)):
        lines = ["sentence\tlabel"] + [f"{sentence(rng)}\t{c}" for c in (0, 1) for _ in range(per_class)]
        (folder / name).write_text("\n".join(lines) + "\n")


def write_snli(folder: Path, rng: random.Random) -> None:
    header = ["index", "captionID", "pairID", "sentence1_binary_parse", "sentence2_binary_parse", "sentence1_parse",
              "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
    for name, per_class in (("train.tsv", K), ("dev.tsv", K), ("test.tsv", 5)):
        lines = ["\t".join(header)]
        for c in ("contradiction", "entailment", "neutral"):
            for i in range(per_class):
                s1, s2 = sentence(rng), sentence(rng)
                votes = [c] * (5 if i % 2 else 1)  # some rows carry five annotator labels, as in SNLI
                lines.append("\t".join([str(i), "x.jpg", "x.jpg#r", "( x )", "( y )", "(ROOT x)", "(ROOT y)", s1, s2,
                                        *votes, c]))
        (folder / name).write_text("\n".join(lines) + "\n")


def write_trec(folder: Path, rng: random.Random) -> None:
    for name, per_class in (("train.csv", K), ("dev.csv", K), ("test.csv", 3)):
        with open(folder / name, "w", newline="") as f:
            writer = csv.writer(f)  # LM-BFF's CSV: no header, label first, quoted when needed
            for c in range(6):
                for _ in range(per_class):
                    writer.writerow([c, "what , " + sentence(rng) + " ?"])


# task: (LM-BFF folder, writer, classes, test rows)
LAYOUTS = {
    "sst2": ("SST-2", write_sst2, 2, 20),
    "snli": ("SNLI", write_snli, 3, 15),
    "trec": ("trec", write_trec, 6, 18),
}


@pytest.fixture
def kshot_data(tmp_path: Path) -> Path:
    rng = random.Random(0)
    root = tmp_path / "data"
    for folder, writer, _, _ in LAYOUTS.values():
        path = root / "lm-bff" / "k-shot" / folder / f"{K}-{SEED}"
        path.mkdir(parents=True)
        writer(path, rng)
    return root


def masked_run(data: Path, out: Path, task: str, method: str, *extra: str) -> dict:
    overrides = ["model=tiny-roberta", f"task={task}", f"method={method}", f"data.dir={data}", f"data.k={K}",
                 f"data.kshot_seed={SEED}", "train.max_steps=3", "train.eval_every=3", "train.batch_size=4",
                 "wandb.mode=disabled", *extra]
    return run(compose_cfg(overrides), out)


@pytest.mark.parametrize("task", sorted(LAYOUTS))
def test_lm_bff_kshot_runs_end_to_end_on_tiny_roberta(task, kshot_data, tmp_path):
    folder, _, n_classes, n_test = LAYOUTS[task]
    record = masked_run(kshot_data, tmp_path, task, "adazeta")
    assert record["status"] == "finished"
    assert (record["num_train"], record["num_dev"], record["num_eval"]) == (K * n_classes, K * n_classes, n_test)
    assert record["data_source"].endswith(f"lm-bff/k-shot/{folder}/{K}-{SEED}")
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["metric"] == "accuracy" and 0.0 <= saved["test_accuracy"] <= 1.0
    assert saved["test_loss"] > 0  # cross-entropy over the label words at the mask


def test_masked_test_set_is_lm_bffs_one_draw_with_seed_42_whatever_the_data_seed(kshot_data, tmp_path):
    """generate_k_shot_data.py (k-shot-1k-test): np.random.seed(42); np.random.shuffle(test_lines); first 1,000, for
    every data seed. Computed here with numpy's legacy global generator, as the reference does."""
    import csv

    import numpy as np

    record = masked_run(kshot_data, tmp_path, "sst2", "zero_shot", "data.num_eval=7")
    assert record["num_eval"] == 7
    n = 2 * 10  # the fixture's sst2 test.tsv: 10 per class
    lines = list(range(n))
    np.random.seed(42)
    np.random.shuffle(lines)
    with open(tmp_path / "predictions" / "test.csv") as f:
        rows = [int(r["row"]) for r in csv.DictReader(f)]
    assert rows == lines[:7]


def test_a_missing_kshot_seed_fails_before_the_model_loads(kshot_data, tmp_path):
    with pytest.raises(ConfigError, match=r"no LM-BFF split .*4-13; available: 4-21"):
        masked_run(kshot_data, tmp_path, "trec", "zero_shot", "data.kshot_seed=13")
    assert not (tmp_path / "result.json").exists()


def test_a_causal_only_task_refuses_masked_models_before_loading(kshot_data, tmp_path):
    with pytest.raises(ConfigError, match="task 'copa' has no prompt format for masked models"):
        masked_run(kshot_data, tmp_path, "copa", "zero_shot")
