"""Paths typed relative to where the user stands (README's examples are relative) reach the ranks,
which start in the run folder: dataset, model and GPUSCALE_HOME are made absolute when the settings
are written. And a rank that fails gives the run its own error line, never the launcher's
`ChildFailedError:`. Real CLI, supervisor and torchrun ranks on gloo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import run_json, wait_until
from gpuscale.data.models import model_path
from gpuscale.data.tasks import load_examples
from gpuscale.runs.statuses import LIVE_STATUSES

pytestmark = pytest.mark.e2e  # every test here starts real runs

# One rank: every rank reads its settings alike, and what one refuses is its own error line.
TINY_POWER = ["--recipe", "power-sampling", "--gpus", "1", "--set", "max_examples=2", "--set", "max_new_tokens=4",
              "--set", "blocks=1", "--set", "mcmc_steps=1"]


def write_problems(path, count: int = 4):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = load_examples("tiny-math", "test", count)
    path.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rows))
    return path


def cli_in(cwd, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuscale.app.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=240, env={**os.environ, **(env or {})})


def test_relative_dataset_model_and_home_reach_the_ranks(home, tmp_path):
    """Paths relative to where the user stands: `--dataset data/one.jsonl`, `--model ../m`,
    GPUSCALE_HOME=relhome, from a folder of the user's; before, the run started and failed 7 s later
    with ChildFailedError."""
    work = tmp_path / "work"
    write_problems(work / "data" / "one.jsonl")
    shutil.copytree(model_path(), tmp_path / "m")
    result = cli_in(work, "run", *TINY_POWER, "--dataset", "data/one.jsonl", "--model", "../m", "--json",
                    env={"GPUSCALE_HOME": "relhome"})
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout)
    assert run["status"] == "succeeded" and run["error"] is None
    assert run["summary"]["problems"] == 2
    settings = json.loads((work / "relhome" / "runs" / str(run["id"]) / "settings.json").read_text())
    assert settings["dataset"] == str(work.resolve() / "data" / "one.jsonl")
    assert settings["model"] == str(tmp_path.resolve() / "m")  # normalised: not WORK/../m
    assert run["run_dir"] == str(work / "relhome" / "runs" / str(run["id"]))


def test_a_file_gone_after_the_launch_is_the_ranks_own_error_line(home, tmp_path):
    """The rank validates its settings again; what it refuses is written to errors/rank<R>.json as
    one line (before, the rank died before it could, and the run said `ChildFailedError:`)."""
    data = write_problems(tmp_path / "problems.jsonl")
    started = run_json("run", *TINY_POWER, "--dataset", str(data), "--detach")
    data.unlink()  # the ranks take seconds to import torch before they read their settings
    run = wait_until(lambda: (r := run_json("show", str(started["id"])))["status"] not in LIVE_STATUSES and r,
                     120, message="the run to end")
    assert run["status"] == "failed"
    assert run["error"].startswith("rank ")
    assert run["error"].endswith(f"settings.json: dataset: '{data}': no such file: {data}")
    assert "ChildFailedError" not in run["error"]
