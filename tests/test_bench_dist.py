"""make bench BENCH=dist on a tiny model: 1 and 2 processes, queries per second and the all-reduce's share."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT


def test_bench_dist_reports_both_process_counts(fixture_data, tmp_path):
    out = tmp_path / "dist"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "adazeta.tools.bench_dist", "--procs", "1", "2", "--queries", "4", "--steps", "1",
           "--out", str(out), "model=tiny-llama", "task=rte", f"data.dir={fixture_data}", "data.num_train=32",
           "data.num_dev=8", "data.num_eval=8"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    written = sorted(p.name for p in out.glob("world*-rank*.json"))  # a failure after these is in the teardown
    assert done.returncode == 0, f"{written}\n{done.stderr[:4000]}\n...\n{done.stderr[-3000:]}"  # ranks' errors first
    rows = json.loads((out / "dist.json").read_text())["rows"]
    assert [r["processes"] for r in rows] == [1, 2]
    assert rows[0]["speedup"] == 1.0 and rows[1]["mode"] == "query-parallel"
    assert rows[1]["allreduce_alone_s"] > 0 and rows[0]["allreduce_s"] == 0.0
    assert all(r["queries_per_s"] > 0 and r["queries"] == 4 for r in rows)
    assert "| 2 | query-parallel |" in (out / "dist.md").read_text()
