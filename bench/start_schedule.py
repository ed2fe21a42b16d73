"""When the runs of a check that share one machine start: longest first, and only a few in their
start-up at once (bench/acceptance.py's one-GPU check).

Why: in the one-call 1-GPU acceptance every run started at the same moment. For the first 55-73 s
after the launch the card did no work (NVML 0-11% in every 5 s sample) while the host ran 36-56
threads on its 16 cores (the 37 runs' CLI, supervisor, launcher and rank importing torch and
loading): the start-up is host-bound, and every run's first step waited on all the others' start-ups
(bench/results/acceptance/acceptance-1gpu-3seeds-test-v2-one-call-2026-11-29-h200.load.txt,
acceptance-1gpu-3seeds-grpo-64x4-2026-11-29-h200.load.txt). 19 runs started together on the same
kind of machine ended their one-batch validation runs in 27-33 s, 34-37 in 62-95 s
(acceptance-1gpu-3seeds-sft-rft-pcgrad-2026-11-28-h200.json against the two above).

- `start_order`: the runs longest first (their wall time in the last check), so that the runs that
  set the call's length reach the card first; entries a caller must start last stay last.
- `StartGate`: at most `slots` runs in their start-up at once, admitted in that order; a run's
  start-up ends when its rank 0 has written a line past its opening `loading` beat (`past_loading`:
  it has its model and begins its first evaluation, step or warm-up call), when it ends, or after
  START_UP_LIMIT_S.
- `start_slots`: the slots from the host's cores.

No torch: the check's process imports this before it imports torch.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpuscale.runs.heartbeat import BEAT_KEY, LOADING
from gpuscale.runs.run_dir import RunDir

# A run still loading after this long frees its slot all the same: the longest start-up measured was
# 73 s to the card's first busy sample with 37 runs starting at once (the module's docstring).
START_UP_LIMIT_S = 120.0
START_UP_POLL_S = 1.0
# Threads a starting run keeps runnable: 36-56 runnable for 31-37 starting runs (the load samples),
# so about 1.5; two a run leaves cores for the runs past their start-up.
THREADS_A_STARTING_RUN = 2


def start_slots(cores: int, ranks_a_run: int) -> int:
    """Runs in their start-up at once: the cores over the threads a starting run keeps busy (each rank
    of it starts as a run of one rank does), at least one."""
    return max(1, cores // (THREADS_A_STARTING_RUN * max(1, ranks_a_run)))


def start_order(entries: list[tuple], expected_wall: Callable[[str], float],
                last: Callable[[str], bool] = lambda label: False) -> list[tuple]:
    """`entries` (tuples, the label first) longest expected wall time first; those `last` names after
    every other, in the same order among themselves. Equal walls keep the entries' own order (a
    label's seeds in their order)."""
    return sorted(entries, key=lambda entry: (last(entry[0]), -expected_wall(entry[0])))


class StartGate:
    """At most `slots` runs in their start-up at once, each admitted at its place in the start order
    (0, 1, 2...) once every earlier place has been admitted or given up (`give_up`: a job that does not
    start, so that the places after it do not wait for it)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.turn = 0  # the place admitted next
        self.starting = 0  # runs admitted whose start-up has not ended
        self.given_up: set[int] = set()
        self.changed = threading.Condition()

    @contextlib.contextmanager
    def start_up(self, place: int):
        """Held from the run's admission to the end of its start-up (the caller's block)."""
        with self.changed:
            self.changed.wait_for(lambda: self.turn == place and self.starting < self.slots)
            self.starting += 1
            self.turn += 1
            self._skip_given_up()
        try:
            yield
        finally:
            with self.changed:
                self.starting -= 1
                self.changed.notify_all()

    def give_up(self, place: int) -> None:
        """The run at `place` will not start (or has already been admitted: nothing changes)."""
        with self.changed:
            if place >= self.turn:
                self.given_up.add(place)
                self._skip_given_up()

    def _skip_given_up(self) -> None:
        while self.turn in self.given_up:
            self.turn += 1
        self.changed.notify_all()


def past_loading(metrics: Path) -> bool:
    """Whether a rank's metric file holds a whole line besides `loading` beats: engines/reporter.py
    writes the beat when the rank starts, and a recipe's next line (an evaluation's beat, a step, its
    step count after a warm-up call) only once it has its model."""
    try:
        text = metrics.read_text()
    except OSError:
        return False
    whole_lines = text.split("\n")[:-1]  # the last piece is being written, or empty
    return any(line.strip() and json.loads(line).get(BEAT_KEY) != LOADING for line in whole_lines)


def rank_zero_metrics(home: Path, label: str) -> Path | None:
    """The metric file of rank 0 of the run labelled `label` in the history at `home`; None until the
    run is recorded (the CLI records it before it starts the supervisor)."""
    from gpuscale.control.store import Store, StoreError

    try:
        store = Store(home, read_only=True)
    except StoreError:  # the CLI is making the history's file: the run is not in it yet
        return None
    try:
        runs = store.list_runs(label=label, limit=1)
    finally:
        store.close()
    return RunDir(runs[0]["run_dir"]).metrics(0) if runs and runs[0].get("run_dir") else None


def wait_for_start_up(running: Callable[[], bool], home: Path, label: str,
                      limit: float = START_UP_LIMIT_S) -> float | None:
    """Seconds until the run labelled `label` is past its loading (`past_loading` of its rank 0); None
    where it stopped `running()` first or `limit` passed."""
    started, metrics = time.perf_counter(), None
    while running() and (waited := time.perf_counter() - started) < limit:
        metrics = metrics or rank_zero_metrics(home, label)
        if metrics is not None and past_loading(metrics):
            return waited
        time.sleep(START_UP_POLL_S)
    return None
