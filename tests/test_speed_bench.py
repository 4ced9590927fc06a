"""scripts/bench.py (``make bench``) on a tiny random model and fixture data: every measurement lands in the CSV."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import sys

from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_script"] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_bench_writes_every_measurement(fixture_data, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAZETA_DATA_DIR", str(fixture_data))
    argv = ["bench.py", "--model", "tiny-llama", "--repeats", "2", "--warmup", "0", "--queries", "1", "2",
            "--chunks", "3", "--eval-examples", "6", "--eval-batch-size", "4", "--skip-memory", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    with open(tmp_path / "tiny-llama-cpu-fp32.csv") as f:
        rows = list(csv.DictReader(f))
    settings = {(r["measurement"], r["setting"]) for r in rows}
    for q in (1, 2):
        for mode in ("sequential", "batched (chunk 3)"):
            assert ("ZO step per query", f"Q={q}, {mode}") in settings
    assert {r["section"] for r in rows} == {"forward", "zo_step", "first_order", "evaluation"}
    assert ("inference forward", "plain, reference computation") in settings
    for r in rows:
        assert r["runs"] in ("1", "2")
        if r["unit"] != "x":  # times and throughputs: positive, median within [min, max]
            assert 0 < float(r["min"]) <= float(r["median"]) <= float(r["max"])
    assert (tmp_path / "tiny-llama-cpu-fp32.md").read_text().startswith("| measurement |")
    assert "load_average_before" in (tmp_path / "tiny-llama-cpu-fp32.json").read_text()


def test_memory_phase_reports_a_peak_above_its_baseline(fixture_data, monkeypatch):
    monkeypatch.setenv("ADAZETA_DATA_DIR", str(fixture_data))
    args = argparse.Namespace(model="tiny-llama", dtype="fp32", device="cpu", batch_size=4, eval_examples=4,
                              memory_queries=2, memory_steps=1, phase="adazeta_batched:4")
    result = bench.memory_phase(args)
    assert result["phase"] == "adazeta_batched:4"
    assert result["peak_mb"] >= result["baseline_mb"] > 0
