"""`gpuscale run --queue` end to end on CPU: real supervisors that wait their turn, real torchrun ranks,
a real runs.db. The queue's CPU rank slots are set (GPUSCALE_QUEUE_CPU_SLOTS), whatever the machine's
cores: one, so that three 1-rank runs must take turns; two, which a 2-rank run holds while 2-rank runs
wait behind it. And the oversubscription warning at launch, with its threshold set."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from conftest import gpuscale, leftover_processes, rank_processes, run_json, wait_for_metrics, wait_until
from gpuscale.control.store import Store
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.statuses import LIVE_STATUSES

pytestmark = pytest.mark.e2e  # every test here starts real runs

SHORT = ["--recipe", "probe", "--set", "steps=4", "--set", "prompt_tokens=8", "--batch-size", "2"]
FAST = [*SHORT, "--gpus", "2"]
LONG = ["--recipe", "probe", "--set", "steps=100000", "--set", "prompt_tokens=8", "--batch-size", "2", "--gpus", "2"]
ONE_SLOT, TWO_SLOTS = {"GPUSCALE_QUEUE_CPU_SLOTS": "1"}, {"GPUSCALE_QUEUE_CPU_SLOTS": "2"}


def detach(*args: str, env: dict | None = None) -> tuple[int, float]:
    """`gpuscale run ARGS --detach`: the run id and how long the command took to return."""
    start = time.monotonic()
    result = gpuscale("run", *args, "--detach", env=env)
    assert result.returncode == 0, result.stderr
    return int(result.stdout), time.monotonic() - start


def ended(store: Store, run_id: int, timeout: float = 240) -> dict:
    return wait_until(lambda: (run := store.get_run(run_id))["status"] not in LIVE_STATUSES and run, timeout,
                      message=f"run {run_id} to end")


def test_three_queued_runs_on_one_slot_run_one_after_another_in_order(home):
    ids = [detach("--queue", *SHORT, "--gpus", "1", "--label", f"q{n}", env=ONE_SLOT)[0] for n in range(3)]
    listed = {run["id"]: run for run in run_json("runs")}
    # The first may have started already; the later ones wait, in the order they were queued.
    waiting = [run_id for run_id in ids if listed[run_id]["status"] == "queued"]
    assert waiting and waiting == ids[-len(waiting):]
    assert [listed[run_id]["queue_position"] for run_id in waiting] == list(range(1, len(waiting) + 1))
    # The table is a later snapshot: a run may have left the queue since (seen on a loaded machine), so the runs
    # still waiting are shown #1, #2, ... and are at most those above; the last queued cannot have started yet.
    shown = sorted(int(position) for position in re.findall(r"queued #(\d+)", gpuscale("runs").stdout))
    assert 1 <= len(shown) <= len(waiting) and shown == list(range(1, len(shown) + 1))
    store = Store(home)
    runs = [ended(store, run_id) for run_id in ids]
    assert [run["status"] for run in runs] == ["succeeded"] * 3
    # One after another, first in first out: each started once the one before had ended.
    for before, after in zip(runs, runs[1:]):
        assert after["started_at"] >= before["ended_at"], (before, after)
    log = RunDir(runs[-1]["run_dir"]).supervisor_log.read_text()
    assert "queued: waiting for 1 of the 1 CPU rank slot(s)" in log and "its turn came after" in log


@pytest.fixture(scope="module")
def holder(module_home) -> int:
    """A LONG 2-rank run, running, for the tests that need one: it holds both slots of TWO_SLOTS while a
    queued run waits behind it, and it is the live run the oversubscription warning counts. Once it
    runs, its ranks are stopped (SIGSTOP; its hang watch off, or it would end as hung): it keeps its
    slots and its memory without taking the cores from the runs beside it. Stopped after the tests."""
    run_id, _ = detach(*LONG, "--set", "hang_timeout=off")
    wait_for_metrics(module_home, run_id)  # running, its processes holding memory
    ranks = rank_processes(Store(module_home).get_run(run_id)["run_dir"]).values()
    for rank in ranks:
        rank.suspend()
    yield run_id
    for rank in ranks:
        rank.resume()
    assert gpuscale("stop", str(run_id)).returncode == 0


def test_detach_returns_before_the_ranks_start_and_a_queued_run_can_be_stopped(module_home, holder):
    """The long run holds both slots, so the queued one's ranks cannot start: its `--detach` came back
    all the same, with the run recorded. Stopped while it waits, it ends `stopped`, nothing having run."""
    store = Store(module_home)
    queued, seconds = detach("--queue", *FAST, env=TWO_SLOTS)
    run = store.get_run(queued)
    assert run["status"] == "queued" and run["queue_position"] == 1
    folder = RunDir(run["run_dir"])
    wait_until(lambda: "queued: waiting" in folder.supervisor_log.read_text(), 60, message="the waiter's log line")
    time.sleep(3 * 2.0)  # a few of the waiter's polls: the holder is still running, so it must still wait
    assert store.get_run(queued)["status"] == "queued"
    assert not folder.launcher_log.exists() and not folder.rank_logs()
    stop = gpuscale("stop", str(queued))
    assert stop.returncode == 0 and f"run {queued}: stopped" in stop.stdout
    run = store.get_run(queued)
    assert run["status"] == "stopped" and run["started_at"] is None and run["hint"] == \
        "stopped while queued: it never started"
    assert not leftover_processes(run["run_dir"]) and not folder.launcher_log.exists()
    assert store.get_run(holder)["status"] == "running"  # the stop was the queued run's alone
    assert seconds < 60  # it did not wait for the holder, which runs 100,000 steps


def test_a_dead_waiter_is_reconciled_lost(module_home, holder):
    queued, _ = detach("--queue", *FAST, env=TWO_SLOTS)
    store = Store(module_home)
    run = wait_until(lambda: (r := store.get_run(queued))["supervisor_started"] and r, 60,
                     message="the waiter to register")
    os.kill(run["supervisor_pid"], signal.SIGKILL)
    wait_until(lambda: run_json("show", str(queued))["status"] == "lost", 30, message="the waiter marked lost")
    lost = store.get_run(queued)
    assert lost["error"] == f"supervisor (pid {run['supervisor_pid']}) died while the run was queued; it never started"
    assert store.get_run(holder)["status"] == "running"


def test_a_queued_run_that_could_never_start_is_refused_before_anything(home):
    too_many = gpuscale("run", "--queue", *FAST, "--detach", env={"GPUSCALE_QUEUE_CPU_SLOTS": "1"})
    assert (too_many.returncode, too_many.stdout) == (2, "")
    assert too_many.stderr == ("gpuscale: error: gpus: 2: more CPU ranks than the queue's 1 slot(s) "
                               "(GPUSCALE_QUEUE_CPU_SLOTS, else the cores): the run could never start\n")
    bad = gpuscale("run", "--queue", *FAST, "--detach", env={"GPUSCALE_QUEUE_CPU_SLOTS": "two"})
    assert bad.returncode == 2 and bad.stderr == ("gpuscale: error: GPUSCALE_QUEUE_CPU_SLOTS: 'two': expected a "
                                                  "whole number of CPU ranks, at least 1\n")
    nodes = gpuscale("run", "--queue", *FAST, "--nnodes", "2", "--rdzv-endpoint", "localhost:29999", "--detach")
    assert nodes.returncode == 2 and "queue: nnodes=2: a multi-node run cannot wait" in nodes.stderr
    assert Store(home).list_runs() == []


def test_a_launch_warns_when_the_host_is_oversubscribed(module_home, holder):
    """The holder is the one live run (the queued runs above ended). The launches are what is checked:
    each run they start is stopped at once."""
    store = Store(module_home)
    recorded = len(store.list_runs())
    warned = launched_and_stopped(store, *FAST, env={"GPUSCALE_OVERSUBSCRIBED_AT": "0"})
    lines = warned.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "warning: this host is oversubscribed with this run and 1 live gpuscale run(s): memory ")
    assert "GiB, as the 1 live run(s) each use); 4 ranks on" in lines[0]
    assert lines[0].endswith("(over 0%, GPUSCALE_OVERSUBSCRIBED_AT); `--queue` waits for free devices instead")
    quiet = launched_and_stopped(store, *FAST, env={"GPUSCALE_OVERSUBSCRIBED_AT": "1000"})
    assert quiet.stderr == ""
    bad = gpuscale("run", *FAST, "--detach", env={"GPUSCALE_OVERSUBSCRIBED_AT": "lots"})
    assert (bad.returncode, bad.stderr) == (2, "gpuscale: error: GPUSCALE_OVERSUBSCRIBED_AT: 'lots': expected a "
                                               "share of the host, 0 or more (1 = all of it)\n")
    assert len(store.list_runs()) == recorded + 2  # the refused one was not recorded


def launched_and_stopped(store: Store, *args: str, env: dict) -> subprocess.CompletedProcess:
    """`gpuscale run ARGS --detach`, which succeeded; its run then stopped and ended."""
    launched = gpuscale("run", *args, "--detach", env=env)
    assert launched.returncode == 0, launched.stderr
    assert gpuscale("stop", launched.stdout.strip()).returncode == 0
    ended(store, int(launched.stdout))
    return launched
