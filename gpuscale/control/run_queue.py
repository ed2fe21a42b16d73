"""The queue of runs started with `--queue`: who may start, and what a run on this host asks for.

There is no queue daemon. A queued run is recorded at once, status `queued`, with `queue: true` in its
notes; its supervisor starts too, and waits (polling the history) until the run may start, then takes
its turn in one SQLite write transaction (`Store.take_turn`), so that two waiters never both start on
the same devices. The rule is `may_start`: the devices the run asks for carry no other live gpuscale
run of its host (one running, or one started without `--queue` that is still starting), and no run
queued before it waits for any of them (first in, first out, per device: a run asking for another
GPU does not wait behind it). A run started without `--queue` never waits, so several runs can still
share one card on purpose.

What a run asks for is its device plan (plan.json): its GPUs; on a machine without GPUs, its CPU
ranks, out of `cpu_slots` (the host's cores, or GPUSCALE_QUEUE_CPU_SLOTS).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from gpuscale.runs.run_dir import RunDir

CPU_SLOTS_ENV = "GPUSCALE_QUEUE_CPU_SLOTS"
# How often a queued run's supervisor looks whether its turn has come (a read; the write lock is taken
# only when it looks like it has). Fifty waiters poll five hundred times a minute at most.
POLL_S = 2.0


@dataclass(frozen=True)
class Demand:
    """What a run holds while it runs: GPUs by NVML index, or (no GPU) CPU ranks."""

    gpus: frozenset[int]
    cpu_ranks: int

    @classmethod
    def of_plan(cls, plan: dict) -> Demand:
        gpus = frozenset(plan.get("gpu_indices") or ())
        return cls(gpus, 0 if gpus else max(1, int(plan.get("nproc") or 1)))

    @classmethod
    def of_run(cls, run: dict) -> Demand:
        """From the run's plan.json; one CPU rank where it cannot be read (a run made by an older
        gpuscale, a folder gone): counted, never ignored."""
        try:
            return cls.of_plan(json.loads(RunDir(run["run_dir"]).plan.read_text()))
        except (OSError, TypeError, ValueError, KeyError):
            return cls(frozenset(), 1)

    @property
    def ranks(self) -> int:
        return self.cpu_ranks or len(self.gpus)

    def describe(self, slots: int) -> str:
        """What the run waits for: `GPU 0,1 free of other gpuscale runs`, `2 of the 4 CPU rank slots`."""
        if self.gpus:
            return "GPU " + ",".join(map(str, sorted(self.gpus))) + " free of other gpuscale runs"
        return f"{self.cpu_ranks} of the {slots} CPU rank slot(s) ({CPU_SLOTS_ENV}, else the cores)"


def cpu_slots(environ=os.environ) -> int:
    """The CPU ranks that may run at once on this host: GPUSCALE_QUEUE_CPU_SLOTS, else its cores."""
    from gpuscale.runs.devices import usable_cores  # not at the top: the store imports this module, pydantic-free
    from gpuscale.runs.settings import SettingsError

    text = environ.get(CPU_SLOTS_ENV, "").strip()
    if not text:
        return usable_cores()
    if not text.isdigit() or int(text) < 1:
        raise SettingsError(f"{CPU_SLOTS_ENV}: {text!r}: expected a whole number of CPU ranks, at least 1")
    return int(text)


def waits_in_queue(run: dict) -> bool:
    """Whether the run is queued with `--queue`, not yet started."""
    return run["status"] == "queued" and bool((run.get("settings") or {}).get("queue"))


def check_queueable(demand: Demand, nnodes: int, environ=os.environ) -> None:
    """Refuse, before anything is recorded, a queued run that could never start on this host."""
    from gpuscale.runs.settings import SettingsError

    if nnodes > 1:
        raise SettingsError(f"queue: nnodes={nnodes}: a multi-node run cannot wait in one host's queue "
                            "(each node would start when its own devices free up); queue it with SLURM")
    slots = cpu_slots(environ)
    if demand.cpu_ranks > slots:
        raise SettingsError(f"gpus: {demand.cpu_ranks}: more CPU ranks than the queue's {slots} slot(s) "
                            f"({CPU_SLOTS_ENV}, else the cores): the run could never start")


def conflicts(mine: Demand, other: Demand) -> bool:
    """Whether two runs ask for one device: a GPU in common, or both on the CPU ranks' slots."""
    return bool(mine.gpus & other.gpus) or bool(mine.cpu_ranks and other.cpu_ranks)


def may_start(run: dict, live: list[dict], slots: int, demand_of=Demand.of_run) -> bool:
    """Whether queued `run` may start now, among `live` (the live runs of its host, itself included):
    no earlier queued run waits for a device it asks for, and the runs holding devices leave it room
    (no GPU of its in use; on CPU, its ranks and theirs within `slots`)."""
    mine = demand_of(run)
    held_cpu = 0
    for other in live:
        if other["id"] == run["id"]:
            continue
        theirs = demand_of(other)
        if waits_in_queue(other):
            if other["id"] < run["id"] and conflicts(mine, theirs):
                return False  # first in, first out
            continue
        if mine.gpus & theirs.gpus:
            return False
        held_cpu += theirs.cpu_ranks
    return not mine.cpu_ranks or held_cpu + mine.cpu_ranks <= slots


def positions(waiting: list[dict]) -> dict[int, int]:
    """Each waiting run's place in its host's queue, 1 first, from runs in the order they were queued."""
    found, per_host = {}, {}
    for run in waiting:
        per_host[run.get("host")] = per_host.get(run.get("host"), 0) + 1
        found[run["id"]] = per_host[run.get("host")]
    return found
