"""`gpuscale run`'s live progress line fits the terminal: a redraw longer than the width wraps, and
`\\r` then only returns to the start of the last row, leaving a stale line behind at every redraw."""

from __future__ import annotations

import io
import os
import re
import signal
import threading
import time

import psutil
import pytest
from rich.cells import cell_len

from gpuscale.app.commands import launching
from gpuscale.control.store import Store

ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def running_run(store: Store) -> int:
    """A live run with every part of the progress line (well over 120 characters)."""
    run_id = store.create_run("probe", {"batch_size": 8}, [], "node001")
    now = time.time()
    store.update_run(run_id, status="running", started_at=now - 83, supervisor_pid=os.getpid(),
                     supervisor_started=psutil.Process().create_time(),
                     progress={"t": now, "step": 40, "total": 100, "tokens_per_s": 12_750.5, "samples_per_s": 12.0,
                               "latest": {"loss": 1.2345, "reward": 0.5, "accuracy": 0.25, "phase": "generate"}})
    return run_id


@pytest.mark.parametrize("columns", [80, 120])
def test_the_progress_line_never_exceeds_the_terminal(home, monkeypatch, columns):
    store = Store(home)
    run_id = running_run(store)
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setenv("COLUMNS", str(columns))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    def finish_later():
        time.sleep(1.6)  # three or four redraws
        Store(home).finish_run(run_id, "succeeded", ended_at=time.time())

    finisher = threading.Thread(target=finish_later)
    finisher.start()
    try:
        assert launching.follow_run(store, run_id) == 0
    finally:
        finisher.join()
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    redraws = [ESCAPE.sub("", part) for part in terminal.getvalue().split("\r")[1:]]
    redraws = [part.split("\n")[0] for part in redraws]  # the redrawn row; what follows it is the report
    assert len(redraws) >= 2 and all(f"run {run_id} probe" in line for line in redraws), redraws
    assert all(cell_len(line) < columns for line in redraws), [cell_len(line) for line in redraws]


def test_a_collapse_is_shown_in_the_progress_line_and_once_whole(home, monkeypatch):
    """A grpo-mtl run whose last 5 steps scored 0 with every completion at the cap: the redrawn line
    carries the warning right after the status (a narrow terminal cuts the end), and the warning is
    printed whole, once, on a line of its own."""
    store = Store(home)
    run_id = running_run(store)
    store.update_run(run_id, recipe="grpo-mtl", settings={"max_completion_length": 256})
    store.add_rows([{"run_id": run_id, "rank": 0, "t": time.time() - 10 + step, "step": step, "name": name,
                     "value": value}
                    for step in range(1, 7) for name, value in (("reward", 0.0), ("completions_clipped_ratio", 1.0))],
                   [])
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setenv("COLUMNS", "100")
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    def finish_later():
        time.sleep(1.6)
        Store(home).finish_run(run_id, "succeeded", ended_at=time.time())

    finisher = threading.Thread(target=finish_later)
    finisher.start()
    try:
        launching.follow_run(store, run_id)
    finally:
        finisher.join()
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    warning = ("collapse: reward 0.00 and 100% of completions at the 256-token cap over the last 5 steps "
               "— lower learning_rate, check precision")
    lines = [ESCAPE.sub("", part) for part in terminal.getvalue().replace("\r", "\n").split("\n")]
    assert lines.count(f"! {warning}") == 1, lines
    redraws = [line for line in lines if line.startswith(f"run {run_id} grpo-mtl · running")]
    assert len(redraws) >= 2 and all(" · ! collapse: reward 0.00" in line for line in redraws), redraws
    assert all(cell_len(line) < 100 for line in redraws)
