"""The GPU sample fields, declared once (gpuscale/control/sample_fields.py): a field added there reaches the
sampler, the store's columns and the monitor's device rows by its name; a history made before it opens
with nothing lost; a bad declaration says which field and why."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import types
from pathlib import Path

import pytest

from gpuscale.app.views import feed as feeds
from gpuscale.control import sample_fields, telemetry
from gpuscale.control.sample_fields import SampleField
from gpuscale.control.store import SCHEMA_VERSION, Store

NOW = 1_000_000.0
OLD_SCHEMA = Path(__file__).parent / "data" / "runs_db_v4.sql"
# A field added in-test, as a newcomer would add one (not fan_pct, ARCHITECTURE.md's example: adding that
# for real must leave these tests passing).
ENCODER = SampleField("encoder_pct", float, "encoder", "%", shown="detail", text="enc {:3.0f}%")
MB = 1024 * 1024


class NVMLError(Exception):
    pass


def fake_nvml(encoder: float = 55.0) -> types.ModuleType:
    """What GpuSampler asks of pynvml, for one H100 that reports neither power (as some boards do) nor a fan
    (a passively cooled card)."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_TEMPERATURE_GPU, nvml.NVML_CLOCK_SM = 0, 1

    def no_power(handle):
        raise NVMLError("Not Supported")

    nvml.nvmlDeviceGetHandleByIndex = lambda index: f"handle{index}"
    nvml.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=40_000 * MB, total=80_000 * MB)
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [types.SimpleNamespace(pid=os.getpid(),
                                                                                       usedGpuMemory=30_000 * MB)]
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=93)
    nvml.nvmlDeviceGetPowerUsage = no_power
    nvml.nvmlDeviceGetTemperature = lambda handle, sensor: 61
    nvml.nvmlDeviceGetClockInfo = lambda handle, clock: 1980 if clock == nvml.NVML_CLOCK_SM else 0
    nvml.nvmlDeviceGetFanSpeed = no_power
    nvml.nvmlDeviceGetEncoderUtilization = lambda handle: [encoder, 167_000]  # percent, sampling period in us
    return nvml


@pytest.fixture
def with_encoder(monkeypatch):
    """`encoder_pct` declared, and read from NVML: the two lines a newcomer writes for a new field."""
    monkeypatch.setattr(sample_fields, "SAMPLE_FIELDS", (*sample_fields.SAMPLE_FIELDS, ENCODER))
    monkeypatch.setitem(telemetry.NVML_READS, "encoder_pct",
                        lambda nvml, handle: nvml.nvmlDeviceGetEncoderUtilization(handle)[0])


def device_view(store: Store, run_id: int) -> feeds.DeviceView:
    feed = feeds.RunFeed(run_id)
    feed.poll(store, NOW)
    (view,) = feeds.device_views(feed, NOW, window_s=60)
    return view


def test_a_declared_field_flows_from_the_sampler_to_the_store_and_the_device_row(with_encoder, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    (row,) = telemetry.GpuSampler(run_id=1, indices=[0], root_pid=os.getpid()).sample(now=NOW - 0.5)
    assert row["encoder_pct"] == 55.0 and row["sm_clock_mhz"] == 1980 and row["power_w"] is None
    assert row["run_mem_mb"] == 30_000.0

    store = Store(tmp_path)
    assert "encoder_pct" in store.db["samples"].columns_dict  # created from the declaration
    run_id = store.create_run("probe", {}, [], "host")
    store.add_rows([], [{**row, "run_id": run_id}])
    assert store.samples(run_id)[0]["encoder_pct"] == 55.0
    (bucket,) = store.sample_buckets(run_id, 1.0, store.last_rowids()[0], since=0.0)
    assert bucket["encoder_pct"] == 55.0 and bucket["sm_clock_mhz"] == 1980.0  # by name, not by place

    view = device_view(store, run_id)
    assert view.values["encoder_pct"] == 55.0
    assert view.detail_text == " 93%  61°C enc  55%"  # no power on this board: left out, not "None W"
    assert view.wide_text == "1980 MHz"
    assert view.fields_text == "utilization 93 % · temperature 61 °C · SM clock 1980 MHz · encoder 55 %"


def test_every_declared_field_is_measured_by_the_gpu_sampler():
    """A field declared without a way to read it would be a column that stays empty."""
    assert (set(telemetry.NVML_READS) | set(telemetry.MEMORY_FIELDS) | {telemetry.RUN_UTILIZATION_FIELD}
            == set(sample_fields.field_names()))


def test_the_run_s_own_utilization_is_its_processes_share_of_the_card_since_the_last_tick(monkeypatch, tmp_path):
    """NVML's per-process samples newer than the last read: the run's processes' mean SM utilization (another
    process's left out), shown beside the card's in a wide device row; no new sample is 0 (nothing of the run
    ran); a card that cannot say gives None."""
    nvml = fake_nvml()
    me, other = os.getpid(), os.getpid() + 1_000_000  # `other`: a process outside the run's tree
    answers = [[types.SimpleNamespace(pid=me, timeStamp=10, smUtil=30), types.SimpleNamespace(pid=other, timeStamp=10,
                                                                                               smUtil=60),
                types.SimpleNamespace(pid=me, timeStamp=20, smUtil=50)],
               NVMLError("Not Found"), NVMLError("Not Supported")]
    asked_since = []

    def process_utilization(handle, since):
        asked_since.append(since)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    nvml.nvmlDeviceGetProcessUtilization = process_utilization
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    sampler = telemetry.GpuSampler(run_id=1, indices=[0], root_pid=me)
    rows = [sampler.sample(now=NOW - 3 + tick)[0] for tick in range(3)]
    assert [row["run_util"] for row in rows] == [40.0, 0.0, None]
    assert asked_since == [0, 20, 20]  # each read from the newest sample seen

    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [], "host")
    store.add_rows([], [{**rows[0], "run_id": run_id}])
    assert device_view(store, run_id).wide_text == "1980 MHz own  40%"


def test_a_run_that_reaches_the_card_through_mps_has_its_memory_and_no_utilization_figure(monkeypatch):
    """Through MPS, NVML lists the run's processes as MPS clients (their memory still theirs) and credits their
    kernels to the MPS server: the run's own utilization is unknown (None), not 0."""
    nvml = fake_nvml()
    server = os.getpid() + 1_000_000
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [types.SimpleNamespace(pid=server,
                                                                                       usedGpuMemory=500 * MB)]
    nvml.nvmlDeviceGetMPSComputeRunningProcesses = lambda handle: [
        types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=7_000 * MB)]
    nvml.nvmlDeviceGetProcessUtilization = lambda handle, since: [
        types.SimpleNamespace(pid=server, timeStamp=10, smUtil=80)]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    (row,) = telemetry.GpuSampler(run_id=1, indices=[0], root_pid=os.getpid()).sample(now=NOW)
    assert row["run_mem_mb"] == 7_000.0 and row["run_util"] is None


def test_a_run_listed_beside_an_mps_server_has_no_utilization_figure(monkeypatch, tmp_path):
    """Drivers that list MPS clients among the card's processes, beside the server (a real process of the server's
    name here, beside a real process as the run), rather than as MPS processes: the run's utilization is unknown."""
    server_binary = tmp_path / "nvidia-cuda-mps-server"
    shutil.copy(shutil.which("sleep"), server_binary)
    run, server = (subprocess.Popen([binary, "60"]) for binary in (shutil.which("sleep"), server_binary))
    try:
        nvml = fake_nvml()
        nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [
            types.SimpleNamespace(pid=server.pid, usedGpuMemory=500 * MB),
            types.SimpleNamespace(pid=run.pid, usedGpuMemory=7_000 * MB)]
        nvml.nvmlDeviceGetMPSComputeRunningProcesses = lambda handle: []
        nvml.nvmlDeviceGetProcessUtilization = lambda handle, since: [
            types.SimpleNamespace(pid=server.pid, timeStamp=10, smUtil=80)]
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        (row,) = telemetry.GpuSampler(run_id=1, indices=[0], root_pid=run.pid).sample(now=NOW)
        assert row["run_mem_mb"] == 7_000.0 and row["run_util"] is None
    finally:
        for process in (run, server):
            process.kill()
            process.wait()


def old_history(home: Path) -> int:
    """A runs.db made by the schema before the declaration, holding one run and one GPU sample."""
    home.mkdir()
    conn = sqlite3.connect(home / "runs.db")
    conn.executescript(OLD_SCHEMA.read_text())
    conn.execute("INSERT INTO runs (id, recipe, status, settings, summary, created_at, command, host) "
                 "VALUES (7, 'probe', 'succeeded', '{}', '{}', 1.0, '[]', 'host')")
    conn.execute("INSERT INTO samples VALUES (7, ?, 'gpu', 0, 'NVIDIA H100 80GB HBM3', 40000.0, 80000.0, 93.0, "
                 "300.0, 61.0, 1755.0, 30000.0)", [NOW - 3.5])
    conn.commit()
    conn.close()
    return 7


def test_a_history_made_before_the_declaration_opens_with_nothing_lost(with_encoder, tmp_path):
    run_id = old_history(tmp_path / "home")
    # Read-only first (a shared copy of someone's runs): no column can be added, the new field reads None.
    reader = Store(tmp_path / "home", read_only=True)
    (bucket,) = reader.sample_buckets(run_id, 1.0, reader.last_rowids()[0], since=0.0)
    assert bucket["encoder_pct"] is None and bucket["sm_clock_mhz"] == 1755.0
    reader.close()

    store = Store(tmp_path / "home")
    assert "encoder_pct" in store.db["samples"].columns_dict
    assert store.db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    (old,) = store.samples(run_id)
    assert old["encoder_pct"] is None and (old["util"], old["power_w"], old["sm_clock_mhz"]) == (93.0, 300.0, 1755.0)
    assert store.get_run(run_id)["status"] == "succeeded"
    view = device_view(store, run_id)
    assert view.detail_text == " 93%  300 W  61°C" and view.wide_text == "1755 MHz"

    store.add_rows([], [{"run_id": run_id, "t": NOW - 1.5, "kind": "gpu", "idx": 0, "name": "NVIDIA H100 80GB HBM3",
                         "mem_total_mb": 80_000.0, "encoder_pct": 40.0}])
    assert [s["encoder_pct"] for s in store.samples(run_id)] == [None, 40.0]
    store.close()
    assert Store(tmp_path / "home").samples(run_id)[0]["sm_clock_mhz"] == 1755.0  # a second open adds nothing


@pytest.mark.parametrize("changes, message", [
    ({"name": "fan pct"}, "sample field 'fan pct': name = 'fan pct': must be a lower-case identifier"),
    ({"sql_type": bytes}, "sample field 'fan_pct': sql_type = <class 'bytes'>: must be one of float, int, str"),
    ({"bucket": "sum"}, "sample field 'fan_pct': bucket = 'sum': must be one of avg, max"),
    ({"shown": "row"}, "sample field 'fan_pct': shown = 'row': must be one of 'memory', 'detail', 'wide', ''"),
    ({"text": ""}, "sample field 'fan_pct': text = '': must be a format where it is shown"),
])
def test_a_bad_declaration_names_the_field_the_value_and_the_reason(changes, message):
    declared = {"name": "fan_pct", "sql_type": float, "label": "fan", "unit": "%", "shown": "detail",
                "text": "{:3.0f}%", **changes}
    with pytest.raises(ValueError) as caught:
        SampleField(**declared)
    assert str(caught.value) == message
