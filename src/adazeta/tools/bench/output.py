"""The bench's table and the speed targets' verdicts (README, Speed) against the measured medians."""

from __future__ import annotations

import argparse

from adazeta.tools.bench.common import Report

COLUMNS = ["section", "measurement", "setting", "median", "min", "max", "unit", "runs"]
TARGETS = {"s_per_query": 2.0, "step_over_forwards": 1.02, "memory_over_inference": 1.05, "tt_overhead": 0.05,
           "eval_speedup": 5.0}
# method -> (step / 2Q forwards, peak memory / inference): full-parameter methods draw noise for every weight.
METHOD_TARGETS = {"mezo": (1.2, 1.15), "sparse_mezo": (1.2, 1.15), "adapters": (1.02, 1.05)}


def markdown(report: Report) -> str:
    lines = ["| measurement | setting | median | min | max | unit |", "|---|---|---:|---:|---:|---|"]
    for r in report.rows:
        lines.append(f"| {r['measurement']} | {r['setting']} | {r['median']:.3g} | {r['min']:.3g} | {r['max']:.3g} "
                     f"| {r['unit']} |")
    return "\n".join(lines)


def verdicts(report: Report, args: argparse.Namespace) -> list[str]:
    """The speed targets (README, Speed) against the measured medians, with mins beside the per-query times."""
    out = []
    for q in args.queries:
        per_query = [r for r in report.rows
                     if r["measurement"] == "ZO step per query" and r["setting"].startswith(f"Q={q},")]
        modes = [f"{r['setting'].split(', ', 1)[1]} {r['median']:.2f} (min {r['min']:.2f})" for r in per_query]
        out.append(f"Q={q}, s/query: " + ", ".join(modes)
                   + f" (target <= {TARGETS['s_per_query']})")
    ratios = [r for r in report.rows if r["measurement"] == "ZO step / forwards of our model"]
    out.append("step / 2Q forwards: " + ", ".join(f"{r['setting'].split(';')[0]}: {r['median']:.3f}" for r in ratios)
               + f" (target <= {TARGETS['step_over_forwards']})")
    mem = [r for r in report.rows if r["measurement"] == "peak memory / inference" and "AdaZeta" in r["setting"]]
    out += [f"{r['setting']}: {r['median']:.3f} x inference memory (target <= {TARGETS['memory_over_inference']})"
            for r in mem]
    for r in report.rows:
        if r["measurement"] == "TT adapters' forward overhead":
            out.append(f"TT adapters' forward overhead, {r['setting'].split(';')[0]}: {100 * r['median']:+.1f} % "
                       f"(min {100 * r['min']:+.1f} %; target <= {100 * TARGETS['tt_overhead']:.0f} %)")
        if r["measurement"] == "TT adapters' forward overhead, unfolded products":
            out.append(f"(the same adapters' unfolded products, in the same rounds: {100 * r['median']:+.1f} %)")
        if r["measurement"] == "TT adapters' forward, folded / unfolded products":
            out.append(f"(adapted forward, folded / unfolded products, round by round: {r['median']:.3f})")
        if r["measurement"] in ("TT adapters alone / plain forward", "TT adapters in place / plain forward"):
            where = r["measurement"].split(" / ")[0]
            out.append(f"{where}: {100 * r['median']:.1f} % of the plain forward "
                       f"(min {100 * r['min']:.1f} %; target <= {100 * TARGETS['tt_overhead']:.0f} %)")
        if r["measurement"] == "evaluation speed-up":
            out.append(f"evaluation, batched / one at a time: {r['median']:.2f}x (target >= {TARGETS['eval_speedup']})")
        if r["section"] == "methods" and r["measurement"] == "ZO step / 2Q forwards":
            method = r["setting"].split(" ")[0]
            target = METHOD_TARGETS.get(method, METHOD_TARGETS["adapters"])[0]
            floor = next((f for f in report.rows if f["section"] == "methods" and f["setting"] == r["setting"]
                          and f["measurement"].startswith("floor")), None)
            bound = "" if floor is None else f"; its forwards and draws of z alone: {floor['median']:.3f}"
            out.append(f"{method}: step / 2Q forwards {r['median']:.3f} (min {r['min']:.3f}{bound}; target <= {target})")
        if r["measurement"] == "peak memory / inference" and r["setting"].endswith("step, Q=1, sequential"):
            method = r["setting"].split(" ")[0]
            target = METHOD_TARGETS.get(method, METHOD_TARGETS["adapters"])[1]
            out.append(f"{method}: peak memory {r['median']:.3f} x inference (target <= {target})")
    return out
