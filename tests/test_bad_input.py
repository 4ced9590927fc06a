"""Bad input as a user types it: each case is one line on stderr naming the problem, and exit status 2.

The command runs in-process (``adazeta.cli.main`` with its argv), on the tiny model and fixture data, so each
case costs a config composition, not a model load: every one of them must fail before the model loads.
"""

from __future__ import annotations

import sys

import pytest
import torch

from adazeta import cli
from helpers import tiny_overrides

# (overrides, a fragment the one-line message must contain)
CASES = [
    # Hydra's own mistakes: group options, unknown keys, sweep syntax outside a sweep
    (["method=adazet"], "method has no option 'adazet'; known: adapter, adazeta"),
    (["method=adazet"], "did you mean 'adazeta'?"),
    (["task=sst3"], "task has no option 'sst3'"),
    (["model=smollm"], "model has no option 'smollm'"),
    (["schedule=adaptiv"], "did you mean 'adaptive'?"),
    (["experiment=tabel2_llama"], "did you mean 'table2_llama'?"),
    (["train.foo=1"], "train has no key 'foo'; known: batch_size"),
    (["train.max_step=5"], "did you mean 'max_steps'?"),
    (["+train.foo=1"], "train: unknown key(s) foo"),
    (["method.optimizer.lrr=1e-3"], "did you mean 'lr'?"),
    (["adapter=lora"], "adapter is part of the method; choose it with adapter@method.adapter=lora"),
    (["optimizer@method.optimizer=adamx"], "optimizer has no option 'adamx'; known: adamw"),
    (["seed=0,1"], "seed=0,1 lists several values: add -m"),
    (["seed=[0"], "seed=[0:"),
    # wrong types, named by their override path
    (["method.optimizer.lr=abc"], "method.optimizer.lr='abc' must be a number"),
    (["method.optimizer.eps=true"], "method.optimizer.eps=true must be a number"),
    (["train.max_steps=null"], "train.max_steps=null must be an integer"),
    (["train.max_steps=2.5"], "train.max_steps=2.5 must be an integer"),
    (["train.batch_size=abc"], "train.batch_size='abc' must be an integer"),
    (["train.keep_best=maybe"], "train.keep_best='maybe' must be true or false"),
    (["method.adapter.rank=2.5"], "method.adapter.rank=2.5 must be an integer"),
    (["data.num_train=many"], "data.num_train='many' must be an integer"),
    (["divergence.factor=high"], "divergence.factor='high' must be a number"),
    (["wandb.tags=abc"], "wandb.tags='abc' must be a list or null"),
    (["model.max_length=1e3"], "model.max_length=1000.0 must be an integer"),
    # values out of range
    (["seed=-1"], "seed=-1 must be an integer in [0, 2**32 - 1]"),
    (["seed=1e20"], "must be an integer in [0, 2**32 - 1]"),
    (["seed=abc"], "seed='abc' must be an integer"),
    (["method.optimizer.lr=-1"], "method.optimizer.lr=-1.0 must be > 0"),
    (["method.optimizer.eps=0"], "method.optimizer.eps=0.0 must be > 0"),
    (["method.optimizer.reduction=median"], "method.optimizer.reduction='median' must be one of mean, sum"),
    (["method.optimizer.estimator=forward"], "method.optimizer.estimator='forward' must be one of"),
    (["method.optimizer.query_chunk=0"], "method.optimizer.query_chunk=0 must be an int >= 1"),
    (["train.max_steps=0"], "train.max_steps=0 must be >= 1"),
    (["train.batch_size=6", "train.grad_accum=4"], "not divisible by train.grad_accum=4"),
    (["train.checkpoint_every=0"], "train.checkpoint_every=0 must be >= 1 or null"),
    (["train.max_forward_passes=0"], "train.max_forward_passes=0 must be >= 1 or null"),
    (["divergence.factor=1.0"], "divergence.factor=1.0 must be > 1"),
    (["divergence.rule=worst"], "divergence.rule='worst' is not one of best, initial"),
    (["divergence.collapse_fraction=0"], "divergence.collapse_fraction=0.0 must be in (0, 1]"),
    (["wandb.mode=sometimes"], "wandb.mode='sometimes' is not one of auto, online, offline, disabled"),
    (["method.adapter.rank=0"], "method.adapter.rank=0 must be >= 1"),
    (["method.adapter.init=zeros"], "method.adapter.init='zeros' is unknown"),
    (["method.adapter.placement=everywhere"], "method.adapter.placement='everywhere' is unknown"),
    (["method=sparse_mezo", "method.optimizer.sparsity=1.0"], "method.optimizer.sparsity=1.0 must be in [0, 1)"),
    (["method=sparse_mezo", "method.optimizer.mask=top"], "method.optimizer.mask='top' must be one of"),
    (["method=sparse_mezo", "method.optimizer.weight_decay=0.1"], "Sparse-MeZO moves only masked entries"),
    (["method=lora", "method.adapter.r=0"], "method.adapter.r=0 must be >= 1"),
    (["method=lora", "method.optimizer.betas=[0.9]"], "method.optimizer.betas=[0.9] must be two values"),
    (["method=icl", "method.demonstrations.k=0"], "method.demonstrations.k=0 must be >= 1"),
    (["schedule=constant", "schedule.q=0"], "schedule.q=0 must be"),
    (["force=maybe"], "force='maybe' must be true or false"),
    (["dry_run=yes"], "dry_run='yes' must be true or false"),
    (["data.k=0"], "data.k=0 must be >= 1"),
    (["data.kshot_seed=-1"], "data.kshot_seed=-1 must be >= 0"),
    (["data.num_eval=-5"], "data.num_eval=-5 must be >= 1"),
    (["method=mezo", "method.optimizer.batched_queries=true"], "batched_queries=true needs an adapter method"),
    (["model.dtype=fp8"], "model.dtype='fp8' is not one of fp32, bf16, fp16"),
    (["model.device=tpu"], "model.device='tpu' must be auto, cpu, cuda or cuda:N"),
    (["model.max_length=4"], "model.max_length=4 must be >= 8"),
    (["model.quantize=int4"], "model.quantize='int4' is not null or one of int8, bf16"),
    (["method=mezo", "model.quantize=bf16"], "model.quantize=bf16 freezes the backbone's weights as bf16 copies, "
                                             "but method 'mezo' trains them"),
    (["model.compile=fast"], "model.compile='fast' is not null or one of inductor, aot_eager, eager"),
    (["model.adapter_dtype=bf16"], "model.adapter_dtype='bf16' is not one of fp32, backbone"),
    # int8 weights are frozen copies: a method that trains the backbone's weights cannot use them
    (["method=mezo", "model.quantize=int8"], "model.quantize=int8 freezes the backbone's weights as int8 copies, "
                                             "but method 'mezo' trains them"),
    (["method=ft", "model.quantize=int8"], "but method 'ft' trains them"),
    (["method=sparse_mezo", "model.quantize=int8"], "but method 'sparse_mezo' trains them"),
    (["task.num_dev=0"], "task.num_dev=0 must be >= 1"),
    (["train.eval_every=0"], "train.eval_every=0 must be >= 1"),
    (["train.grad_accum=0"], "train.grad_accum=0 must be >= 1"),
    (["method.optimizer.weight_decay=-1"], "method.optimizer.weight_decay=-1.0 must be >= 0"),
    (["schedule=adaptive", "schedule.q_max=0"], "schedule.q_max=0 must be >= 1"),
    (["schedule=adaptive_official", "schedule.q_cap=0"], "schedule.q_cap=0 must be >= 1"),
    # data that is not there, found before any model loads
    (["data.dir=/nonexistent/data"], "data file not found: /nonexistent/data/superglue/RTE/train.jsonl"),
]


def run_cli(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *args])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(overrides, message, fixture_data, tmp_path, monkeypatch, capsys):
    args = [*tiny_overrides(fixture_data), *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("adazeta-run: error: "), err
    assert message in lines[0], lines[0]
    assert not (tmp_path / "run" / "result.json").exists()  # nothing ran, nothing recorded


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_a_cuda_device_that_is_not_there_stops_before_the_data_is_read(fixture_data, tmp_path, monkeypatch, capsys):
    """model.device=cuda without a GPU: one line, checked first (a missing data folder is not reached)."""
    args = [*tiny_overrides(fixture_data), "model.device=cuda", "data.dir=/nonexistent/data",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "model.device='cuda' but no CUDA device is visible; use model.device=auto or cpu" in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_a_dry_run_for_a_gpu_says_the_run_would_stop_here(fixture_data, tmp_path, monkeypatch, capsys):
    """A dry run still counts and estimates (planning a GPU run elsewhere), and says this machine has no GPU."""
    monkeypatch.setattr(sys, "argv", ["adazeta-run", *tiny_overrides(fixture_data), "model.device=cuda",
                                      "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"])
    cli.main()
    out = capsys.readouterr().out
    assert "memory estimate" in out
    assert "placement        model.device='cuda' but no CUDA device is visible here: the run would stop" in out


def test_a_sweep_runs_its_valid_points_and_sums_up_the_rest(fixture_data, tmp_path, monkeypatch, capsys):
    args = ["-m", *tiny_overrides(fixture_data, "train.max_steps=1"), "method=mezo_lora,adazet,lora",
            f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${method.name}"]
    code, err = run_cli(monkeypatch, capsys, args)
    assert code == 2, err
    assert "adazeta-run: error: method=adazet: method has no option 'adazet'" in err
    assert "1 sweep point(s) did not run to a result:" in err
    assert (tmp_path / "mezo_lora" / "result.json").is_file() and (tmp_path / "lora" / "result.json").is_file()


def test_a_sweep_whose_point_fails_exits_non_zero(fixture_data, tmp_path, monkeypatch, capsys):
    args = ["-m", *tiny_overrides(fixture_data, "train.max_steps=1"), "method=mezo_lora",
            "method.optimizer.lr=1e-3,-1", f"hydra.sweep.dir={tmp_path}"]
    code, err = run_cli(monkeypatch, capsys, args)
    assert code != 0
    assert "sweep point(s) did not run to a result" in err and "must be > 0" in err


def test_a_sweep_whose_every_point_has_a_bad_setting_is_one_line_and_exit_2(fixture_data, tmp_path, monkeypatch,
                                                                             capsys):
    """Each point of a sweep is checked as a single run is, before any job starts: a setting every point shares
    is one line (not one failed job per point), exit 2, and no point's folder."""
    args = ["-m", *tiny_overrides(fixture_data), "seed=0,1", "method.optimizer.lr=abc",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    assert code == 2 and err.strip().splitlines() == ["adazeta-run: error: method.optimizer.lr='abc' must be a number"]
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_value_whose_points_have_a_bad_setting_is_left_out_before_any_job(fixture_data, tmp_path,
                                                                                    monkeypatch, capsys):
    """A swept value every point of which fails its settings (here an unresolvable interpolation) is left out with
    one line; the other values run."""
    args = ["-m", *tiny_overrides(fixture_data, "train.max_steps=1"), "seed=0,${nosuch.key}",
            f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${hydra.job.num}"]
    code, err = run_cli(monkeypatch, capsys, args)
    assert code == 2, err
    assert "adazeta-run: error: seed=${nosuch.key}: cannot resolve seed (Interpolation key" in err, err
    assert (tmp_path / "0" / "result.json").is_file() and not (tmp_path / "1").exists()


def test_wandb_online_without_credentials_stops_before_the_model_loads(fixture_data, tmp_path, monkeypatch, capsys):
    """wandb itself refuses only once the model has loaded; checked first, in one line with the ways out."""
    import adazeta.build as build_module

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    for setting in (["wandb.mode=online"], ["wandb.mode=auto"]):
        monkeypatch.setenv("WANDB_MODE", "online")
        args = [*tiny_overrides(fixture_data), *setting, f"hydra.run.dir={tmp_path / 'run'}"]
        code, err = run_cli(monkeypatch, capsys, args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert "needs W&B credentials and none were found" in lines[0] and "wandb.mode=offline" in lines[0], err
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize("verbose", [False, True])
def test_library_warnings_about_their_own_internals_show_only_with_verbose(verbose, fixture_data, tmp_path,
                                                                          monkeypatch, capsys):
    """Each of adazeta.tracking.THIRD_PARTY_WARNINGS, raised from inside its library while a run builds its model,
    is filtered at its source by default and shown with verbose=true; a warning of ours is shown either way.

    The warnings are raised here, as their libraries raise them, not left to the installed versions (peft 0.22
    no longer reads transformers' deprecated ``is_gradient_checkpointing``)."""
    import re
    import warnings

    from adazeta import build
    from adazeta.tracking import THIRD_PARTY_WARNINGS

    samples = {"`is_gradient_checkpointing` is deprecated and will be removed in v6.": (
                   FutureWarning, "transformers.modeling_utils"),
               "fan_in_fan_out is set to False but the target module is `Conv1D`.": (
                   UserWarning, "peft.tuners.lora.layer"),
               "a warning of ours": (UserWarning, "adazeta.build")}
    assert len(samples) == len(THIRD_PARTY_WARNINGS) + 1
    attach = build.attach_adapter

    def attach_and_warn(*args, **kwargs):
        for text, (category, module) in samples.items():
            warnings.warn_explicit(text, category, f"/{module.replace('.', '/')}.py", 1, module=module, registry={})
        return attach(*args, **kwargs)

    monkeypatch.setattr(build, "attach_adapter", attach_and_warn)
    args = [*tiny_overrides(fixture_data, "train.max_steps=1"), "method=mezo_lora", f"verbose={str(verbose).lower()}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what a run would show, were it not for its own filters
        monkeypatch.setattr(sys, "argv", ["adazeta-run", *args])
        cli.main()
    shown = {str(w.message) for w in caught}
    assert (tmp_path / "run" / "result.json").is_file()
    for category, message, _ in THIRD_PARTY_WARNINGS:  # each filter matches its sample, and only as verbose says
        assert any(re.search(message, text) for text in samples), message
    assert {text for text in samples if text in shown} == (set(samples) if verbose else {"a warning of ours"})


# --- data files: every row is read and checked before the model loads ------------------------------------------


def rte_train(data_dir):
    return data_dir / "superglue" / "RTE" / "train.jsonl"


def append_line(path, line: bytes) -> int:
    """Append a raw line; return its line number."""
    n = len(path.read_bytes().splitlines())
    with open(path, "ab") as f:
        f.write(line + b"\n")
    return n + 1


DATA_FAULTS = {
    # name: (how to break the fixture data, message fragment given the broken file and line)
    "not_utf8": (lambda d: append_line(rte_train(d), b'{"premise": "caf\xe9", "hypothesis": "x", "label": "entailment"}'),
                 "not UTF-8"),
    "bad_json": (lambda d: append_line(rte_train(d), b'{"premise": "x", '), "not valid JSON"),
    "not_an_object": (lambda d: append_line(rte_train(d), b'["x", "y"]'), "expected one JSON object per line"),
    "missing_field": (lambda d: append_line(rte_train(d), b'{"premise": "x", "label": "entailment"}'),
                      "missing field 'hypothesis'"),
    "null_field": (lambda d: append_line(rte_train(d), b'{"premise": null, "hypothesis": "x", "label": "entailment"}'),
                   "field 'premise' is null"),
    "unknown_label": (lambda d: append_line(rte_train(d), b'{"premise": "x", "hypothesis": "y", "label": "maybe"}'),
                      "label 'maybe' is not one of"),
}


@pytest.mark.parametrize("fault", sorted(DATA_FAULTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_a_bad_row_anywhere_fails_before_the_model_loads_whatever_the_seed(fault, seed, fixture_data, tmp_path,
                                                                           monkeypatch, capsys):
    """The bad row is the file's last: no seed's 32 sampled examples need contain it; it is found anyway."""
    breaks, message = DATA_FAULTS[fault]
    line = breaks(fixture_data)
    import adazeta.build as build_module

    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code, err = run_cli(monkeypatch, capsys, [*tiny_overrides(fixture_data), f"seed={seed}",
                                              f"hydra.run.dir={tmp_path / 'run'}"])
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert f"{rte_train(fixture_data)}:{line}" in lines[0] and message in lines[0], lines[0]


@pytest.mark.parametrize("content,message", [
    (b"", "no rows in the eval split"),
    (b'{"premise": "x", "hypothesis": "y", "label": "entailment"}\n\n\n', None),  # blank lines are fine
])
def test_an_empty_evaluation_file_is_refused(content, message, fixture_data, tmp_path, monkeypatch, capsys):
    (fixture_data / "superglue" / "RTE" / "val.jsonl").write_bytes(content)
    args = [*tiny_overrides(fixture_data), "dry_run=false", f"hydra.run.dir={tmp_path / 'run'}"]
    if message is None:
        from adazeta.build import compose_settings, preflight

        preflight(compose_settings(args[:-1]))
        return
    code, err = run_cli(monkeypatch, capsys, args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_tsv_row_with_the_wrong_number_of_columns(fixture_data, tmp_path, monkeypatch, capsys):
    path = fixture_data / "glue" / "SST-2" / "train.tsv"
    line = append_line(path, b"only one column")
    code, err = run_cli(monkeypatch, capsys, [*tiny_overrides(fixture_data), "task=sst2",
                                              f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 2 and f"{path}:{line}: 1 columns, expected 2" in err, err


# --- model files ---------------------------------------------------------------------------------------------


GGUF_HEADER = b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (0).to_bytes(8, "little")


@pytest.mark.parametrize("content,message", [
    (b"", "holds 0 bytes, too few for a GGUF header"),
    (b"<html>404 Not Found</html>", "is not a GGUF file (it starts with b'<htm'"),
    (b"GGUF" + (99).to_bytes(4, "little") + bytes(16), "GGUF header with version 99"),
])
def test_a_broken_gguf_file_fails_before_loading(content, message, fixture_data, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(content)
    args = [*tiny_overrides(fixture_data), "model=smollm2-135m", f"model.model_dir={tmp_path / 'models'}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_truncated_gguf_file_fails_in_one_line(fixture_data, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(GGUF_HEADER)  # a header, then nothing
    args = [*tiny_overrides(fixture_data), "model=smollm2-135m", f"model.model_dir={tmp_path / 'models'}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    lines = [x for x in err.splitlines() if x.startswith("adazeta-run")]
    assert code == 2 and len(lines) == 1 and "may be truncated or corrupt" in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("files,message", [
    ({"config.json": "{}"}, "has a config.json but no weights"),
    ({"config.json": "{not json", "model.safetensors": ""}, "config.json is not valid JSON"),
    ({"config.json": "{}", "model.safetensors": "", "tokenizer_config.json": "{}"}, "has weights but no tokenizer"),
])
def test_a_model_folder_without_weights_fails_before_loading(files, message, fixture_data, tmp_path, monkeypatch,
                                                            capsys):
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    args = [*tiny_overrides(fixture_data), "model=smollm2-135m", f"model.model_dir={tmp_path / 'models'}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_cli(monkeypatch, capsys, args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


# --- the run directory -----------------------------------------------------------------------------------------


def test_an_unwritable_run_directory_is_one_line(fixture_data, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    code, err = run_cli(monkeypatch, capsys, [*tiny_overrides(fixture_data), f"hydra.run.dir={blocker / 'run'}"])
    assert code == 2 and "cannot write the run directory" in err, err


def test_a_long_library_error_is_cut_at_a_sentence_or_word_end():
    from adazeta.models import first_line

    sentence = "The checkpoint you are trying to load has model type `x` but Transformers does not recognize it."
    err = ValueError(sentence + " This could be because of an issue with the checkpoint, or because your version "
                     "of Transformers is out of date.\nsecond line")
    assert first_line(err) == f"ValueError: {sentence}"
    words = ValueError("word " * 60)
    assert first_line(words).endswith("word ...") and len(first_line(words)) < 220
    assert first_line(KeyError()) == "KeyError"


def test_a_library_error_that_introduces_a_list_keeps_its_first_entry_with_the_detail():
    """torch's "Error(s) in loading state_dict for X:" says nothing by itself: the first entry (the sizes that
    differ) is the line, with a count of the others."""
    from adazeta.models import first_line

    entry = ("size mismatch for base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight: copying a "
             "param with shape torch.Size([5, 32]) from checkpoint, the shape in current model is torch.Size([8, 32]).")
    err = RuntimeError(f"Error(s) in loading state_dict for PeftModel:\n\t{entry}\n\t{entry}\n\t{entry}")
    assert first_line(err) == f"RuntimeError: {entry} (and 2 more like it)"
    assert first_line(RuntimeError(f"Error(s) in loading state_dict for PeftModel:\n\t{entry}")) == \
        f"RuntimeError: {entry}"
