"""The dry run's memory estimate holds for every registered optimizer: the state and step temporaries its config
declares, against the measured peak of its real steps on a tiny random model.

Allocations are counted by torch's profiler, which reports each one with the CPU allocator's running total: the
peak is exact, not a resident-set reading. The model is widened (hidden 256) so that its weights (5.6 MB) outweigh
a forward's activations (2 MB): a missing full-size temporary shows. Each ZO optimizer runs two steps of two
queries, training every weight ("full": as a full-size model, with the sizes under which a trained set is copied
and its z kept set to zero; "small": as is, under them, as an adapter set is) or TT adapters ("adapters").
"""

from __future__ import annotations

import csv
import functools
import json
import sys
import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from adazeta.build import build, compose_settings, preflight, seed_everything
from adazeta.dryrun import memory_parts
from adazeta.optim import zeroth_order
from adazeta.optim.batched import ReplicaClosure
from adazeta.optim.zo_sgd import ZOSGD
from adazeta.precision import cpu_flags, fast_bf16
from adazeta.registry import OPTIMIZERS
from adazeta.train import first_order_step
from helpers import tiny_overrides, write_fixture_data

WIDE = ["model.architecture.hidden_size=256", "model.architecture.intermediate_size=512"]
QUERIES = 2
# The estimate is an upper bound (it adds the step's temporaries to a forward's activations, which are freed by
# the update); measured peaks may exceed it by allocator rounding and small tensors (scalars, index lists) only.
TOLERANCE = 1.10
SLACK = 64 * 1024
HONEST = 2.5  # nor may it exceed them more than this: a declaration that inflates hides real ones


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fixture_data(tmp_path_factory.mktemp("data"))


def _events(nodes):
    for node in nodes:
        yield node
        yield from _events(node.children)


def allocated_peak(fn) -> int:
    """The most bytes allocated on the CPU at once while ``fn`` runs, above what was allocated when it started."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in _events(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    if not events:
        return 0
    first = events[0].extra_fields
    return max(e.extra_fields.total_allocated for e in events) - (first.total_allocated - first.alloc_size)


def case_overrides(kind: str, trained: str) -> list[str]:
    """``kind`` as the optimizer of a method that trains every weight (``mezo``, ``ft``) or TT adapters."""
    zo = OPTIMIZERS.get(kind).config_cls.zeroth_order
    if trained == "adapters":
        method = "adazeta" if zo else "tt_adapter"
    else:
        method = "mezo" if zo else "ft"
    return [f"method={method}", f"optimizer@method.optimizer={kind}", "schedule=constant", f"schedule.q={QUERIES}"]


def measure(data_dir, overrides: list[str]) -> tuple[int, float]:
    """(the measured peak of a run's steps above its loaded model, the dry run's estimate of it). ZO: two steps,
    the estimate's activations those of one forward as measured; first-order: the optimizer's ``step()`` after
    backward, beside the gradients (its state built in that step)."""
    s = compose_settings(tiny_overrides(data_dir, *WIDE, "train.batch_size=2", *overrides))
    preflight(s)
    seed_everything(s.seed)
    built = build(s)
    optimizer, scorer, model = built.optimizer, built.scorer, built.scorer.model
    items = built.enc["train"][:2]
    batch = scorer.collate(items)
    weights = list(model.parameters())
    parts = memory_parts(s, sum(p.numel() for p in weights), [tuple(p.shape) for p in weights if p.requires_grad],
                         largest_weight=max(p.numel() for p in weights))
    declared = parts["optimizer_state"] + parts["step_temporaries"]
    if not zeroth_order(optimizer):
        first_order_step(scorer, optimizer, items)  # the gradients; a fresh optimizer builds its state in step()
        fresh = OPTIMIZERS.get(s.optimizer.kind).builder(built.named, s.optimizer.config, s.seed)
        return allocated_peak(fresh.step), declared
    closure = ReplicaClosure(model, functools.partial(scorer.replica_losses, batch), batch)
    with torch.no_grad():
        forward = allocated_peak(closure)
    peak = allocated_peak(lambda: [optimizer.step(closure, n_queries=QUERIES) for _ in range(2)])
    copies = s.optimizer.config.activation_copies(torch.tensor([], dtype=s.model.torch_dtype).element_size())
    return peak, copies * forward + declared


@pytest.mark.parametrize("trained,dtype", [("full", "fp32"), ("small", "fp32"), ("adapters", "fp32"), ("full", "bf16")])
@pytest.mark.parametrize("kind", OPTIMIZERS.names())
def test_the_dry_run_estimate_holds_for_a_measured_step_of_every_optimizer(data_dir, monkeypatch, request, kind,
                                                                           trained, dtype):
    if dtype == "bf16" and fast_bf16(cpu_flags()):
        # The bf16 temporaries were calibrated where bf16 is emulated; a CPU with AVX512-BF16 or AMX runs bf16
        # products natively and allocates otherwise (measured on an AMD EPYC: forward_grad 6.57 MiB against 5.89
        # estimated, sparse_zo_sgd 0.85 against 2.20). Not modelled yet: such a case reports, it does not gate.
        request.node.add_marker(pytest.mark.xfail(reason="bf16 temporaries not modelled for hardware bf16",
                                                  strict=False))
    if trained == "full":  # as a full-size model: no copy of the weights, no kept z
        monkeypatch.setattr(ZOSGD, "KEEP_WEIGHTS_BYTES", 0)
        monkeypatch.setattr(ZOSGD, "KEEP_DIRECTION_BYTES", 0)
    peak, estimate = measure(data_dir, [*case_overrides(kind, trained), f"model.dtype={dtype}"])
    where = f"{kind}, {trained} {dtype}: measured {peak / 2**20:.2f} MiB, estimated {estimate / 2**20:.2f} MiB"
    assert peak <= TOLERANCE * estimate + SLACK, where
    assert estimate <= HONEST * peak + SLACK, where


def test_the_memory_bench_keeps_its_rows_without_an_inference_row(data_dir, tmp_path, monkeypatch, capsys):
    from adazeta.tools import bench_memory

    out = tmp_path / "memory.csv"
    monkeypatch.setattr(sys, "argv", ["bench_memory", "--methods", "adazeta", "--model", "tiny-llama", "--task", "rte",
                                      "--batch-size", "4", "--steps", "1", "--set", f"data.dir={data_dir}",
                                      "--out", str(out)])
    bench_memory.main()
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["adazeta"] and rows[0]["ratio"] == ""  # no inference row: no ratio
    assert float(rows[0]["step_mem_mb"]) >= 0 and float(rows[0]["estimate_step_mb"]) > 0  # estimate beside it
    assert json.loads(out.with_suffix(".json").read_text())["rows"][0]["estimate_parts_mb"]["weights"] > 0
    assert "| adazeta |" in capsys.readouterr().out
