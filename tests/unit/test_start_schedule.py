"""bench/start_schedule.py and the one-GPU acceptance's start order: longest first, the sharpening
control last, the GPU-marked tests at their place; the start gate's admissions (real threads); a rank's
start-up read from the metric file a real Reporter writes. The gate around real runs:
tests/integration/test_bench_scripts.py's acceptance test."""

from __future__ import annotations

import threading
import time

import pytest
from bench_loader import load_bench

from gpuscale.data.step_phases import EVALUATE
from gpuscale.engines.reporter import Reporter


@pytest.fixture(scope="module")
def schedule():
    return load_bench("start_schedule.py")


@pytest.fixture(scope="module")
def acceptance():
    return load_bench("acceptance.py")


def test_the_longest_start_first_and_the_entries_named_last_stay_last(schedule):
    walls = {"short": 50, "long": 500, "middle": 200, "after all": 900}
    entries = [("short", 0), ("long", 0), ("after all", 0), ("middle", 0), ("long", 1), ("unknown", 0)]
    ordered = schedule.start_order(entries, lambda label: walls.get(label, 0),
                                   last=lambda label: label == "after all")
    # Equal walls keep their order (a label's seeds); a label without a wall goes before the last only.
    assert ordered == [("long", 0), ("long", 1), ("middle", 0), ("short", 0), ("unknown", 0), ("after all", 0)]


def test_the_slots_are_the_cores_over_two_threads_a_starting_rank(schedule):
    assert schedule.start_slots(16, 1) == 8  # the H200 machine of the one-GPU check
    assert schedule.start_slots(64, 4) == 8
    assert schedule.start_slots(2, 2) == 1 and schedule.start_slots(1, 1) == 1  # never none


def test_the_one_gpu_check_starts_its_longest_runs_first_and_the_control_after_its_validation_runs(acceptance):
    jobs = acceptance.job_list([0, 1, 2], None, {})
    plan = acceptance.Schedule.of(jobs, slots=8, with_tests=True)
    labels = [label for _, (label, *_) in plan.jobs]
    places = [place for place, _ in plan.jobs]
    assert sorted(places + [plan.tests_place]) == list(range(len(jobs) + 1))  # every place once
    walls = [acceptance.expected_wall(label) for label in labels if label != acceptance.CONTROL]
    assert walls == sorted(walls, reverse=True)
    assert labels[:3] == ["grpo-mtl pcgrad"] * 3 and [seed for _, (*_, seed) in plan.jobs[:3]] == [0, 1, 2]
    assert labels[-3:] == [acceptance.CONTROL] * 3  # they wait for the validation runs, all placed before
    # The tests (317 s beside the runs) after the training runs, before the power-sampling runs (226 s).
    assert labels[plan.tests_place - 1] == "eggroll" and labels[plan.tests_place] == acceptance.POWER
    assert plan.gate.slots == 8
    # Runs of several GPUs one seed's a wave (default_jobs): job_list's order and no gate.
    waves = acceptance.Schedule.of(jobs, slots=None, with_tests=True)
    assert [job for _, job in waves.jobs] == jobs and waves.gate is None


def test_the_gate_admits_runs_in_their_places_order_and_no_more_at_once_than_its_slots(schedule):
    gate, admitted, starting, most = schedule.StartGate(2), [], [], [0]
    leave = {place: threading.Event() for place in range(5)}
    lock = threading.Lock()

    def run(place: int) -> None:
        if place == 3:  # a job that does not start: the places after it must not wait for it
            gate.give_up(place)
            return
        with gate.start_up(place):
            with lock:
                admitted.append(place), starting.append(place)
                most[0] = max(most[0], len(starting))
            leave[place].wait(5)
            with lock:
                starting.remove(place)

    threads = [threading.Thread(target=run, args=(place,)) for place in (4, 2, 3, 1, 0)]  # any start order
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while len(admitted) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert admitted == [0, 1]  # two slots: place 2 waits for one of them
    leave[1].set()
    for place in (0, 2, 4):
        leave[place].set()
    for thread in threads:
        thread.join(5)
    assert admitted == [0, 1, 2, 4] and most[0] == 2
    gate.give_up(0)  # an admitted place given up changes nothing
    assert gate.turn == 5


def test_a_rank_is_past_its_loading_once_it_writes_a_whole_line_besides_its_loading_beat(schedule, tmp_path):
    reporter = Reporter(tmp_path, rank=0)  # writes the `loading` beat as a rank does when it starts
    metrics = tmp_path / "metrics" / "rank0.jsonl"
    assert metrics.read_text().count("\n") == 1 and not schedule.past_loading(metrics)
    assert not schedule.past_loading(tmp_path / "metrics" / "rank1.jsonl")  # not written yet
    with open(metrics, "a") as handle:  # a line being written, not yet whole
        handle.write('{"t": 1.0, "rank": 0, "step": 1')
    assert not schedule.past_loading(metrics)
    metrics.write_text(metrics.read_text().rsplit("\n", 1)[0] + "\n")
    reporter.beat(EVALUATE)  # the model is loaded: its first evaluation begins
    reporter.close()
    assert schedule.past_loading(metrics)


def test_the_start_up_is_not_waited_for_once_the_run_has_ended(schedule, tmp_path):
    started = time.perf_counter()
    assert schedule.wait_for_start_up(lambda: False, tmp_path, "no-such-run") is None
    assert time.perf_counter() - started < schedule.START_UP_POLL_S
    assert schedule.rank_zero_metrics(tmp_path, "no-such-run") is None  # no history yet: no run
