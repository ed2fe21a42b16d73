"""`gpuscale doctor --repair` rebuilding a runs.db truncated to 100 bytes from the run folders: each
run's status from the evidence its folder holds (the end recorded in run.json, an error file, a
partial summary, the steps done of the total, a live supervisor), its parent, label and figures
kept. Run folders written here as a supervisor and its ranks write them; the integration tests
(tests/integration/test_runs.py, test_resume.py) do the same with real runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpuscale.control import launch
from gpuscale.control.doctor import _live_supervisor, examine
from gpuscale.control.store import Store
from gpuscale.runs.run_dir import RunDir


def write_run(home, run_id: int, steps: int, total: int, summary: dict | None = None, partial: bool = False,
              error: str | None = None, **info) -> RunDir:
    """A probe run's folder: `steps` of `total` steps logged by rank 0, its summary, its error file,
    and run.json's `info` (an `ended` record, a parent_id, a label)."""
    folder = RunDir(home / "runs" / str(run_id)).make()
    folder.settings.write_text(json.dumps({"steps": total}))
    t = time.time() - 100
    lines = [{"t": t, "rank": 0, "step": 0, "total": total}]
    lines += [{"t": t + step, "rank": 0, "step": step, "tokens": 10.0, "samples": 1.0} for step in range(1, steps + 1)]
    if summary is not None:
        lines.append({"t": t + steps + 1, "rank": 0, "summary": summary, **({"partial": True} if partial else {})})
    folder.metrics(0).write_text("".join(json.dumps(line) + "\n" for line in lines))
    if error:
        folder.error(0).write_text(json.dumps({"t": t + steps, "rank": 0, "message": error}))
    folder.update_info(recipe="probe", command=["torchrun"], host="h", notes={}, **info)
    return folder


def truncate_history(home, runs: int) -> None:
    """A history with `runs` rows, then its runs.db cut to 100 bytes (the SQLite header only)."""
    store = Store(home)
    for _ in range(runs):
        store.create_run("probe", {}, [], "h")
    store.close()
    os.truncate(home / "runs.db", 100)


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory):
    """Folders as they are after runs that ended every way, and the history rebuilt from them."""
    home = tmp_path_factory.mktemp("home")
    ended = {"ended_at": time.time() - 10, "started_at": time.time() - 100}
    # Recorded by their supervisor (or the front end that found them lost) in run.json:
    write_run(home, 1, 30, 30, {"tokens_per_s": 9.0},
              ended={**ended, "status": "succeeded", "summary": {"tokens_per_s": 9.0, "duration_s": 90.0}})
    write_run(home, 2, 12, 30, {"accuracy_before": 0.5}, partial=True, label="base",
              ended={**ended, "status": "stopped", "exit_code": -15,
                     "summary": {"partial": True, "accuracy_before": 0.5, "steps_done": 12, "duration_s": 90.0}})
    write_run(home, 3, 11, 30, ended={**ended, "status": "lost", "error": "supervisor (pid 9) died",
                                      "summary": {"partial": True, "steps_done": 11}})
    write_run(home, 4, 5, 30, error="RuntimeError: boom", parent_id=2, label="base",
              ended={**ended, "status": "failed", "error": "rank 0: RuntimeError: boom", "exit_code": 1})
    # Left by a gpuscale that recorded no end in run.json: the other evidence decides.
    write_run(home, 5, 30, 30, {"tokens_per_s": 8.0})
    write_run(home, 6, 12, 30, {"accuracy_before": 0.25}, partial=True)
    write_run(home, 7, 30, 30, {"tokens_per_s": 7.0}, partial=True)  # every step, but the summary is partial
    write_run(home, 8, 4, 30, error="RuntimeError: injected fault")
    # Resumed by a gpuscale whose run.json did not keep the parent: its checkpoint names it.
    older = write_run(home, 10, 2, 30, error="RuntimeError: boom")
    older.settings.write_text(json.dumps({"steps": 30, "resume_from": str(home / "runs/8/checkpoints/checkpoint-4")}))
    # A run still going: a process whose command line is its supervisor's.
    write_run(home, 9, 3, 30, {"accuracy_before": 0.75}, partial=True)
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                   "-m", "gpuscale.control.supervisor", "9", "--home", str(home)])
    truncate_history(home, 10)
    findings = examine(home, repair=True)
    store = Store(home)
    yield home, store, findings, supervisor
    store.close()
    supervisor.kill()
    supervisor.wait()


def test_the_damaged_history_is_moved_aside_and_every_run_rebuilt(rebuilt):
    home, _store, findings, _ = rebuilt
    assert all(finding.ok for finding in findings), findings
    assert " free of " in findings[0].text  # the room on the home's file system comes first
    assert "moved to runs.db.damaged-" in findings[1].text and "\n" not in findings[1].text
    assert findings[2].text == ("10 run(s) rebuilt from their folders: 1 (succeeded), 2 (stopped), 3 (lost), "
                                "4 (failed), 5 (succeeded), 6 (lost), 7 (lost), 8 (failed), 9 (running), 10 (failed)")


def test_a_recorded_end_gives_the_status_error_and_figures(rebuilt):
    _home, store, _findings, _ = rebuilt
    stopped = store.get_run(2)
    assert stopped["status"] == "stopped" and stopped["exit_code"] == -15 and stopped["error"] is None
    assert stopped["summary"]["accuracy_before"] == 0.5 and stopped["summary"]["steps_done"] == 12
    assert stopped["summary"]["duration_s"] == 90.0 and stopped["label"] == "base"
    lost = store.get_run(3)
    assert lost["status"] == "lost" and lost["error"] == "supervisor (pid 9) died"
    assert store.get_run(1)["summary"] == {"tokens_per_s": 9.0, "duration_s": 90.0}


def test_the_resume_link_and_label_survive(rebuilt):
    _home, store, _findings, _ = rebuilt
    child = store.get_run(4)
    assert child["status"] == "failed" and child["error"] == "rank 0: RuntimeError: boom"
    assert child["parent_id"] == 2 and child["label"] == "base"
    assert [run["id"] for run in store.children(2)] == [4]
    assert store.get_run(10)["parent_id"] == 8  # from its resume_from, where run.json has no parent


def test_without_a_recorded_end_the_evidence_decides(rebuilt):
    _home, store, _findings, _ = rebuilt
    assert store.get_run(5)["status"] == "succeeded"  # a whole summary, every step done
    for run_id, step in ((6, 12), (7, 30)):  # a partial summary is a run that did not end
        run = store.get_run(run_id)
        assert run["status"] == "lost", run
        assert run["error"] == (f"rebuilt from its folder after the history was lost: it ended at step {step}/30 "
                                "without recording how (stopped, or its supervisor died)")
        assert run["summary"]["partial"] is True and run["summary"]["steps_done"] == step
    assert store.get_run(6)["summary"]["accuracy_before"] == 0.25  # figures kept
    failed = store.get_run(8)
    assert failed["status"] == "failed" and failed["error"] == "rank 0: RuntimeError: injected fault"


def test_a_live_run_stays_running_and_its_recorded_end_is_taken_once_it_is_gone(rebuilt):
    home, store, _findings, supervisor = rebuilt
    running = store.get_run(9)
    assert running["status"] == "running" and running["ended_at"] is None
    assert running["supervisor_pid"] == supervisor.pid
    # Its supervisor records the end in the folder, then dies before the history hears of it:
    RunDir(home / "runs" / "9").record_end("stopped", summary={"partial": True, "steps_done": 3}, exit_code=-15)
    supervisor.kill()
    supervisor.wait()
    assert launch.reconcile(store) == []  # not marked lost: its end was recorded
    ended = store.get_run(9)
    assert ended["status"] == "stopped" and ended["summary"] == {"partial": True, "steps_done": 3}


@pytest.mark.parametrize("module", ["gpuscale.control.supervisor", "gpuscale.runs.supervisor"])
def test_a_supervisor_is_found_under_its_module_of_today_and_of_before_the_move(module, tmp_path):
    """A run started before the control plane moved to gpuscale/control/ still runs under
    `-m gpuscale.runs.supervisor`: the doctor must see it alive, not rebuild it as lost."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                "-m", module, "42", "--home", str(tmp_path)])
    try:
        deadline = time.monotonic() + 10
        while _live_supervisor(42, tmp_path) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until its command line is readable
        assert _live_supervisor(42, tmp_path).pid == process.pid
        assert _live_supervisor(43, tmp_path) is None  # another run's id
    finally:
        process.kill()
        process.wait()
