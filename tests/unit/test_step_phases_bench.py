"""bench/step_phases.py's reading of one alternating run (GPUSCALE_STEP_PHASES=alternate:K): which logged
steps are timed, their intervals, and on / off from them, on hand-made metric records."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_loader import load_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_bench("step_phases.py")


def records(step_ends: list[float]) -> list[dict]:
    """A rank's metric lines: a heartbeat, the total, then a logged step ending at each time, every other
    one with its phase figures in a line of its own (as the Reporter writes a step not ready at its log)."""
    lines = [{"t": 0.0, "rank": 0, "step": 0, "beat": "loading"}, {"t": 0.0, "rank": 0, "step": 0, "total": 7}]
    for step, end in enumerate(step_ends, start=1):
        lines.append({"t": end, "rank": 0, "step": step, "loss": 1.0})
        lines.append({"t": end + 0.01, "rank": 0, "step": step, "phase_seconds_data": 0.1})
    return lines


def test_intervals_are_between_logged_steps_and_leave_out_the_warm_up(bench):
    lines = records([10.0, 11.0, 12.5, 13.5, 15.0])
    assert bench.step_intervals(lines, warm_up=1) == [(3, 1.5), (4, 1.0), (5, 1.5)]
    assert bench.step_intervals(lines, warm_up=0)[0] == (2, 1.0)
    assert bench.logged_step_seconds(lines, warm_up=1) == 1.5


def test_on_over_off_compares_the_timed_steps_with_the_untimed_ones(bench):
    # alternate:1: odd steps timed. Timed steps take 1.1 s, untimed 1.0 s: on / off 1.1.
    intervals = [(2, 1.0), (3, 1.1), (4, 1.0), (5, 1.1), (6, 1.0), (7, 1.1)]
    assert bench.within_run(intervals, 1) == pytest.approx(1.1)
    # alternate:2: steps 1-2 and 5-6 timed, 3-4 and 7-8 not.
    intervals = [(2, 2.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0), (7, 1.0), (8, 1.0)]
    assert bench.within_run(intervals, 2) == pytest.approx(2.0)
    assert bench.within_run([(3, 1.0), (5, 1.0)], 1) is None  # no untimed step: no figure
