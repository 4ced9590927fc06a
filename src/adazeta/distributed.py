"""One run on several processes: ``torchrun --nproc_per_node N adazeta-run ...`` (or N SLURM tasks).
Over 400 lines: how the work is divided and how the ranks fail together (the start-up check, reports, lost
processes) share the one process group and its store, so they stay in one module.

A zeroth-order step needs only scalars to cross processes. Every rank holds the whole model and the same
trainable weights; a step's Q queries and its minibatch are divided over the ranks as ``G`` query groups of ``D``
data shards each (``G * D = N``, see ``Spread.plan``):

* query-parallel (``D = 1``): rank r evaluates queries r, r + N, ... on the whole minibatch. It draws their
  directions from the same per-query seeds as a one-process run (``spsa.query_seed(seed, step, q)``), so no two
  ranks evaluate the same query and the union is exactly the one-process step's queries.
* data-parallel (``G = 1``): every rank evaluates every query on its shard of the minibatch; each loss is the
  example-weighted sum of the shards' losses (this is what makes Q = 1 use N processes).
* both (``1 < G < N``): Q < N queries, each on D shards.

Each rank writes its losses and projected gradients, weighted by its shard's share of the minibatch, into
vectors of the step's length (zeros elsewhere) and one ``all_reduce(SUM)`` of 3Q floats makes the step's losses
and projected gradients known to every rank, which then applies the same update from the same seeds. With
``D = 1`` the sum adds zeros only, so the update is bit for bit the one-process update.

First-order methods train through ``torch.nn.parallel.DistributedDataParallel`` on data shards. Evaluation runs
on every rank (the same numbers everywhere, so that every rank takes the same decisions); rank 0 alone writes
files and wandb. A rank that fails, or that a signal stops at once, leaves its report in the process group's
store, where rank 0 reads it to record the run with that reason. A rank whose process is gone without a report
(SIGKILL, out of memory) is named by rank 0 from the process it registered at start-up (same host); one that
hangs ends the run after ``distributed.timeout_s``, the collectives' timeout. When that process is rank 0's, the
lowest surviving rank writes the record in its place (``heir_of_main``). Before any work, the ranks compare a
hash of their settings and stop together, in one line from rank 0, when they differ or one of them was refused
(``agree``); a checkpoint records the process layout that wrote it (``layout``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

from adazeta.errors import ConfigError, PeerError

log = logging.getLogger("adazeta")

MODES = ("auto", "query", "data")
RESUME_LAYOUTS = ("same", "any")
REPORT_KEY = "adazeta/report/{rank}"  # a rank's failure or stop signal, for rank 0's record
PROCESS_KEY = "adazeta/process/{rank}"  # host, pid and start time of a rank's process: is it still there?
ORDER_KEY = "adazeta/reports"  # counts the reports: the first one is the cause, later ones its consequences
T = TypeVar("T")


@dataclass
class DistributedConfig:
    """How a run launched on several processes divides its work (one process: ignored)."""

    # auto: queries over ranks while a step has at least as many queries as ranks (whole groups of ranks per
    # query otherwise); query: queries only (ranks without a query wait); data: every query on minibatch shards.
    mode: str = "auto"
    # A collective that waits this long for a rank that neither answers nor ends (a hung process, a lost node) ends
    # the run, recorded `failed` with the silent rank named. A rank whose process ends is noticed at once.
    timeout_s: int = 1800
    # same: a checkpoint resumes only on the process layout that wrote it (world size and mode: another layout
    # divides the queries and shards otherwise, so the resumed run is not the run that was started); any: resume
    # on whatever layout this command has (the record keeps the layout of its last invocation).
    resume_layout: str = "same"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"distributed.mode={self.mode!r} must be one of {', '.join(MODES)}")
        if self.resume_layout not in RESUME_LAYOUTS:
            raise ConfigError(f"distributed.resume_layout={self.resume_layout!r} must be one of "
                              f"{', '.join(RESUME_LAYOUTS)}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise ConfigError(f"distributed.timeout_s={self.timeout_s!r} must be an int >= 1 (seconds)")


@dataclass(frozen=True)
class StepPlan:
    """One rank's share of one ZO step: its queries (every ``groups``-th from ``group``) and minibatch shard."""

    groups: int
    shards: int
    group: int
    shard: int
    n_items: int  # the whole minibatch's examples

    @property
    def weight(self) -> float:
        """The shard's share of the minibatch (1.0 exactly when the shard is the whole minibatch)."""
        return 1.0 if self.shards == 1 else len(self.items(range(self.n_items))) / self.n_items

    def queries(self, n_queries: int) -> list[int]:
        return list(range(self.group, n_queries, self.groups))

    def items(self, items: Sequence[T]) -> list[T]:
        """This rank's shard: contiguous, sizes differing by at most one (the first shards take the extra)."""
        size, extra = divmod(len(items), self.shards)
        start = self.shard * size + min(self.shard, extra)
        return list(items[start : start + size + (self.shard < extra)])


class Spread:
    """The ranks of a run and how a step's queries and examples are divided over them."""

    def __init__(self, rank: int, world_size: int, mode: str = "auto"):
        if mode not in MODES:
            raise ConfigError(f"distributed.mode={mode!r} must be one of {', '.join(MODES)}")
        self.rank, self.world_size, self.mode = rank, world_size, mode

    def plan(self, n_queries: int, n_items: int) -> StepPlan:
        n = self.world_size
        if self.mode == "query":
            groups = n
        elif self.mode == "data":
            groups = 1
        else:  # the most query groups that divide the ranks evenly and each get a query
            groups = max(g for g in range(1, n + 1) if n % g == 0 and g <= max(n_queries, 1))
        shards = n // groups
        return StepPlan(groups, shards, self.rank // shards, self.rank % shards, n_items)

    def describe(self, n_queries: int) -> str:
        p = self.plan(n_queries, 1)
        if p.shards == 1:
            return "query-parallel"
        return "data-parallel" if p.groups == 1 else f"query-parallel x data-parallel ({p.groups} x {p.shards})"


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: rank 0 of 1 when not launched by torchrun or SLURM tasks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = Dist()


def launch_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's variables, or from SLURM's for N tasks; None for one."""
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:
        world = int(env["WORLD_SIZE"])
        return (int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0))) if world > 1 else None
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env and env.get("SUBMITIT_EXECUTOR") == "slurm":
        # N tasks of one submitit job (hydra.launcher.tasks_per_node): one run on all of them.
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def _slurm_rendezvous() -> None:
    """MASTER_ADDR / MASTER_PORT for SLURM tasks started without torchrun: the job's first node."""
    if "MASTER_ADDR" in os.environ:
        return
    import submitit

    env = submitit.JobEnvironment()
    os.environ["MASTER_ADDR"] = env.hostnames[0]
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def init(cfg: DistributedConfig | None = None) -> Dist:
    """Join the run's process group when launched on several processes (NCCL on GPUs, gloo on CPUs).

    Collectives time out after ``distributed.timeout_s``; each rank registers its process in the store, so that
    rank 0 can name a rank whose process is gone.
    """
    where = launch_env()
    if where is None:
        return SINGLE
    rank, world, local = where
    if dist.is_initialized():
        return Dist(rank, world, local, dist.get_backend())
    if "WORLD_SIZE" not in os.environ:
        _slurm_rendezvous()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    timeout_s = (cfg or DistributedConfig()).timeout_s
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _timeout_s[0] = timeout_s
    _register_process(rank)
    return Dist(rank, world, local, backend)


_timeout_s = [DistributedConfig.timeout_s]  # the process group's, for the record of a timed-out collective


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast(value: T, src: int = 0) -> T:
    """``value`` as rank ``src`` has it, on every rank (any picklable object)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def signals_by_rank(name: str | None, device: torch.device) -> dict[int, str]:
    """{rank: signal name} for the ranks that received a stop signal, known to every rank (one all-reduce of N
    numbers): a signal seen by one rank stops all at the same step, and the record names the signal and the rank."""
    if not dist.is_initialized():
        return {0: name} if name else {}
    numbers = torch.zeros(dist.get_world_size(), device=_comm_device(device))
    numbers[dist.get_rank()] = signal.Signals[name].value if name else 0
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
    return {r: signal.Signals(int(n)).name for r, n in enumerate(numbers.tolist()) if n}


def _comm_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def all_sum_(vector: torch.Tensor) -> torch.Tensor:
    """Sum ``vector`` over the ranks in place (gloo reduces on the host: a round trip for Q floats)."""
    if not dist.is_initialized():
        return vector
    comm = _comm_device(vector.device)
    if comm == vector.device:
        dist.all_reduce(vector)
        return vector
    host = vector.to(comm)
    dist.all_reduce(host)
    return vector.copy_(host)


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _start_time(pid: int) -> str | None:
    """``pid``'s start time (clock ticks after boot, /proc/<pid>/stat field 22) while it runs; None once it has
    ended (gone, or a zombie). The start time tells a reused pid from the process that registered."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _register_process(rank: int) -> None:
    try:
        started = _start_time(os.getpid()) or "?"
        _store().set(PROCESS_KEY.format(rank=rank), f"{socket.gethostname()} {os.getpid()} {started}")
    except Exception:  # without it, rank 0 cannot tell whether this process ended: nothing more
        log.debug("could not register the process", exc_info=True)


def _process(rank: int) -> tuple[str, bool | None]:
    """(``pid N on HOST``, whether that process has ended: None when it runs on another host, or is unknown)."""
    try:
        host, pid, started = _store().get(PROCESS_KEY.format(rank=rank)).decode().split()
    except Exception:
        return "process unknown", None
    if host != socket.gethostname() or started == "?":
        return f"pid {pid} on {host}", None
    return f"pid {pid} on {host}", _start_time(int(pid)) != started


def _report(rank: int) -> dict[str, Any] | None:
    key = REPORT_KEY.format(rank=rank)
    try:
        store = _store()
        return json.loads(store.get(key)) if store.check([key]) else None
    except Exception:
        return None


def lost_peers() -> str | None:
    """The other ranks whose processes (on this host) ended without leaving a report, named; else None."""
    if not dist.is_initialized():
        return None
    gone = []
    for rank in range(dist.get_world_size()):
        if rank != dist.get_rank() and _report(rank) is None:
            where, ended = _process(rank)
            if ended:
                gone.append(f"rank {rank} ({where})")
    if not gone:
        return None
    return (f"{', '.join(gone)} ended without reporting an error (killed by a signal such as SIGKILL, or out of "
            "memory)")


def heir_of_main(wait_s: float = 1.0) -> str | None:
    """Why rank 0 is gone, when its process (on this host) ended without a report (SIGKILL, out of memory) and this
    rank is the lowest one still running: this rank then writes the run's record in rank 0's place. None otherwise
    (rank 0 runs, or reported its own failure and records it; or another rank inherits). A collective broken by rank
    0's death can fail a moment before its process is seen to end: wait up to ``wait_s`` for it."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        where, ended = _process(0)
        if _report(0) is not None or ended is None:
            return None
        if ended:
            break
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    if any(_process(r)[1] is not True for r in range(1, dist.get_rank())):
        return None  # a lower rank still runs (or cannot be seen): it writes the record
    return (f"rank 0 ({where}) ended without reporting an error (killed by a signal such as SIGKILL, or out of "
            f"memory); rank {dist.get_rank()} recorded the run in its place")


def report_failure(message: str, signal_name: str | None = None) -> None:
    """Leave this rank's error, or the signal that stopped it at once, where rank 0 can read it (the store
    outlives a failed rank under torchrun)."""
    if not dist.is_initialized():
        return
    try:
        store = _store()
        order = store.add(ORDER_KEY, 1)
        report = {"rank": dist.get_rank(), "reason": message, "signal": signal_name, "order": order}
        store.set(REPORT_KEY.format(rank=dist.get_rank()), json.dumps(report))
    except Exception:  # the store went away with the group: torchrun's own log still names the failure
        log.debug("could not leave the report in the store", exc_info=True)


def mark_recorded(status: str) -> None:
    """Rank 0 wrote a failed or interrupted record: leave a report, so that a rank let go later (a hung one) does
    not take rank 0 for dead without a word and write the record again in its place (``heir_of_main``)."""
    if dist.is_initialized() and dist.get_rank() == 0 and status in ("failed", "interrupted"):
        report_failure(f"rank 0 recorded the run as {status}")


@dataclass(frozen=True)
class PeerReport:
    """Why another rank stopped, as rank 0 records it: ``reason`` names the rank; ``signal``: a signal stopped
    it at once (the run is then ``interrupted``, not ``failed``)."""

    reason: str
    signal: str | None = None


def peer_failure(error: BaseException | None = None, wait_s: float = 5.0) -> PeerReport | None:
    """Why another rank stopped, when rank 0's own ``error`` may be its consequence (a broken collective).

    The first report a rank left (waiting up to ``wait_s`` for one); a rank whose process ended without one
    (SIGKILL, out of memory), at once; after a collective's timeout, the ranks that neither answered nor reported.
    None when no other rank is to blame.
    """
    if not dist.is_initialized():
        return None
    others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
    timed_out = error is not None and any(w in str(error).lower() for w in ("timed out", "timeout"))
    deadline = time.monotonic() + wait_s
    while True:
        reports = {rank: r for rank in others if (r := _report(rank)) is not None}
        lost = lost_peers()
        if lost is not None:
            return PeerReport(lost)
        if (reports and not timed_out) or len(reports) == len(others) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    silent = [r for r in others if r not in reports]
    if timed_out and silent:  # the ranks that answered timed out waiting for the silent ones too, and said so
        named = ", ".join(f"rank {r} ({_process(r)[0]})" for r in silent)
        return PeerReport(f"{named} did not answer within distributed.timeout_s={_timeout_s[0]} (a hung process or a "
                          f"lost node); {type(error).__name__}: {error}")
    if reports:
        first = min(reports.values(), key=lambda r: r["order"])
        return PeerReport(f"rank {first['rank']}: {first['reason']}", first.get("signal"))
    return None


def _fingerprint(settings: dict[str, Any] | None) -> str | None:
    return None if settings is None else hashlib.sha256(
        json.dumps(settings, sort_keys=True, default=repr).encode()).hexdigest()


def agree(settings: dict[str, Any] | None, problem: str | None = None) -> None:
    """Before any heavy work: every rank runs the same settings and none of them is refused, or none runs.

    ``settings``: this rank's flat settings that decide the run's numbers (paths that may differ per node left
    out); ``problem``: this rank's one-line error (a bad override, a missing file), settings then None. Each rank
    contributes a hash and its problem (one all-gather); only when the hashes differ are the settings themselves
    gathered, to name the first differing key and each rank's value. Rank 0 raises the ConfigError it prints
    (naming the rank), the others a PeerError, so that every rank ends before the run directory is touched.
    """
    if not dist.is_initialized():
        if problem is not None:
            raise ConfigError(problem)
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = (_fingerprint(settings), problem)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    message = _refusal(everyone, settings)
    if message is not None:
        raise (ConfigError if rank == 0 else PeerError)(message)


def _refusal(everyone: list[tuple[str | None, str | None]], settings: dict[str, Any] | None) -> str | None:
    """The one line that stops the launch (a rank's error, or the ranks' settings disagreeing), or None."""
    problems = [(r, p) for r, (_, p) in enumerate(everyone) if p is not None]
    if problems:
        first = problems[0][1]
        same = [r for r, p in problems if p == first]
        ranks = f"rank {same[0]}" if len(same) == 1 else (
            "every rank" if len(same) == len(everyone) else f"ranks {', '.join(map(str, same))}")
        more = len(problems) - len(same)
        return f"{ranks}: {first}" + (f" (and {more} other rank(s) with another error)" if more else "")
    if len({digest for digest, _ in everyone}) == 1:
        return None
    gathered: list[Any] = [None] * len(everyone)
    dist.all_gather_object(gathered, settings)
    missing = object()
    keys = sorted({k for s in gathered for k in s})
    key = next((k for k in keys if len({repr(s.get(k, missing)) for s in gathered}) > 1), None)
    if key is None:  # the same values, hashed apart (a value without a stable text form): name no key
        return "the ranks' settings hash differently; start every rank with the same command and environment"
    values = ", ".join(f"{s[key]!r} on rank {r}" if key in s else f"absent on rank {r}" for r, s in enumerate(gathered))
    return (f"the ranks were given different settings, so they would train different models: {key} is {values}; "
            "start every rank with the same command and environment")


def layout(d: Dist, mode: str) -> dict[str, Any]:
    """The process layout a checkpoint records: the world size, and the mode when there are several processes."""
    return {"world_size": d.world_size, "mode": mode if d.enabled else None}


def layout_change(recorded: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """``world_size 2 -> 1`` (and the mode's change) when a checkpoint's layout is not this command's; None when it
    is, or when the checkpoint predates the record of layouts."""
    if recorded is None:
        return None
    changes = [f"{k} {recorded.get(k)} -> {v}" for k, v in current.items() if recorded.get(k) != v]
    return ", ".join(changes) or None


def describe(d: Dist, spread_mode: str, zeroth_order: bool) -> dict[str, Any]:
    """What result.json records about the processes a run used."""
    if not d.enabled:
        return {"world_size": 1, "parallel": "none"}
    return {"world_size": d.world_size, "backend": d.backend,
            "parallel": (f"zo:{spread_mode}" if zeroth_order else "ddp")}
