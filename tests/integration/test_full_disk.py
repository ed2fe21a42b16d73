"""A full disk under GPUSCALE_HOME, on a real small file system (a tmpfs mounted for the test): a run
refused before anything is recorded where the room is known to be short, a run that fills the disk
ends `failed` saying so, and `gpuscale doctor` names a full disk as one. Never a traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import gpuscale, leftover_processes, run_json, spawn_gpuscale, wait_for_metrics, wait_until
from gpuscale.control import disk_space
from gpuscale.control.store import Store

PROBE = ["--recipe", "probe", "--set", "prompt_tokens=8", "--batch-size", "2"]


@pytest.fixture
def small_file_system(tmp_path):
    """Mount a tmpfs of the size asked for (in MB) under the test's folder; unmounted at the end, after
    whatever a run left there is gone. Mounting needs root: skipped without it."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for the full-disk tests needs root and mount(8)")
    mounted = []

    def mount(size_mb: int) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    folders = [folder for where in mounted for folder in (where / "home" / "runs").glob("*")]
    wait_until(lambda: not any(leftover_processes(str(folder)) for folder in folders), 30,
               message="the runs' processes to go")
    for where in mounted:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


def fill(where: Path) -> Path:
    """Write zeros until the file system refuses one more byte: a real full disk, not a mock."""
    filler = where / "filler"
    chunk = 2**20
    with open(filler, "wb", buffering=0) as file:
        while chunk:
            try:
                file.write(b"\0" * chunk)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
                chunk //= 2
    assert shutil.disk_usage(where).free == 0
    return filler


def assert_names_the_full_disk(line: str, where: Path) -> None:
    assert line.startswith(f"GPUSCALE_HOME {where / 'home'}: its file system (tmpfs on {where}) has "), line
    assert "free of " in line and "a run needs at least 64.0 MB there (GPUSCALE_MIN_FREE_MB)" in line, line


@pytest.mark.parametrize("filled", [False, True], ids=["too-small", "filled"])
def test_a_run_is_refused_before_anything_is_recorded(small_file_system, monkeypatch, filled):
    where = small_file_system(8)  # under the 64 MB a run needs
    monkeypatch.setenv("GPUSCALE_HOME", str(where / "home"))
    if filled:
        Store(where / "home").close()  # a history made while there was room
        fill(where)
    for _attempt in range(2):  # the second attempt too: a refused one leaves nothing to trip on
        result = gpuscale("run", *PROBE, "--set", "steps=4", "--gpus", "1")
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpuscale: error: "), result.stderr
        assert_names_the_full_disk(lines[0].removeprefix("gpuscale: error: "), where)
        free = "0 B" if filled else "8.0 MB"
        assert f"has {free} free of 8.0 MB" in lines[0]
    assert run_json("runs") == []
    assert not list((where / "home" / "runs").glob("*"))
    doctor = gpuscale("doctor")
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr + doctor.stdout
    problems = [line for line in doctor.stdout.splitlines() if line.startswith("PROBLEM")]
    assert problems[0].startswith("PROBLEM  disk full: GPUSCALE_HOME "), doctor.stdout
    assert "owner and mode" not in doctor.stdout


def test_the_minimum_is_a_setting_and_a_bad_one_is_refused(small_file_system, monkeypatch):
    where = small_file_system(8)
    monkeypatch.setenv("GPUSCALE_HOME", str(where / "home"))
    monkeypatch.setenv("GPUSCALE_MIN_FREE_MB", "lots")
    bad = gpuscale("run", *PROBE, "--set", "steps=4", "--gpus", "1")
    assert (bad.returncode, bad.stderr) == (
        2, "gpuscale: error: GPUSCALE_MIN_FREE_MB: 'lots': expected a whole number of MB (0 turns the check off)\n")
    monkeypatch.setenv("GPUSCALE_MIN_FREE_MB", "4")  # 8 MB is room enough for the probe's 4 steps
    ran = run_json("run", *PROBE, "--set", "steps=4", "--gpus", "1")
    assert ran["status"] == "succeeded"


@pytest.mark.e2e
def test_a_run_that_fills_the_disk_ends_failed_saying_so(small_file_system, monkeypatch):
    where = small_file_system(80)  # room to start (64 MB), little to spare
    monkeypatch.setenv("GPUSCALE_HOME", str(where / "home"))
    front = spawn_gpuscale("run", *PROBE, "--set", "steps=100000", "--set", "telemetry_interval=0.2",
                           "--gpus", "1", "--json")  # one rank: the disk fills under the run, whatever its ranks
    store = Store(where / "home")
    run_id = wait_until(lambda: [run["id"] for run in store.list_runs()], message="the run's row")[0]
    wait_for_metrics(where / "home", run_id)
    fill(where)
    out, err = front.communicate(timeout=180)
    assert front.returncode == 1 and "Traceback" not in err, err
    run = json.loads(out)
    assert run["status"] == "failed", run
    assert_names_the_full_disk(run["error"], where)
    assert run["hint"].startswith("the disk filled during the run; ")
    assert run["summary"]["partial"] and run["summary"]["steps_done"] > 0  # what it did is kept
    # The run's folder holds the same end (the supervisor freed the room it kept to write it).
    ended = json.loads((Path(run["run_dir"]) / "run.json").read_text())["ended"]
    assert (ended["status"], ended["error"]) == ("failed", run["error"])
    assert not (Path(run["run_dir"]) / ".room-reserve").exists()
    listed = gpuscale("runs")
    assert listed.returncode == 0 and f"{run_id}   probe   failed" in listed.stdout, listed.stdout
    doctor = gpuscale("doctor")
    assert "PROBLEM  disk full: GPUSCALE_HOME " in doctor.stdout and "Traceback" not in doctor.stderr


def test_size_text_reads_as_df_does():
    assert [disk_space.size_text(n) for n in (0, 1023, 1024, 1536, 64 * 2**20, 150 * 2**30)] == [
        "0 B", "1023 B", "1.0 KB", "1.5 KB", "64.0 MB", "150 GB"]
