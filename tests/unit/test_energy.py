"""The energy a run's GPUs used, from NVML's cumulative energy counter read when the run starts and
when it ends (control/telemetry.py's EnergyMeter), through a real supervisor on a fake pynvml whose
counter advances: joules per run, per GPU, per 1,000 tokens and per correct held-out answer, in the
summary that `gpuscale show`, `runs` and `export` print; absent, with why, without a counter."""

from __future__ import annotations

import itertools
import json
import sys
import textwrap
import types

import psutil
import pytest

from gpuscale.app import cli
from gpuscale.app.screens.history import history_row
from gpuscale.control import telemetry
from gpuscale.control.store import Store
from gpuscale.control.supervisor import Supervisor
from gpuscale.runs import devices

MB = 1024 * 1024
START_MJ = {0: 7_000_000_000, 1: 9_000_000_000}  # the driver loaded long ago: large counters
STEP_MJ = {0: 1_500_000, 1: 2_500_000}  # each read of GPU i finds it STEP_MJ[i] further on


class NVMLError(Exception):
    pass


def fake_nvml(step_mj: dict[int, int] | None = None, energy_error: str | None = None) -> types.ModuleType:
    """What the supervisor asks of pynvml for two GPUs: the sampler's queries, and an energy counter
    that advances by `step_mj` at every read (or raises NVMLError(`energy_error`))."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = NVMLError
    nvml.NVML_TEMPERATURE_GPU, nvml.NVML_CLOCK_SM = 0, 1
    counters = dict(START_MJ)

    def energy(handle: int) -> int:
        if energy_error:
            raise NVMLError(energy_error)
        counters[handle] += (step_mj or STEP_MJ)[handle]
        return counters[handle]

    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 2
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=40_000 * MB, total=80_000 * MB)
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: []
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=93)
    nvml.nvmlDeviceGetPowerUsage = lambda handle: 300_000
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: 61
    nvml.nvmlDeviceGetClockInfo = lambda handle, clock: 1980
    nvml.nvmlDeviceGetTotalEnergyConsumption = energy
    ticks = itertools.count(1)
    # Every process of the machine ran kernels 40% of each tick's time (the run's rank among them).
    nvml.nvmlDeviceGetProcessUtilization = lambda handle, since: [
        types.SimpleNamespace(pid=pid, timeStamp=next(ticks), smUtil=40) for pid in psutil.pids()]
    return nvml


@pytest.fixture
def two_fake_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setattr(telemetry, "nvml_available", lambda: True)
    # devices' own check is cached for the process: patched here, so that neither the order of the tests
    # nor this fake decides what later tests see
    monkeypatch.setattr(devices, "nvml_available", lambda: True)


# The launcher of the supervised run: one rank that logs 2,000 tokens in two steps and a summary with a
# final greedy accuracy of 0.5 on 4 held-out examples (2 correct answers), after half a second.
RANK = textwrap.dedent("""
    import time
    from gpuscale.engines.reporter import Reporter
    time.sleep(0.5)  # a few of the supervisor's ticks while the rank lives
    reporter = Reporter(".", rank=0)
    reporter.log(step=1, tokens=1200, samples=2)
    reporter.log(step=2, tokens=800, samples=2)
    reporter.summary({"accuracy_greedy_after": 0.5, "eval_examples": 4, "train_tokens": 640})
    reporter.close()
""")


def test_a_supervised_run_on_two_gpus_ends_with_its_energy_figures(two_fake_gpus, home, capsys):
    store = Store(home)
    run_id = store.create_run("probe", {"telemetry_interval": 0.05}, [sys.executable, "-c", RANK], "host")
    run_dir = home / "runs" / str(run_id)
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"gpu_indices": [0, 1], "nproc": 1}))
    Supervisor(store, run_id).supervise()

    summary = store.get_run(run_id)["summary"]
    assert store.get_run(run_id)["status"] == "succeeded" and "energy_unavailable" not in summary
    # Read once at the start and once at the end: 1,500 J and 2,500 J, whatever the ticks in between.
    assert summary["energy_j_by_gpu"] == {"gpu0": 1500.0, "gpu1": 2500.0} and summary["energy_j"] == 4000.0
    assert summary["energy_j_per_1k_tokens"] == 2000.0  # 4,000 J over the 2,000 tokens the rank logged
    assert summary["energy_j_per_correct_answer"] == 2000.0  # 0.5 x 4 held-out examples = 2 correct
    # The card's time the run's own kernels took: 40% of each tick the rank lived, on each GPU.
    assert summary["gpu_busy_s"].keys() == {"gpu0", "gpu1"}
    assert all(0 < busy <= 0.4 * summary["duration_s"] + 0.05 for busy in summary["gpu_busy_s"].values())

    assert cli.main(["show", str(run_id)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert "  energy_j: 4,000 J" in shown and "  energy_j_by_gpu: gpu0 1,500 J · gpu1 2,500 J" in shown
    assert "  energy_j_per_1k_tokens: 2,000 J" in shown and "  energy_j_per_correct_answer: 2,000 J" in shown
    assert cli.main(["runs"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(str(run_id))]
    assert "energy 4,000 J" in row  # the figures column of the table of runs
    assert cli.main(["export", str(run_id), "--what", "summary", "--format", "csv"]) == 0
    assert "energy_j,4000.0," in capsys.readouterr().out.splitlines()  # name, value, note (none for it)
    # The TUI's history row is `gpuscale runs`' row; `compare` says which run used less.
    assert "energy 4,000 J" in history_row(store.get_run(run_id), now=0.0, marked=False)[4]
    other = store.create_run("probe", {"telemetry_interval": 0.05}, [], "host")
    store.finish_run(other, "succeeded", summary={**summary, "energy_j": 5000.0})
    assert cli.main(["compare", str(run_id), str(other)]) == 0
    assert "  energy_j: 4,000 J -> 5,000 J, +1,000 (+25.0%) worse" in capsys.readouterr().out.splitlines()


def test_the_figures_come_from_the_summary_where_the_ranks_logged_no_tokens():
    figures = telemetry.energy_figures({0: 900.0}, {"train_tokens": 300, "accuracy_greedy_after": 0.0,
                                                    "eval_examples": 10})
    assert figures == {"energy_j": 900.0, "energy_j_by_gpu": {"gpu0": 900.0}, "energy_j_per_1k_tokens": 3000.0}
    # No correct answer, no held-out set: no energy per correct answer rather than a division by zero.
    assert "energy_j_per_correct_answer" not in telemetry.energy_figures({0: 1.0}, {"accuracy_greedy_after": 0.5})


def test_a_sampling_run_counts_every_answer_it_scored_as_its_accuracy_does():
    """Power sampling's accuracy is the share right over problems x chains (pass@1): 0.25 of 8 x 4."""
    figures = telemetry.energy_figures({0: 800.0}, {"accuracy": 0.25, "problems": 8, "chains": 4})
    assert figures["energy_j_per_correct_answer"] == 800.0 / 8
    one_chain = telemetry.energy_figures({0: 800.0}, {"accuracy": 0.5, "problems": 8})
    assert one_chain["energy_j_per_correct_answer"] == 200.0


def test_a_counter_that_went_back_during_the_run_gives_no_figure(monkeypatch):
    """The driver reloaded during the run: the counter restarts near 0, and what it counted before is
    lost. No figure, and why, rather than a negative one."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(step_mj={0: 1_000, 1: -3_000_000_000}))
    monkeypatch.setattr(telemetry, "nvml_available", lambda: True)
    meter = telemetry.EnergyMeter.start([0, 1])
    assert meter.figures({"eval_examples": 4, "accuracy_greedy_after": 0.5}, logged_tokens=100.0) == {
        "energy_unavailable": "GPU 1's energy counter went back during the run "
                              "(6000000000 -> 3000000000 mJ: the driver reloaded?)"}


def test_a_gpu_without_the_counter_and_a_cpu_run_say_why_there_is_no_energy(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(energy_error="Not Supported"))
    monkeypatch.setattr(telemetry, "nvml_available", lambda: True)
    assert telemetry.EnergyMeter.start([0]).figures({}) == {
        "energy_unavailable": "GPU 0 gives no energy counter (NVML: Not Supported)"}
    assert telemetry.EnergyMeter.start([]).figures({}) == {"energy_unavailable": "no NVML GPU (CPU run)"}


# ---- a GPU shared with other runs: NVML's counter is the whole card's ------------------------------

# A rank that starts, then waits until the other ranks of its group have started (a file each in
# `together`), so that the runs of the group surely overlap; then it logs as RANK does.
RANK_TOGETHER = textwrap.dedent("""
    import pathlib, sys, time
    together, name, group = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    (together / name).touch()
    deadline = time.monotonic() + 30
    while len(list(together.iterdir())) < group and time.monotonic() < deadline:
        time.sleep(0.02)
""") + RANK


def supervised_runs(home, gpus_of_runs: list[list[int]]) -> list[int]:
    """One run per entry, on those GPUs, all supervised at once (a supervisor a thread, as many
    supervisors on one node are), their ranks alive together; their ids once all have ended."""
    import threading

    store = Store(home)
    together = home / f"together-{len(store.list_runs())}"
    together.mkdir(parents=True)
    ids = []
    for name, gpus in enumerate(gpus_of_runs):
        command = [sys.executable, "-c", RANK_TOGETHER, str(together), str(name), str(len(gpus_of_runs))]
        run_id = store.create_run("probe", {"telemetry_interval": 0.05}, command, "host")
        (home / "runs" / str(run_id) / "logs").mkdir(parents=True)
        (home / "runs" / str(run_id) / "plan.json").write_text(json.dumps({"gpu_indices": gpus, "nproc": 1}))
        ids.append(run_id)
    # A store a thread: a SQLite connection stays in the thread that opened it.
    threads = [threading.Thread(target=lambda run_id=run_id: Supervisor(Store(home), run_id).supervise())
               for run_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return ids


def test_runs_that_shared_a_gpu_say_so_and_have_no_energy_per_token(two_fake_gpus, home, capsys):
    """Three runs at once, two on GPU 0 and one on GPU 1, then one more on GPU 0 after them: the two
    on GPU 0 together name each other and keep energy_j, marked, without the figures per token and per
    answer (the other's work counts in both); the run on GPU 1 and the one after are not marked."""
    first, second, alone_on_gpu1 = supervised_runs(home, [[0], [0], [1]])
    (after,) = supervised_runs(home, [[0]])
    store = Store(home)
    runs = {run_id: store.get_run(run_id) for run_id in (first, second, alone_on_gpu1, after)}
    assert all(run["status"] == "succeeded" for run in runs.values())
    for run_id, other in ((first, second), (second, first)):
        summary = runs[run_id]["summary"]
        assert summary["energy_shared_with"] == [other]
        assert summary["energy_shared"] == (f"GPU 0 shared with run {other}: NVML counts the whole GPU, their work "
                                            "included: no energy per 1,000 tokens or per correct answer")
        assert summary["energy_j"] > 0 and "energy_unavailable" not in summary
        assert "energy_j_per_1k_tokens" not in summary and "energy_j_per_correct_answer" not in summary
    for run_id in (alone_on_gpu1, after):
        summary = runs[run_id]["summary"]
        assert "energy_shared" not in summary and "energy_shared_with" not in summary
        assert summary["energy_j_per_1k_tokens"] > 0 and summary["energy_j_per_correct_answer"] > 0

    capsys.readouterr()
    assert cli.main(["show", str(first)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert f"  energy_shared_with: {second}" in shown
    assert f"  energy_shared: GPU 0 shared with run {second}: NVML counts the whole GPU, their work included: " \
           "no energy per 1,000 tokens or per correct answer" in shown
    assert cli.main(["runs"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "J (GPU shared)" in rows[str(first)] and "J (GPU shared)" in rows[str(second)]
    assert "GPU shared" not in rows[str(alone_on_gpu1)] and "GPU shared" not in rows[str(after)]
    assert "J (GPU shared)" in history_row(runs[first], now=0.0, marked=False)[4]  # the TUI's history
    assert cli.main(["export", str(first), "--what", "summary", "--format", "csv"]) == 0
    exported = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"energy_shared_with,[{second}],") for line in exported), exported
    # compare: the shared run's energy is neither better nor worse than another's, and says why (a run
    # not shared that used 1,000 J more: otherwise `worse`).
    unshared = store.create_run("probe", {"telemetry_interval": 0.05}, [], "host")
    energy = runs[first]["summary"]["energy_j"]
    store.finish_run(unshared, "succeeded", summary={**runs[after]["summary"], "energy_j": energy + 1000.0})
    assert cli.main(["compare", str(first), str(unshared)]) == 0
    compared = capsys.readouterr().out.splitlines()
    (energy_line,) = [line for line in compared if line.startswith("  energy_j: ")]
    assert energy_line.endswith(f"+1,000 (+{100_000 / energy:.1f}%)")
    assert f"  run {first}'s energy counts other runs' work: {runs[first]['summary']['energy_shared']}" in compared


def test_the_history_finds_the_runs_on_the_same_gpus_of_the_same_host_while_a_run_lived(home):
    store = Store(home)

    def run(gpus, started, ended, host="node1"):
        run_id = store.create_run("probe", {}, [], host)
        (home / "runs" / str(run_id)).mkdir(parents=True)
        (home / "runs" / str(run_id) / "plan.json").write_text(json.dumps({"gpu_indices": gpus, "nproc": 1}))
        store.update_run(run_id, status="running", started_at=started)
        if ended is not None:
            store.finish_run(run_id, "succeeded", ended_at=ended)
        return run_id

    me = run([0, 1], 100.0, 200.0)
    on_gpu1 = run([1, 2], 150.0, 250.0)  # overlaps on GPU 1
    still_live = run([0], 190.0, None)  # started before the end, not ended yet
    before, later = run([0], 10.0, 99.0), run([0], 201.0, 300.0)  # one before, one after
    run([3], 120.0, 180.0), run([0], 120.0, 180.0, host="node2")  # another GPU; another node's GPU 0
    unknown = run([0], 120.0, 180.0)
    (home / "runs" / str(unknown) / "plan.json").unlink()  # a folder emptied by hand: its GPUs unknown
    assert store.runs_sharing_gpus(me, "node1", [0, 1], 100.0, 200.0) == {on_gpu1: [1], still_live: [0]}
    assert store.runs_sharing_gpus(before, "node1", [0], 10.0, 99.0) == {}
    assert store.runs_sharing_gpus(later, "node1", [0], 201.0, 300.0) == {still_live: [0]}
    assert store.runs_sharing_gpus(me, "node1", [], 100.0, 200.0) == {}  # a CPU run shares no GPU


def test_a_run_on_two_gpus_says_which_runs_shared_which_gpu_and_when_the_history_could_not_say():
    figures = telemetry.energy_figures({0: 900.0, 1: 100.0}, {"train_tokens": 300, "accuracy_greedy_after": 0.5,
                                                                "eval_examples": 10})
    assert telemetry.shared_gpu_figures(figures, {}) == figures  # no other run: every figure stays
    shared = telemetry.shared_gpu_figures(figures, {14: [1], 12: [0, 1]})
    assert shared == {"energy_j": 1000.0, "energy_j_by_gpu": {"gpu0": 900.0, "gpu1": 100.0},
                      "energy_shared_with": [12, 14],
                      "energy_shared": "GPU 0 shared with run 12; GPU 1 shared with runs 12, 14: NVML counts the "
                                       "whole GPU, their work included: no energy per 1,000 tokens or per correct "
                                       "answer"}
    unknown = telemetry.shared_gpu_figures(figures, None)
    assert "energy_j_per_1k_tokens" not in unknown and "energy_shared_with" not in unknown
    assert unknown["energy_shared"] == ("whether other runs shared the GPU is unknown (the history could not be "
                                        "read), and NVML counts the whole GPU: no energy per 1,000 tokens or per "
                                        "correct answer")
