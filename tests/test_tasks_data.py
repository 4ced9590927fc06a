"""Task data: the real local files load with the sizes of ../shared/data/README.md, k-shot sampling, the Hub path
(column renames, class names, dropped labels) on in-memory datasets, and one-line errors on bad files."""

from __future__ import annotations

import json
from collections import Counter

import datasets
import numpy as np
import pytest

from adazeta.errors import ConfigError
from adazeta.settings import parse
from adazeta.tasks.loaders import (
    DataConfig, KSHOT_SEEDS, check_data, kshot_indices, load_rows, load_task, local_files, split_sizes,
)
from adazeta.tasks.spec import BoundTask, TaskSpec
from helpers import SHARED_DATA, compose_cfg, needs_shared_data, write_fixture_data


def spec(name: str, *overrides: str) -> TaskSpec:
    return parse(compose_cfg([f"task={name}", *overrides])).task


def fake_hub(monkeypatch, splits: dict[str, datasets.Dataset]) -> list[tuple]:
    """``datasets.load_dataset`` answering from memory; returns the list of (path, name, split) asked for."""
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        if split not in splits:
            raise ValueError(f'Unknown split "{split}".\nShould be one of {sorted(splits)}.')
        return splits[split]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


# ----------------------------------------------------------------------------------------------------------------
# Real data (../shared/data)

# (task, train rows, eval rows, number of classes) as ../shared/data/README.md gives them.
REAL_CAUSAL = [
    ("rte", 2490, 277, 2),
    ("cb", 250, 56, 3),
    ("copa", 400, 100, 2),
    ("wic", 5428, 638, 2),
    ("multirc", 27243, None, 2),
    ("sst2", 60614 + 6735, 872, 2),
]


@needs_shared_data
@pytest.mark.parametrize("task,n_train,n_eval,n_classes", REAL_CAUSAL)
def test_real_superglue_and_glue_files_load_with_their_sizes(task, n_train, n_eval, n_classes):
    train, source = load_rows(spec(task).for_family("causal"), "train", str(SHARED_DATA))
    evals, _ = load_rows(spec(task).for_family("causal"), "eval", str(SHARED_DATA))
    assert len(train) == n_train and source.startswith("local:")
    if n_eval is not None:
        assert len(evals) == n_eval
    assert {r["label"] for r in train} == set(range(n_classes)) == {r["label"] for r in evals}


@needs_shared_data
def test_real_multirc_is_flattened_to_one_row_per_answer():
    train, _ = load_rows(spec("multirc").for_family("causal"), "train", str(SHARED_DATA))
    evals, _ = load_rows(spec("multirc").for_family("causal"), "eval", str(SHARED_DATA))
    assert len({r["idx"]["paragraph"] for r in train}) == 456
    assert len({r["idx"]["paragraph"] for r in evals}) == 83
    assert all(r["paragraph"] and r["question"] and r["answer"] for r in train[:50])


@needs_shared_data
def test_real_boolq_has_validation_only_and_says_how_to_train():
    boolq = spec("boolq").for_family("causal")
    evals, _ = load_rows(boolq, "eval", str(SHARED_DATA))
    assert len(evals) == 3270 and {r["label"] for r in evals} == {0, 1}
    with pytest.raises(ConfigError, match=r"BoolQ/train\.jsonl.*task\.local\.train_dir=fewglue32/BoolQ"):
        load_rows(boolq, "train", str(SHARED_DATA))
    fewglue = spec("boolq", "task.local.train_dir=fewglue32/BoolQ").for_family("causal")
    train, _ = load_rows(fewglue, "train", str(SHARED_DATA))
    assert len(train) == 32
    data = load_task(fewglue, DataConfig(num_dev=8, num_eval=10, dir=str(SHARED_DATA)), seed=0)
    assert (len(data.train), len(data.dev), len(data.eval)) == (24, 8, 10)
    assert data.source.endswith("fewglue32/BoolQ (test: local:" + str(SHARED_DATA / "superglue/BoolQ") + ")")
    # zero-shot needs only the validation file; what needs train says so
    check_data(boolq, DataConfig(dir=str(SHARED_DATA)))
    with pytest.raises(ConfigError, match=r"^method 'mezo' needs the train split to train: data file not found: "):
        check_data(boolq, DataConfig(dir=str(SHARED_DATA)), "method 'mezo' needs the train split to train")
    zero_shot = load_task(boolq, DataConfig(num_eval=10, dir=str(SHARED_DATA)), 0, need_train=False)
    assert (len(zero_shot.train), len(zero_shot.dev), len(zero_shot.eval)) == (0, 0, 10)


# LM-BFF 16-shot splits: (task, classes, test rows or None where the copy has no test file)
REAL_KSHOT = [("sst2", 2, 872), ("sst5", 5, 2210), ("rte", 2, 277), ("mnli", 3, None), ("snli", 3, None)]


@needs_shared_data
@pytest.mark.parametrize("task,n_classes,n_test", REAL_KSHOT)
@pytest.mark.parametrize("seed", KSHOT_SEEDS)
def test_real_lm_bff_16_shot_splits(task, n_classes, n_test, seed):
    s = spec(task)
    for split in ("train", "dev"):
        rows, source = load_rows(s.for_family("masked"), split, str(SHARED_DATA), k=16, kshot_seed=seed)
        assert Counter(r["label"] for r in rows) == {c: 16 for c in range(n_classes)}
        assert source.endswith(f"16-{seed}")
        assert all(r[f] for r in rows for f in s.text_fields)
    if n_test is not None:
        rows, _ = load_rows(s.for_family("masked"), "eval", str(SHARED_DATA), k=16, kshot_seed=seed)
        assert len(rows) == n_test and {r["label"] for r in rows} == set(range(n_classes))
    else:
        with pytest.raises(ConfigError, match="data file not found.*test"):
            load_rows(s.for_family("masked"), "eval", str(SHARED_DATA), k=16, kshot_seed=seed)


@needs_shared_data
def test_real_lm_bff_test_set_is_subsampled_to_num_eval():
    data = load_task(spec("sst5").for_family("masked", "<m>"), DataConfig(dir=str(SHARED_DATA), kshot_seed=42), seed=0)
    assert (len(data.train), len(data.dev), len(data.eval)) == (80, 80, 1000)
    again = load_task(spec("sst5").for_family("masked", "<m>"), DataConfig(dir=str(SHARED_DATA), kshot_seed=42), seed=7)
    assert [e.prompt for e in data.eval] == [e.prompt for e in again.eval]  # the data seed fixes it, not the run seed
    assert all(e.prompt.endswith("It was<m>.") for e in data.train)


@needs_shared_data
def test_mezo_protocol_keeps_100_dev_for_cb_and_copa():
    for task, n_train in (("cb", 150), ("copa", 300)):
        data = load_task(spec(task).for_family("causal"), DataConfig(dir=str(SHARED_DATA), num_eval=20), seed=0)
        assert (len(data.train), len(data.dev), len(data.eval)) == (n_train, 100, 20)


# ----------------------------------------------------------------------------------------------------------------
# Sampling


def mezo_subset(n: int, seed: int, num: int) -> list[int]:
    """MeZO's ``Dataset.sample_subset``: under a temporarily seeded global NumPy RNG, the first ``num`` of a
    permutation of the split (written here independently of the loader)."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        return np.random.permutation(n).tolist()[:num]
    finally:
        np.random.set_state(state)


def rendered(task: BoundTask, rows: list[dict], idx: list[int]) -> list:
    return [task.render(rows[i], rows[i]["label"]) for i in idx]


@pytest.mark.parametrize("seed", [0, 1, 42])
def test_the_test_subset_is_mezos_draw_for_the_seed_whatever_train_and_dev_take(tmp_path, seed):
    data_dir = write_fixture_data(tmp_path, n_train=120, n_eval=40)
    rte = spec("rte").for_family("causal")
    rows, _ = load_rows(rte, "eval", str(data_dir))
    expected = rendered(rte, rows, mezo_subset(40, seed, 15))
    for num_train, num_dev in ((20, 10), (100, 20), (8, 4)):
        data = load_task(rte, DataConfig(num_train=num_train, num_dev=num_dev, num_eval=15, dir=str(data_dir)),
                         seed=seed)
        assert data.eval == expected
    # num_eval beyond the split: the whole split, in the order of MeZO's permutation
    whole = load_task(rte, DataConfig(num_train=20, num_dev=10, num_eval=1000, dir=str(data_dir)), seed)
    assert whole.eval == rendered(rte, rows, mezo_subset(40, seed, 1000)) and len(whole.eval) == 40
    # data.seed, when set, is the seed of the draw (as MeZO's train_set_seed)
    other = load_task(rte, DataConfig(num_eval=15, seed=seed, dir=str(data_dir)), seed=seed + 7)
    assert other.eval == expected


def test_train_and_dev_are_mezos_train_draw(tmp_path):
    # MeZO draws num_train + num_dev rows of the train split with the seed; dev is the last num_dev of them.
    data_dir = write_fixture_data(tmp_path, n_train=120, n_eval=40)
    rte = spec("rte").for_family("causal")
    rows, _ = load_rows(rte, "train", str(data_dir))
    drawn = mezo_subset(120, 3, 30 + 20)
    data = load_task(rte, DataConfig(num_train=30, num_dev=20, num_eval=5, dir=str(data_dir)), seed=3)
    assert data.train == rendered(rte, rows, drawn[:30]) and data.dev == rendered(rte, rows, drawn[30:])


@needs_shared_data
@pytest.mark.parametrize("task", ["boolq", "multirc"])
def test_real_test_subsets_are_mezos(task):
    bound = spec(task).for_family("causal")
    rows, _ = load_rows(bound, "eval", str(SHARED_DATA))
    data = load_task(bound, DataConfig(num_eval=1000, dir=str(SHARED_DATA)), seed=0, need_train=False)
    assert data.eval == rendered(bound, rows, mezo_subset(len(rows), 0, 1000))


def test_split_sizes_follow_mezo():
    assert split_sizes(5000, 1000, 500) == (1000, 500)
    assert split_sizes(400, 1000, 100) == (300, 100)  # COPA
    assert split_sizes(32, 1000, 500) == (16, 16)  # FewGLUE: dev never takes more than half
    with pytest.raises(ConfigError, match="at least 2"):
        split_sizes(1, 10, 10)
    assert split_sizes(554, 1000, 500, dev_at_most_half=False) == (54, 500)  # WSC as MeZO's run.py splits it
    with pytest.raises(ConfigError, match="none is left to train on"):
        split_sizes(100, 1000, 100, dev_at_most_half=False)


def test_kshot_indices_take_k_per_class_disjoint_and_seeded():
    labels = [i % 3 for i in range(300)]
    train, dev = kshot_indices(labels, 16, 13)
    assert Counter(labels[i] for i in train) == {0: 16, 1: 16, 2: 16}
    assert Counter(labels[i] for i in dev) == {0: 16, 1: 16, 2: 16}
    assert not set(train) & set(dev)
    assert kshot_indices(labels, 16, 13) == (train, dev)
    assert kshot_indices(labels, 16, 21)[0] != train


# ----------------------------------------------------------------------------------------------------------------
# The Hub path, on in-memory datasets


def nli_dataset(n: int, label_names: list[str], with_unlabelled: int = 0) -> datasets.Dataset:
    features = datasets.Features(
        {"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
         "label": datasets.ClassLabel(names=label_names)}
    )
    rows = [{"premise": f"p{i}", "hypothesis": f"h{i}", "label": i % len(label_names)} for i in range(n)]
    data = datasets.Dataset.from_list(rows, features=features)
    if with_unlabelled:  # SNLI marks pairs without a gold label with -1
        raw = datasets.Features({**features, "label": datasets.Value("int64")})
        unlabelled = [{"premise": "x", "hypothesis": "y", "label": -1}] * with_unlabelled
        extra = datasets.Dataset.from_list(unlabelled, features=raw)
        data = datasets.concatenate_datasets([data.cast(raw), extra])
    return data


def test_hub_class_names_map_onto_the_task_label_order(monkeypatch):
    # GLUE's MNLI numbers entailment 0, neutral 1, contradiction 2; the task lists contradiction first (LM-BFF).
    names = ["entailment", "neutral", "contradiction"]
    calls = fake_hub(monkeypatch, {"train": nli_dataset(90, names), "validation_matched": nli_dataset(30, names)})
    data = load_task(spec("mnli").for_family("masked", "<m>"), DataConfig(num_eval=12, k=4, kshot_seed=21), seed=0)
    assert ("nyu-mll/glue", "mnli", "validation_matched") in calls
    assert (len(data.train), len(data.dev), len(data.eval)) == (12, 12, 12)
    s = spec("mnli")
    for ex in data.train + data.eval:
        i = int(ex.prompt.rsplit(", h", 1)[1])  # "p{i} without its last character?<m>, h{i}"
        assert s.labels[ex.gold] == names[i % 3]
    assert Counter(ex.gold for ex in data.dev) == {0: 4, 1: 4, 2: 4}
    assert not {e.prompt for e in data.train} & {e.prompt for e in data.dev}


def test_hub_rows_without_gold_label_are_dropped(monkeypatch):
    names = ["entailment", "neutral", "contradiction"]
    fake_hub(monkeypatch, {"train": nli_dataset(60, names, with_unlabelled=5), "validation": nli_dataset(9, names, 3)})
    rows, source = load_rows(spec("snli").for_family("masked"), "eval", None)
    assert len(rows) == 9 and source == "hub:stanfordnlp/snli"


def test_hub_columns_are_renamed_to_the_task_fields(monkeypatch):
    features = datasets.Features({"text": datasets.Value("string"), "coarse_label": datasets.ClassLabel(
        names=["ABBR", "ENTY", "DESC", "HUM", "LOC", "NUM"])})
    ds = datasets.Dataset.from_list([{"text": f"q{i} ?", "coarse_label": i % 6} for i in range(60)], features=features)
    fake_hub(monkeypatch, {"train": ds, "test": ds})
    data = load_task(spec("trec").for_family("masked", "<m>"), DataConfig(num_eval=6, k=2), seed=0)
    assert len(data.train) == 12 and data.train[0].prompt.startswith("<m>: q")
    abbr = next(e for e in data.eval if int(e.prompt.split()[1][1:]) % 6 == 0)  # "<m>: q{i} ?"
    assert abbr.candidates[abbr.gold] == "Expression"  # ABBR, whatever index the Hub gives it


def test_a_hub_failure_is_one_line(monkeypatch):
    fake_hub(monkeypatch, {})
    with pytest.raises(ConfigError, match=r"could not load aps/super_glue/cb:train from the Hub") as err:
        load_task(spec("cb").for_family("causal"), DataConfig(), seed=0)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------------------------
# Local files: layouts and errors


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_kshot_folder_missing_lists_the_available_ones(tmp_path):
    write(tmp_path / "lm-bff/k-shot/SST-2/16-13/train.tsv", "sentence\tlabel\na\t0\n")
    with pytest.raises(ConfigError, match=r"no LM-BFF split .*16-87; available: 16-13; set data.k"):
        local_files(spec("sst2").for_family("masked"), str(tmp_path), 16, 87)


def test_snli_rows_with_extra_annotator_labels_read_the_last_column(tmp_path):
    header = "index\tsentence1\tsentence2\tlabel1\tgold_label\n"
    folder = tmp_path / "lm-bff/k-shot/SNLI/2-13"
    write(folder / "train.tsv", header + "0\tA.\tB.\tneutral\tneutral\n1\tC.\tD.\tneutral\tentailment\tentailment\n")
    rows, _ = load_rows(spec("snli").for_family("masked"), "train", str(tmp_path), k=2, kshot_seed=13)
    assert [(r["premise"], r["label"]) for r in rows] == [("A.", 2), ("C.", 1)]
    write(folder / "train.tsv", header + "0\tA.\tB.\n")
    with pytest.raises(ConfigError, match=r"train\.tsv:2: 3 columns, expected 5"):
        load_rows(spec("snli").for_family("masked"), "train", str(tmp_path), k=2, kshot_seed=13)


def test_headerless_csv_with_quotes(tmp_path):
    write(tmp_path / "lm-bff/k-shot/sst-5/4-13/train.csv", '3,"good , and long"\n0,plain\n')
    rows, _ = load_rows(spec("sst5").for_family("masked"), "train", str(tmp_path), k=4, kshot_seed=13)
    assert [(r["sentence"], r["label"]) for r in rows] == [("good , and long", 3), ("plain", 0)]
    write(tmp_path / "lm-bff/k-shot/sst-5/4-13/train.csv", "7,too positive\n")
    with pytest.raises(ConfigError, match=r"train\.csv:1: label 7 is not one of"):
        load_rows(spec("sst5").for_family("masked"), "train", str(tmp_path), k=4, kshot_seed=13)


def test_nested_multirc_errors_name_file_and_line(tmp_path):
    good = {"idx": 0, "passage": {"text": "P.", "questions": [
        {"question": "Q?", "idx": 0, "answers": [{"text": "A", "label": 1, "idx": 0}, {"text": "B", "label": 0}]}]}}
    lines = json.dumps(good) + "\n" + json.dumps({"passage": {}}) + "\n"
    path = write(tmp_path / "superglue/MultiRC/train.jsonl", lines)
    write(tmp_path / "superglue/MultiRC/val.jsonl", json.dumps(good) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: missing 'passage.text'; expected the MultiRC \(passage.text"):
        load_rows(spec("multirc").for_family("causal"), "train", str(tmp_path))
    rows, _ = load_rows(spec("multirc").for_family("causal"), "eval", str(tmp_path))
    assert [(r["answer"], r["label"]) for r in rows] == [("A", 1), ("B", 0)]


def test_string_labels_normalise_with_the_line_in_errors(tmp_path):
    write(tmp_path / "superglue/CB/train.jsonl", '{"premise": "a", "hypothesis": "b", "label": "Neutral"}\n'
          '{"premise": "a", "hypothesis": "b", "label": "unsure"}\n')
    with pytest.raises(ConfigError, match=r"CB/train\.jsonl:2: label 'unsure' is not one of"):
        load_rows(spec("cb").for_family("causal"), "train", str(tmp_path))


def test_a_task_without_local_layout_falls_back_to_the_hub(monkeypatch, tmp_path):
    ds = datasets.Dataset.from_list([{"title": "T", "context": "C", "question": "Q",
                                      "answers": {"text": ["a"], "answer_start": [0]}}] * 4)
    calls = fake_hub(monkeypatch, {"train": ds, "validation": ds})
    data = load_task(spec("squad").for_family("causal"), DataConfig(dir=str(tmp_path), num_train=2, num_dev=2,
                                                                    num_eval=2), 0)
    assert calls[0][0] == "rajpurkar/squad" and len(data.train) == 2 and data.eval[0].meta["answers"] == ["a"]
