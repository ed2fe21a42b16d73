"""The energy a run's GPUs used, from NVML's cumulative energy counter read when the run starts and
when it ends (runs/telemetry.py's EnergyMeter), through a real supervisor on a fake pynvml whose
counter advances: joules per run, per GPU, per 1,000 tokens and per correct held-out answer, in the
summary that `gpuscale show`, `runs` and `export` print; absent, with why, without a counter."""

from __future__ import annotations

import json
import sys
import textwrap
import types

import pytest

from gpuscale.app import cli
from gpuscale.app.screens.history import history_row
from gpuscale.runs import telemetry
from gpuscale.runs.store import Store
from gpuscale.runs.supervisor import Supervisor

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
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=40_000 * MB, total=80_000 * MB)
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: []
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=93)
    nvml.nvmlDeviceGetPowerUsage = lambda handle: 300_000
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: 61
    nvml.nvmlDeviceGetClockInfo = lambda handle, clock: 1980
    nvml.nvmlDeviceGetTotalEnergyConsumption = energy
    return nvml


@pytest.fixture
def two_fake_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setattr(telemetry, "nvml_available", lambda: True)


# The launcher of the supervised run: one rank that logs 2,000 tokens in two steps and a summary with a
# final greedy accuracy of 0.5 on 4 held-out examples (2 correct answers).
RANK = textwrap.dedent("""
    from gpuscale.engines.reporter import Reporter
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

    assert cli.main(["show", str(run_id)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert "  energy_j: 4,000 J" in shown and "  energy_j_by_gpu: gpu0 1,500 J · gpu1 2,500 J" in shown
    assert "  energy_j_per_1k_tokens: 2,000 J" in shown and "  energy_j_per_correct_answer: 2,000 J" in shown
    assert cli.main(["runs"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(str(run_id))]
    assert "energy 4,000 J" in row  # the figures column of the table of runs
    assert cli.main(["export", str(run_id), "--what", "summary", "--format", "csv"]) == 0
    assert "energy_j,4000.0" in capsys.readouterr().out.splitlines()
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
