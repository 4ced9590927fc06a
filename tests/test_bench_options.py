"""The bench's --options mode prints every option with its ratio to fp32, the CPU's bf16 features and fidelity."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from adazeta.tools.bench import cli, options as options_module
from adazeta.tools.bench.options import options


def test_options_bench_prints_every_option_and_ratio(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench", "--options", "--weights", "random", "--model", "tiny-llama",
                                      "--compile-backend", "eager", "--repeats", "1", "--warmup", "1",
                                      "--batch-size", "2", "--eval-examples", "4", "--out", str(tmp_path)])
    rounds = []
    timed = options_module.timed
    monkeypatch.setattr(options_module, "timed", lambda fns, *a: rounds.append(list(fns)) or timed(fns, *a))
    fidelity = options_module.measure_fidelity
    states = []

    def at_the_shared_start(args, report, setups, method="adazeta"):
        """Every option's adapters are at the same (initial) point when fidelity compares them: no timed ZO step
        has moved any of them yet."""
        ref = [p.detach().clone() for _, p in setups["fp32"].built.named]
        states.append([name for name, s in setups.items()
                       if not all(torch.equal(a, b.detach()) for a, (_, b) in zip(ref, s.built.named))])
        return fidelity(args, report, setups, method)

    monkeypatch.setattr(options_module, "measure_fidelity", at_the_shared_start)
    cli.main()
    assert states == [[], []], states  # AdaZeta's adapters, then MeZO-LoRA's
    out = capsys.readouterr().out
    # One round-robin holds every option's every run, so that drifting load weighs on all options alike.
    assert len(rounds) == 1 and {name for name, _ in rounds[0]} == set(options("eager"))
    assert len(rounds[0]) == 4 * len(options("eager"))
    assert "amx_bf16" in out and "avx512_bf16" in out
    for name in options("eager"):
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        for key in ("forward", "ZO step, Q=1", "ZO step, Q=4 batched", "evaluation", "roofline", "faithful (Q=16)",
                    "update taken"):
            assert key in line, line
    fp32 = next(ln for ln in out.splitlines() if ln.startswith("fp32 "))
    table = (tmp_path / "tiny-llama-random-cpu-options.md").read_text()
    assert "projected-gradient sign agreement with fp32" in table and "model memory" in table
    assert "cosine with fp32 gradient, Q=16" in table and "relative error against exact z.g" in table
    # fidelity on each method's own adapters: AdaZeta's TT adapters and MeZO-LoRA's (B = 0 at the start)
    for method in ("adazeta", "mezo_lora"):
        assert f"cosine with the exact-derivative estimate, Q=16 [{method}]" in table
        assert re.search(r"faithful \(Q=16\) [\d.]+ adazeta, [\d.]+ mezo_lora", fp32)
    mezo_lora_fp32 = float(re.search(r"faithful \(Q=16\) [\d.]+ adazeta, ([\d.]+) mezo_lora", fp32).group(1))
    assert mezo_lora_fp32 > 0.99
    # fp32's own Q = 16 estimate is the exact-derivative estimate up to finite differences, and is never flagged
    faithful = float(re.search(r"faithful \(Q=16\) ([\d.]+)", fp32).group(1))
    assert faithful > 0.99 and "MEASURABLY WORSE" not in fp32
    assert "realised update: share of measured entries changed" in table and "cos(applied, intended)" in table
    taken = float(re.search(r"update taken ([\d.]+)%", fp32).group(1))
    assert taken > 99 and "UPDATES LOST" not in fp32  # fp32 adapters take (almost) every entry of an update


def test_only_options_measures_those_beside_fp32(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench", "--options", "--only-options", "bf16 linears", "--weights", "random",
                                      "--model", "tiny-llama", "--repeats", "1", "--batch-size", "2",
                                      "--eval-examples", "4", "--out", str(tmp_path)])
    cli.main()
    printed = [ln.split("  ")[0].strip() for ln in capsys.readouterr().out.splitlines() if "faithful (Q=16)" in ln]
    assert [p.split(" forward")[0] for p in printed] == ["fp32", "bf16 linears"]


def test_an_unknown_option_name_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench", "--options", "--only-options", "bf8", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--only-options 'bf8': no such option; the options are 'fp32', 'bf16'" in err
    assert not list(tmp_path.iterdir())
