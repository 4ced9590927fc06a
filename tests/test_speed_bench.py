"""adazeta.tools.bench (``make bench``) on a tiny random model and fixture data: every measurement lands in the CSV."""

from __future__ import annotations

import argparse
import csv
import math
import shlex
import sys
from pathlib import Path

import pytest
import torch

from adazeta.adapters import tt
from adazeta.dryrun import dry_run
from adazeta.optim import spsa
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig
from adazeta.tools.bench import cli, common, forwards, memory, methods


def test_bench_writes_every_measurement(fixture_data, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAZETA_DATA_DIR", str(fixture_data))
    argv = ["bench.py", "--model", "tiny-llama", "--repeats", "2", "--warmup", "0", "--queries", "1", "2",
            "--chunks", "3", "--eval-examples", "6", "--eval-batch-size", "4", "--skip-memory", "--out", str(tmp_path),
            "--scaling-sizes", "2", "4", "--overhead-pairs", "3", "--overhead-long-pairs", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    with open(tmp_path / "tiny-llama-cpu-fp32.csv") as f:
        rows = list(csv.DictReader(f))
    settings = {(r["measurement"], r["setting"]) for r in rows}
    for q in (1, 2):
        for mode in ("sequential", "batched (chunk 3)"):
            assert ("ZO step per query", f"Q={q}, {mode}") in settings
    assert {r["section"] for r in rows} == {"forward", "zo_step", "methods", "scaling", "first_order", "evaluation"}
    assert ("inference forward", forwards.REFERENCE_ROW) in settings
    ceiling = {(r["measurement"], r["setting"].split(" ")[0]) for r in rows if r["section"] == "evaluation"}
    for layout in ("batched", "one"):  # each layout's rate against the device's dense-matmul rate
        assert ("decoder-layer rate / dense matmul rate", layout) in ceiling
    assert any(m == "dense matmul rate" for m, _ in ceiling)
    compared = {r["setting"].split(" ")[0] for r in rows if r["measurement"] == "ZO step / 2Q forwards"}
    assert compared == set(common.ZO_METHODS)
    # Each method's draws of z in a step: on this tiny model every trainable set's z fits the step's keep limit,
    # so each draws it once (see below for a full model); the floor those draws put under a step is above 1.
    draws = {r["setting"].split(" ")[0]: float(r["median"]) for r in rows if r["measurement"] == "draws of z per step"}
    assert draws == dict.fromkeys(common.ZO_METHODS, 1.0)
    floors = [r for r in rows if r["measurement"].startswith("floor:")]
    assert len(floors) == len(common.ZO_METHODS) and all(float(r["min"]) > 1 for r in floors)
    for task in ("sst2", "rte"):
        assert sum(r["setting"].startswith(f"{task}, batch ") for r in rows if r["section"] == "scaling") == 4
    alone = {r["measurement"]: r for r in rows if r["measurement"].startswith("TT adapters alone")}
    assert set(alone) == {"TT adapters alone", "TT adapters alone / plain forward"}
    assert int(alone["TT adapters alone"]["setting"].split(" ")[0]) >= 2  # every adapter of the tiny Llama's layers
    assert 0 < float(alone["TT adapters alone / plain forward"]["median"]) < 1
    in_place = {r["measurement"]: r for r in rows if r["measurement"].startswith("TT adapters in place")}
    assert set(in_place) == {"TT adapters in place", "TT adapters in place / plain forward"}
    assert in_place["TT adapters in place"]["runs"] == "5"  # at least 5 forwards, whatever --repeats
    assert 0 < float(in_place["TT adapters in place / plain forward"]["median"]) < 1
    overheads = [r for r in rows if r["measurement"] == "TT adapters' forward overhead"]
    overhead = overheads[0]
    assert overhead["runs"] == "3" and overhead["setting"].endswith("3 pairs")  # its own rounds, a ratio per pair
    assert [r["setting"].split(" ")[0] for r in overheads] == ["SST-2", "RTE"] and overheads[1]["runs"] == "2"
    unfolded = next(r for r in rows if r["measurement"] == "TT adapters' forward overhead, unfolded products")
    assert unfolded["runs"] == "3" and tt._FOLD  # the ablation's rounds; the folded forward is back on after
    gain = next(r for r in rows if r["measurement"] == "TT adapters' forward, folded / unfolded products")
    assert ("evaluation speed-up", "batched / one example at a time") in settings
    for r in rows:
        assert r["runs"] in ("1", "2") or r in (overhead, unfolded, gain) or r["measurement"].startswith(
            ("TT adapters alone", "TT adapters in place"))
        if r["unit"] != "x":  # times and throughputs: positive, median within [min, max]
            assert 0 < float(r["min"]) <= float(r["median"]) <= float(r["max"])
    assert (tmp_path / "tiny-llama-cpu-fp32.md").read_text().startswith("| measurement |")
    assert "load_average_before" in (tmp_path / "tiny-llama-cpu-fp32.json").read_text()


@pytest.mark.parametrize("keep,queries,estimator,expected",
                         [(True, 1, "central", 1), (True, 3, "central", 3), (False, 1, "central", 3),
                          (False, 2, "central", 8), (False, 1, "one_sided", 2)])
def test_draws_of_z_are_counted_as_a_step_makes_them(keep, queries, estimator, expected, monkeypatch):
    """z kept: one draw per query; regenerated (a full model): +eps, -2 eps, +eps and the update per query (one-
    sided: +eps, -eps, update), the last restore fused into the update at Q = 1."""
    monkeypatch.setattr(ZOSGD, "KEEP_DIRECTION_BYTES", 2**30 if keep else 0)
    if not keep:  # a full model: too large to copy either, so restored by the opposite perturbation
        monkeypatch.setattr(ZOSGD, "KEEP_WEIGHTS_BYTES", 0)
    w = torch.nn.Parameter(torch.randn(50))
    opt = ZOSGD([w], ZOSGDConfig(lr=1e-3, estimator=estimator))
    before = w.detach().clone()
    assert methods.noise_draws_per_step(opt, lambda: (w**2).sum(), queries) == expected
    assert opt.state_step == 1 and not torch.equal(w, before)  # a real step ran
    assert spsa.draws() > 0  # the process-wide count the bench reads before and after the step


@pytest.mark.parametrize("dtype,weights", [("fp32", "real"), ("bf16", "random")])  # bf16: as the GPU script runs
def test_memory_phase_reports_a_peak_above_its_baseline(dtype, weights, fixture_data, monkeypatch):
    monkeypatch.setenv("ADAZETA_DATA_DIR", str(fixture_data))
    args = argparse.Namespace(model="tiny-llama", dtype=dtype, device="cpu", batch_size=4, eval_examples=4,
                              memory_queries=2, memory_steps=1, phase="adazeta_batched:4", weights=weights,
                              noise="per_tensor", query_memory=0.05)
    result = memory.memory_phase(args)
    assert result["phase"] == "adazeta_batched:4"
    assert result["peak_mb"] >= result["baseline_mb"] > 0
    result = memory.memory_phase(argparse.Namespace(**{**vars(args), "phase": "method:mezo"}))
    assert result["peak_mb"] >= result["baseline_mb"] > 0


def test_bench_runs_without_model_or_data_files(tmp_path, monkeypatch):
    """--weights random: a random model of the architecture and synthetic prompts; no file is read."""
    monkeypatch.setenv("ADAZETA_DATA_DIR", str(tmp_path / "no-data"))
    monkeypatch.setenv("ADAZETA_MODEL_DIR", str(tmp_path / "no-models"))
    argv = ["bench.py", "--model", "tiny-llama", "--weights", "random", "--repeats", "1", "--warmup", "0",
            "--queries", "1", "--chunks", "2", "--eval-examples", "4", "--eval-batch-size", "4", "--skip-memory",
            "--methods", "adazeta", "mezo", "--scaling-sizes", "2", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    with open(tmp_path / "tiny-llama-random-cpu-fp32.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["setting"].split(" ")[0] for r in rows if r["section"] == "methods"} == {"adazeta", "mezo"}
    assert any(r["setting"].startswith("rte, batch 2") for r in rows)


def test_bench_options_compose_to_the_settings_of_a_run():
    """The options are adazeta-run overrides; llama-1b-random is SmolLM2's config with a ~1.1 B architecture."""
    args = argparse.Namespace(model="llama-1b-random", weights="real", dtype="bf16", device="cpu", batch_size=16,
                              eval_examples=64, noise="flat", query_memory=0.05)
    s = common.settings_for(args)
    assert s.model.random_init and s.model.name == "llama-1b-random" and s.model.dtype == "bf16"
    assert {k: s.model.architecture[k] for k in common.LLAMA_1B} == common.LLAMA_1B
    assert s.adapter.config.shape_down is None  # TT shapes derived for hidden 2048, not SmolLM2's 576
    assert s.optimizer.config.noise == "flat" and s.data.num_dev == 64
    batched = common.settings_for(args, extra=common.zo_variant(args, True, "auto")).optimizer.config
    assert batched.batched_queries and batched.query_chunk == "auto"
    assert common.settings_for(args, "tt_adapter").optimizer.kind == "adamw"


def test_reference_forward_is_the_reference_loss():
    """The reference row computes the same loss as ours (per-candidate rows, x8 padding change no number)."""
    import torch

    from adazeta.models import ModelConfig, load_model
    from adazeta.scoring import Scorer

    loaded = load_model(ModelConfig(name="t", random_init=True, architecture=dict(
        model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2), device="cpu"), 1)
    items = common.synthetic_items("sst2", 5, 0, len(loaded.tokenizer)) + common.synthetic_items("rte", 3, 1, 200)
    for ex in items:
        ex.candidates = [[7, 9], [11]]  # multi-token candidates: the option-length mask matters
    scorer = Scorer.of(loaded.model, loaded.tokenizer)
    with torch.no_grad():
        ours = scorer.loss(scorer.collate(items))
        reference = forwards.reference_zo_forward(loaded.model, items, loaded.tokenizer.pad_token_id,
                                               torch.device("cpu"))
    torch.testing.assert_close(reference, ours, atol=1e-5, rtol=1e-5)


def gpu_script_runs(out: str) -> list[tuple[int, str, list[str]]]:
    """``(limit_s, name, bench arguments)`` of each ``run`` line of scripts/bench_gpu.sh, with its variables."""
    text = (Path(__file__).parents[1] / "scripts" / "bench_gpu.sh").read_text().replace("\\\n", " ")
    common_args = next(shlex.split(line.split("(", 1)[1].rsplit(")", 1)[0])
                  for line in text.splitlines() if line.startswith("COMMON=("))
    runs = []
    for line in text.splitlines():
        if line.startswith("run "):
            _, limit, name, *rest = shlex.split(line)
            args = [a for r in rest for a in (common_args if r == "${COMMON[@]}" else [r])]
            runs.append((int(limit), name, [out if a == "$OUT" else a for a in args]))
    return runs


def test_the_gpu_script_asks_for_what_the_bench_knows(monkeypatch, tmp_path):
    """scripts/bench_gpu.sh runs where a GPU is lent, rarely and against a clock: every one of its command lines
    must parse, compose to the settings of a run for each of its methods, and name the models it means (a ~1.1 B
    Llama; SmolLM2's architecture with random weights), all inside its time limits."""
    runs = gpu_script_runs(str(tmp_path))
    assert [name for _, name, _ in runs] == ["smollm2", "smollm2-flat", "smollm2-options", "llama-1b"]
    assert sum(limit for limit, _, _ in runs) <= 360  # the script promises at most 6 minutes
    parser = cli.build_parser()
    for _, name, argv in runs:
        args = parser.parse_args(argv)
        if args.options:  # every dtype side by side, fp32 the reference: no --dtype of its own
            assert (args.device, args.out, args.compile_backend) == ("cuda", tmp_path, "inductor")
            assert common.random_weights(args) and args.model == "smollm2-135m"
            continue
        assert (args.device, args.dtype, args.out) == ("cuda", "bf16", tmp_path) and common.random_weights(args)
        for method in args.methods:
            s = common.settings_for(args, method)
            assert s.model.random_init and s.model.device == "cuda" and s.optimizer.config.noise == args.noise
        assert common.settings_for(args, "tt_adapter").optimizer.kind == "adamw"  # the first-order row
        for chunk in args.chunks:
            assert common.settings_for(args, extra=common.zo_variant(args, True, chunk)).optimizer.config.query_chunk == chunk
        if args.model == "llama-1b-random":
            record = dry_run(common.settings_for(args))
            assert 1.0e9 < record["total_params"] < 1.25e9 and record["adapters"] == 3 * common.LLAMA_1B[
                "num_hidden_layers"]


def test_bench_runs_in_bf16_as_the_gpu_script_does(tmp_path, monkeypatch):
    """scripts/bench_gpu.sh runs the bench on bf16 backbones with random weights: every method's step, the noise
    streams and evaluation must run in bf16 (here on the CPU, on the tiny Llama; its memory phases: above)."""
    monkeypatch.setenv("ADAZETA_DATA_DIR", str(tmp_path / "no-data"))
    monkeypatch.setenv("ADAZETA_MODEL_DIR", str(tmp_path / "no-models"))
    argv = ["bench.py", "--model", "tiny-llama", "--weights", "random", "--dtype", "bf16", "--repeats", "1",
            "--warmup", "0", "--queries", "1", "--chunks", "2", "--eval-examples", "4", "--eval-batch-size", "4",
            "--scaling-sizes", "2", "--overhead-pairs", "1", "--overhead-long-pairs", "0", "--skip-memory",
            "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    with open(tmp_path / "tiny-llama-random-cpu-bf16.csv") as f:
        rows = list(csv.DictReader(f))
    steps = {r["setting"].split(" ")[0]: float(r["median"]) for r in rows
             if r["measurement"] == "ZO step / 2Q forwards"}
    assert set(steps) == set(common.ZO_METHODS) and all(math.isfinite(v) and v > 0 for v in steps.values())
    assert ("evaluation speed-up", "batched / one example at a time") in {(r["measurement"], r["setting"]) for r in rows}
    assert '"dtype": "bf16"' in (tmp_path / "tiny-llama-random-cpu-bf16.json").read_text()
