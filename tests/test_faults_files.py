"""Files that are there but wrong: a model folder or GGUF file cut short or corrupt, an architecture transformers
rejects, a tokenizer from another model, a data path that is a folder or a link loop, a very long field.

Each is one line on stderr naming the file and the way out, and exit 2, never a traceback; a long field that is
well formed loads.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import transformers

from adazeta import cli
from adazeta.models import byte_tokenizer
from adazeta.tasks.loaders import read_table
from helpers import tiny_overrides
from test_bad_input import GGUF_HEADER, run_cli


def one_line(code: int, err: str, fragment: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("adazeta-run: error: "), err
    assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny Llama saved with save_pretrained, its tokenizer beside it."""
    folder = tmp_path_factory.mktemp("model") / "tiny"
    tokenizer = byte_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def copy_of(folder, tmp_path, weights: bytes | None = None, vocab_size: int | None = None):
    target = tmp_path / "model"
    target.mkdir()
    for path in folder.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    if weights is not None:
        (target / "model.safetensors").write_bytes(weights)
    if vocab_size is not None:  # a model of another vocabulary beside this tokenizer
        config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
        transformers.LlamaForCausalLM(config).save_pretrained(target)
    return target


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[: len(b) // 2], "incomplete metadata"),
    (lambda b: b"", "header too small"),
    (lambda b: b"\xff" * 8 + b[8:], "header too large"),
    (lambda b: b[:8] + b"{not json" + b[17:], "SafetensorError"),
], ids=["truncated", "empty", "huge-header", "corrupt-header"])
def test_a_damaged_safetensors_file_is_one_line(damage, message, saved_model, fixture_data, tmp_path, monkeypatch,
                                               capsys):
    weights = damage((saved_model / "model.safetensors").read_bytes())
    folder = copy_of(saved_model, tmp_path, weights=weights)
    args = [*tiny_overrides(fixture_data), "model=hf", f"model.path={folder}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    one_line(code, err, "may be truncated or corrupt: copy or download it again")
    assert message in err and "Traceback" not in err


def test_a_tokenizer_larger_than_the_models_embedding_is_one_line(saved_model, fixture_data, tmp_path, monkeypatch,
                                                                  capsys):
    folder = copy_of(saved_model, tmp_path, vocab_size=300)  # the tokenizer has more tokens than 300
    args = [*tiny_overrides(fixture_data), "model=hf", f"model.path={folder}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    one_line(code, err, "but the model's embedding only 300 rows")


def test_the_saved_model_itself_loads(saved_model, fixture_data, tmp_path, monkeypatch, capsys):
    """The control: the folder the damaged copies come from runs."""
    args = [*tiny_overrides(fixture_data), "model=hf", f"model.path={saved_model}", "method=zero_shot",
            f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *args])
    cli.main()  # returns: a finished run does not exit
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("metadata", [
    b"",  # a header that promises metadata, then the end of the file
    (5).to_bytes(8, "little") + b"gen",  # a key cut in the middle
    (12).to_bytes(8, "little") + b"general.arch" + (8).to_bytes(4, "little"),  # a value cut short
], ids=["no-metadata", "cut-key", "cut-value"])
def test_a_gguf_file_cut_after_its_header_is_one_line(metadata, fixture_data, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    header = b"GGUF" + (3).to_bytes(4, "little") + (4).to_bytes(8, "little") + (6).to_bytes(8, "little")
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(header + metadata)
    args = [*tiny_overrides(fixture_data), "model=smollm2-135m", f"model.model_dir={tmp_path / 'models'}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    one_line(code, err, "may be truncated or corrupt")
    assert len(GGUF_HEADER) == len(header)


@pytest.mark.parametrize("overrides,message", [
    (["model.architecture.hidden_size=30"], "The hidden size (30) is not a multiple of the number of attention heads"),
    (["model.architecture.model_type=nosuch"], "Unrecognized model identifier: nosuch"),
    (["model.architecture.num_attention_heads=0"], "transformers rejects its `architecture`"),
])
def test_an_architecture_transformers_rejects_is_one_line(overrides, message, fixture_data, tmp_path, monkeypatch,
                                                         capsys):
    args = [*tiny_overrides(fixture_data), *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    one_line(code, err, "fix model.architecture")
    assert message in err
    assert not (tmp_path / "run" / "result.json").exists()


def rte_train(data_dir):
    return data_dir / "superglue" / "RTE" / "train.jsonl"


def _compress(path, how):
    import bz2
    import gzip
    import zipfile

    rows = (path.parent / "val.jsonl").read_bytes()
    if how == "zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("train.jsonl", rows)
    else:
        path.write_bytes({"gzip": gzip.compress, "bzip2": bz2.compress}[how](rows))


@pytest.mark.parametrize("make,message", [
    (lambda p: p.mkdir(), "a folder where a data file should be"),
    (lambda p: os.mkfifo(p), "a named pipe (FIFO) where a regular data file should be"),
    (lambda p: _compress(p, "gzip"), "a gzip-compressed file where a plain-text data file should be (gunzip it"),
    (lambda p: _compress(p, "bzip2"), "a bzip2-compressed file where a plain-text data file should be"),
    (lambda p: _compress(p, "zip"), "a zip archive where a plain-text data file should be (unzip it"),
    (lambda p: os.symlink(p, p), "a symlink loop where a data file should be"),
    (lambda p: os.symlink(p.parent / "gone.jsonl", p), "a broken symlink where a data file should be"),
], ids=["folder", "fifo", "gzip", "bzip2", "zip", "loop", "broken-link"])
def test_a_data_path_that_is_not_a_file_says_what_it_is(make, message, fixture_data, tmp_path, monkeypatch, capsys):
    path = rte_train(fixture_data)
    path.unlink()
    make(path)
    args = [*tiny_overrides(fixture_data), f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    one_line(code, err, message)
    assert str(path) in err


def test_a_field_longer_than_the_csv_modules_default_limit_loads(tmp_path):
    long = "word " * 40_000  # 200,000 characters, over csv's default 131,072
    path = tmp_path / "train.tsv"
    path.write_text(f"sentence\tlabel\n{long}\t1\nshort\t0\n", encoding="utf-8")
    rows = read_table(path, ["sentence", "label"])
    assert [len(r["sentence"]) for r in rows] == [len(long), 5]


# --- saved adapters (method=eval eval.from=..., python -m adazeta.export) ------------------------------------------


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """Run directories of a tiny LoRA run (peft's folder) and a tiny TT run (adazeta's), each with its adapter/."""
    from adazeta.run import run
    from helpers import compose_cfg, write_fixture_data

    root = tmp_path_factory.mktemp("saved")
    data = write_fixture_data(root / "data")
    runs = {}
    for method in ("mezo_lora", "adazeta"):
        runs[method] = root / method
        run(compose_cfg(tiny_overrides(data, f"method={method}", "train.max_steps=1")), runs[method])
        assert (runs[method] / "adapter" / "adapter_model.safetensors").is_file()
    return runs


def damaged_copy(run_dir, tmp_path, name, damage):
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(run_dir, copy)
    path = copy / "adapter" / name
    path.write_bytes(damage(path.read_bytes()))
    return copy


def export_cli(monkeypatch, capsys, args):
    from adazeta import export

    with pytest.raises(SystemExit) as exit_info:
        export.main(args)
    return exit_info.value.code, capsys.readouterr().err


DAMAGES = [
    ("mezo_lora", "adapter_model.safetensors", lambda b: b[: len(b) // 2], "is damaged (truncated: "),
    ("adazeta", "adapter_model.safetensors", lambda b: b[: len(b) // 2], "is damaged (truncated: "),
    ("adazeta", "adapter_model.safetensors", lambda b: b[:4], "is damaged (4 bytes: too short for its header)"),
    ("adazeta", "adapter_model.safetensors", lambda b: b[:8] + b"{not json" + b[17:], "its header does not parse"),
    ("adazeta", "adazeta_adapter.json", lambda b: b[: len(b) // 3], "adazeta_adapter.json is damaged (JSONDecodeError"),
    ("mezo_lora", "adapter_config.json", lambda b: b"[1, 2]", "adapter_config.json is damaged (ValueError: not a JSON"),
]


@pytest.mark.parametrize("method,name,damage,message", DAMAGES,
                         ids=["lora-cut", "tt-cut", "tt-stub", "tt-header", "tt-json", "lora-json"])
def test_damaged_saved_adapters_are_one_line_before_the_model_loads(method, name, damage, message, saved_runs,
                                                                    fixture_data, tmp_path, monkeypatch, capsys):
    """Under method=eval and under the export, a cut or corrupt weights file, or an adapter config that is not a
    JSON object, is named with the way out before any model loads; the damaged folder is left as it was."""
    import adazeta.build as build_module
    import adazeta.models as models_module

    source = damaged_copy(saved_runs[method], tmp_path, name, damage)
    before = (source / "adapter" / name).read_bytes()
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(models_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    args = [*tiny_overrides(fixture_data), "method=eval", f"eval.from={source}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    one_line(code, err, message)
    assert "restore the folder from a copy" in err and str(source / "adapter" / name) in err
    code, err = export_cli(monkeypatch, capsys, [str(source), str(tmp_path / "out")])
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert err.startswith("adazeta.export: error: ") and not (tmp_path / "out").exists()
    assert (source / "adapter" / name).read_bytes() == before


def test_a_lora_rank_other_than_the_saved_weights_keeps_the_sizes_in_its_line(saved_runs, fixture_data, tmp_path,
                                                                              monkeypatch, capsys):
    """An adapter_config.json whose rank differs from its weights': peft's error lists every tensor under a header
    line; the line keeps the first tensor's two sizes."""
    def other_rank(text):
        config = json.loads(text)
        config["r"] = config["r"] + 3
        return json.dumps(config).encode()

    source = damaged_copy(saved_runs["mezo_lora"], tmp_path, "adapter_config.json", other_rank)
    args = [*tiny_overrides(fixture_data), "method=eval", f"eval.from={source}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    one_line(code, err, "cannot load the LoRA adapters of")
    assert "size mismatch for " in err and "torch.Size([5, " in err and "torch.Size([8, " in err, err
    assert "more like it" in err


@pytest.mark.parametrize("status", ["interrupted", "failed"])
def test_eval_from_a_run_that_did_not_end_says_so_and_how_to_resume(status, saved_runs, fixture_data, tmp_path,
                                                                     monkeypatch, capsys):
    """A run stopped before it saved its adapters is not a run "with train.save=none": the line names its status,
    its reason and the step the same command resumes from."""
    import shutil

    source = tmp_path / "stopped"
    shutil.copytree(saved_runs["adazeta"], source)
    shutil.rmtree(source / "adapter")
    record = json.loads((source / "result.json").read_text())
    record.update(status=status, reason="SIGTERM at step 1", checkpoint_step=1)
    (source / "result.json").write_text(json.dumps(record))
    args = [*tiny_overrides(fixture_data), "method=eval", f"eval.from={source}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    one_line(code, err, f"holds no saved adapters: its run was {status} before it saved them (SIGTERM at step 1); "
                        "run the same command again to resume from its checkpoint at step 1")
    assert "train.save=none" not in err
