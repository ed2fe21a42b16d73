"""The run's log says how many OpenMP threads its ranks got, and why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import run_json

pytestmark = pytest.mark.e2e  # every test here starts real runs

FAST = ["--recipe", "probe", "--set", "steps=2", "--set", "prompt_tokens=4", "--batch-size", "1", "--gpus", "2"]


def test_the_supervisor_log_names_the_threads_per_rank(home, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")  # the default rule, not the test's own setting
    run = run_json("run", *FAST)
    assert run["status"] == "succeeded"
    log = (Path(run["run_dir"]) / "logs" / "supervisor.log").read_text()
    line = re.search(r"OMP_NUM_THREADS=(\d+) per rank \((\d+) cores, ([\d.]+) busy, (\d+) free, 2 rank\(s\)", log)
    assert line, log
    threads, free = int(line[1]), int(line[4])
    assert threads == max(1, free // 2)

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = run_json("run", *FAST)
    log = (Path(run["run_dir"]) / "logs" / "supervisor.log").read_text()
    assert "OMP_NUM_THREADS=1 per rank (set by the user)" in log
