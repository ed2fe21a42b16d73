"""The queue's rule (control/run_queue.py) and its place in the history (Store.take_turn, positions),
on a real SQLite file with real plan.json files; no run is started."""

from __future__ import annotations

import json

import pytest

from gpuscale.app.commands.common import public_run
from gpuscale.app.views.runs import run_row, status_line, status_text
from gpuscale.control import run_queue
from gpuscale.control.run_queue import Demand, cpu_slots, may_start, positions
from gpuscale.control.store import Store
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.settings import SettingsError


def add_run(store: Store, gpus: list[int] = (), nproc: int = 1, queue: bool = False, status: str = "queued",
            host: str = "node1") -> int:
    """A run row with its plan.json; `queue`: started with --queue."""
    run_id = store.create_run("probe", {"queue": True} if queue else {}, [], host)
    folder = RunDir(store.get_run(run_id)["run_dir"])
    folder.plan.parent.mkdir(parents=True, exist_ok=True)
    folder.plan.write_text(json.dumps({"nproc": len(gpus) or nproc, "gpu_indices": list(gpus)}))
    if status != "queued":
        store.update_run(run_id, status=status)
    return run_id


def starts(store: Store, run_id: int, slots: int = 4) -> bool:
    return may_start(store.get_run(run_id), store.live_runs(), slots)


def test_a_gpu_run_waits_for_its_gpus_and_behind_earlier_runs_waiting_for_them(tmp_path):
    store = Store(tmp_path)
    add_run(store, gpus=[0], status="running")
    on_0 = add_run(store, gpus=[0, 1], queue=True)
    on_1 = add_run(store, gpus=[1], queue=True)
    on_2 = add_run(store, gpus=[2], queue=True)
    assert not starts(store, on_0)  # GPU 0 is in use
    assert not starts(store, on_1)  # GPU 1 is free, but on_0 was queued before it for GPU 1
    assert starts(store, on_2)  # nobody holds or waits for GPU 2: no need to wait behind the others
    add_run(store, gpus=[2])  # started without --queue, still starting: it holds GPU 2 already
    assert not starts(store, on_2)


def test_cpu_runs_share_the_slots_first_in_first_out(tmp_path):
    store = Store(tmp_path)
    running = add_run(store, nproc=2, status="running")
    big = add_run(store, nproc=3, queue=True)
    small = add_run(store, nproc=1, queue=True)
    assert not starts(store, big, slots=4)  # 2 + 3 > 4
    assert not starts(store, small, slots=4)  # it would fit, but `big` came first
    assert starts(store, big, slots=5)
    store.finish_run(running, "succeeded")
    assert starts(store, big, slots=4) and not starts(store, small, slots=4)


def test_take_turn_lets_one_of_two_waiters_start_on_one_device(tmp_path):
    first_store, second_store = Store(tmp_path), Store(tmp_path)  # two supervisors' connections
    first, second = add_run(first_store, gpus=[0], queue=True), add_run(first_store, gpus=[0], queue=True)

    def rule(run, live):
        return may_start(run, live, 4)

    assert second_store.take_turn(second, rule) == "queued"  # behind the first
    assert first_store.take_turn(first, rule, started_at=123.0) == "running"
    assert first_store.get_run(first)["started_at"] == 123.0
    assert second_store.take_turn(second, rule) == "queued"  # GPU 0 is the first's now
    assert first_store.take_turn(first, rule) == "running"  # asked again: nothing changes
    first_store.finish_run(first, "succeeded")
    assert second_store.take_turn(second, rule) == "running"
    stopped = add_run(first_store, gpus=[1], queue=True)
    first_store.finish_run(stopped, "stopped")
    assert second_store.take_turn(stopped, rule) == "stopped"
    assert second_store.take_turn(999, rule) is None


def test_positions_count_waiting_runs_per_host_in_order(tmp_path):
    store = Store(tmp_path)
    add_run(store, gpus=[0], status="running")
    a = add_run(store, gpus=[0], queue=True)
    elsewhere = add_run(store, gpus=[0], queue=True, host="node2")
    not_queued = add_run(store, gpus=[0])  # without --queue: starting, not waiting
    b = add_run(store, gpus=[1], queue=True)
    listed = {run["id"]: run.get("queue_position") for run in store.list_runs()}
    assert listed == {1: None, a: 1, elsewhere: 1, not_queued: None, b: 2}
    assert store.get_run(b)["queue_position"] == 2
    assert [run.get("queue_position") for run in store.live_runs()] == [None, 1, 1, None, 2]
    store.finish_run(a, "stopped")
    assert store.get_run(b)["queue_position"] == 1
    assert positions([{"id": 3, "host": "x"}, {"id": 5, "host": "y"}, {"id": 7, "host": "x"}]) == {3: 1, 5: 1, 7: 2}


def test_waiting_runs_hold_no_ranks_for_the_thread_count(tmp_path):
    store = Store(tmp_path)
    add_run(store, nproc=2, status="running")
    add_run(store, nproc=2, queue=True)
    add_run(store, nproc=1)  # starting without --queue: counted
    assert store.live_ranks_on("node1") == 3


def test_the_status_says_the_place_in_the_queue(tmp_path):
    store = Store(tmp_path)
    add_run(store, gpus=[0], status="running")
    waiting = store.get_run(add_run(store, gpus=[0], queue=True))
    assert status_text(waiting) == "queued #1" and run_row(waiting, 0.0)[2] == "queued #1"
    assert status_line(waiting, 0.0) == "queued #1"
    assert public_run(waiting)["queue_position"] == 1
    starting = store.get_run(add_run(store, gpus=[1]))
    assert status_text(starting) == "starting" and "queue_position" not in public_run(starting)


def test_cpu_slots_and_what_a_run_asks_for():
    assert cpu_slots({"GPUSCALE_QUEUE_CPU_SLOTS": " 3 "}) == 3
    for bad in ("0", "-1", "2.5", "two"):
        with pytest.raises(SettingsError, match=f"GPUSCALE_QUEUE_CPU_SLOTS: '{bad}': expected a whole number"):
            cpu_slots({"GPUSCALE_QUEUE_CPU_SLOTS": bad})
    assert Demand.of_plan({"nproc": 2, "gpu_indices": [3, 1]}) == Demand(frozenset({1, 3}), 0)
    assert Demand.of_plan({"nproc": 2, "gpu_indices": []}).ranks == 2
    assert Demand.of_run({"run_dir": "/nonexistent"}) == Demand(frozenset(), 1)  # unreadable: one CPU rank
    with pytest.raises(SettingsError, match="more CPU ranks than the queue's 2 slot"):
        run_queue.check_queueable(Demand(frozenset(), 3), 1, {"GPUSCALE_QUEUE_CPU_SLOTS": "2"})
    run_queue.check_queueable(Demand(frozenset({0, 1, 2}), 0), 1, {"GPUSCALE_QUEUE_CPU_SLOTS": "2"})  # GPUs


def test_a_history_rebuilt_while_a_run_waits_keeps_it_queued(tmp_path):
    """`doctor --repair` (runs.db lost): a live supervisor that has not started its launcher is a waiter."""
    from gpuscale.control.doctor import status_from_folder

    folder = RunDir(tmp_path / "runs" / "7").make()
    folder.update_info(notes={"queue": True})
    assert status_from_folder(folder, folder.read_info(), None, {}, supervised=True) == ("queued", None)
    folder.launcher_log.write_text("")  # its turn came: the launcher started
    assert status_from_folder(folder, folder.read_info(), None, {}, supervised=True) == ("running", None)
    assert status_from_folder(RunDir(tmp_path / "runs" / "8").make(), {}, None, {}, supervised=True) == \
        ("running", None)
