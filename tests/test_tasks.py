"""Task specs and loaders: templates, label normalisation, seeded sampling, local files and their errors."""

from __future__ import annotations

import pytest

from adazeta.errors import ConfigError
from adazeta.settings import parse
from adazeta.tasks.loaders import DataConfig, load_rows, load_task
from helpers import SHARED_DATA, compose_cfg, needs_shared_data


def spec(name: str):
    return parse(compose_cfg([f"task={name}"])).task


def test_rte_template_and_candidates():
    rte = spec("rte").for_family("causal")
    ex = rte.render({"premise": "A cat sat.", "hypothesis": "A cat exists.", "label": 0}, 0)
    assert ex.prompt == 'A cat sat.\nDoes this mean that "A cat exists." is true? Yes or No?\n'
    assert ex.candidates == ["Yes", "No"] and ex.gold == 0


def test_sst2_templates_for_both_families():
    s = spec("sst2")
    causal = s.for_family("causal")
    assert causal.render({"sentence": "fine film", "label": 1}, 1).prompt == "fine film It was"
    # GLUE sentences end in a space: stripped, as MeZO does, so the prompt has no double space
    assert causal.render({"sentence": "fine film ", "label": 1}, 1).prompt == "fine film It was"
    masked = s.for_family("masked", "<mask>").render({"sentence": "fine film", "label": 1}, 1)
    assert masked.prompt == "fine film It was<mask>." and masked.candidates == ["terrible", "great"]


def test_labels_normalise_from_strings_ints_and_bools():
    s = spec("rte")
    assert s.label_index("entailment", "x") == 0 and s.label_index("not_entailment", "x") == 1
    assert s.label_index(1, "x") == 1  # the Hub's ClassLabel index
    with pytest.raises(ConfigError, match="label 'maybe'"):
        s.label_index("maybe", "row 3")


@pytest.mark.parametrize("task, raw, gold", [
    # An integer in a file means the dataset's own order where the task lists its labels in another (MeZO's,
    # LM-BFF's): BoolQ 0 = false, 1 = true; MNLI / SNLI 0 = entailment, 1 = neutral, 2 = contradiction.
    ("boolq", 0, False), ("boolq", 1, True), ("boolq", "0", False), ("boolq", True, True), ("boolq", "false", False),
    ("mnli", 0, "entailment"), ("mnli", 1, "neutral"), ("mnli", 2, "contradiction"), ("snli", "2", "contradiction"),
    ("mnli", "neutral", "neutral"),
    # Elsewhere the position in labels, which is the dataset's order (RTE 0 = entailment, SST-2 0 = negative)
    ("rte", 1, "not_entailment"), ("sst2", 1, 1),
    # Integral floats, as pandas writes a label column with a missing value: 1.0 is 1
    ("sst2", "1.0", 1), ("sst2", 0.0, 0), ("sst5", "4.0", 4), ("boolq", 1.0, True),
])
def test_integer_labels_mean_the_datasets_own_order(task, raw, gold):
    s = spec(task)
    assert s.labels[s.label_index(raw, "x")] == gold


def test_a_fractional_or_out_of_range_number_is_no_label():
    for raw in ("0.5", 1.5, 2, "7"):
        with pytest.raises(ConfigError, match="is not one of"):
            spec("sst2").label_index(raw, "row 9")
    with pytest.raises(ConfigError, match=r"int_labels=\['x', 'y'\] must list the labels"):
        parse(compose_cfg(["task=rte", "task.int_labels=[x,y]"]))


def test_sampling_is_seeded_and_disjoint(fixture_data):
    data = DataConfig(num_train=20, num_dev=10, num_eval=8, dir=str(fixture_data))
    a = load_task(spec("rte").for_family("causal"), data, seed=1)
    b = load_task(spec("rte").for_family("causal"), data, seed=1)
    c = load_task(spec("rte").for_family("causal"), data, seed=2)
    assert [e.prompt for e in a.train] == [e.prompt for e in b.train]
    assert [e.prompt for e in a.train] != [e.prompt for e in c.train]
    assert (len(a.train), len(a.dev), len(a.eval)) == (20, 10, 8)
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.dev}


def test_malformed_rows_name_file_and_line(tmp_path):
    folder = tmp_path / "superglue" / "RTE"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text('{"premise": "a", "hypothesis": "b", "label": "entailment"}\n{"premise": "a"\n')
    (folder / "val.jsonl").write_text('{"premise": "a", "hypothesis": "b", "label": "entailment"}\n')
    with pytest.raises(ConfigError, match=r"train\.jsonl:2: not valid JSON"):
        load_rows(spec("rte").for_family("causal"), "train", str(tmp_path))
    (folder / "train.jsonl").write_text('{"premise": "a", "label": "entailment"}\n')
    with pytest.raises(ConfigError, match=r"train\.jsonl:1: missing field 'hypothesis'"):
        load_rows(spec("rte").for_family("causal"), "train", str(tmp_path))
    sst = tmp_path / "glue" / "SST-2"
    sst.mkdir(parents=True)
    (sst / "train.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t0\textra\n")
    (sst / "dev.tsv").write_text("sentence\tlabel\n")
    (sst / "test.tsv").write_text("sentence\tlabel\n")
    with pytest.raises(ConfigError, match=r"train\.tsv:3: 3 columns, expected 2"):
        load_rows(spec("sst2").for_family("causal"), "train", str(tmp_path))


def test_windows_files_load_like_unix_ones(tmp_path):
    """A byte-order mark and CRLF line ends (as Windows editors save) change no row, in JSON lines or TSV."""
    rte = tmp_path / "superglue" / "RTE"
    rte.mkdir(parents=True)
    lines = ['{"premise": "a", "hypothesis": "b", "label": "entailment"}', '{"premise": "c", "hypothesis": "d", "label": 1}']
    (rte / "train.jsonl").write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode("utf-8"))
    rows, _ = load_rows(spec("rte").for_family("causal"), "train", str(tmp_path))
    assert [(r["premise"], r["hypothesis"], r["label"]) for r in rows] == [("a", "b", 0), ("c", "d", 1)]
    sst = tmp_path / "glue" / "SST-2"
    sst.mkdir(parents=True)
    (sst / "train.tsv").write_bytes("\ufeffsentence\tlabel\r\ngood\t1\r\nbad\t0\r\n".encode("utf-8"))
    (sst / "dev.tsv").write_text("sentence\tlabel\n")
    rows, _ = load_rows(spec("sst2").for_family("causal"), "train", str(tmp_path))
    assert [(r["sentence"], r["label"]) for r in rows] == [("good", 1), ("bad", 0)]


@needs_shared_data
@pytest.mark.parametrize("task,n_train,n_eval", [("rte", 2490, 277), ("sst2", 60614 + 6735, 872)])
def test_real_local_files_load_with_their_sizes(task, n_train, n_eval):
    train, _ = load_rows(spec(task).for_family("causal"), "train", str(SHARED_DATA))
    evals, _ = load_rows(spec(task).for_family("causal"), "eval", str(SHARED_DATA))
    assert (len(train), len(evals)) == (n_train, n_eval)
    assert {r["label"] for r in train} == {0, 1}
