"""Tuning through the real CLI on CPU: `gpuscale tune` runs real trials on the embedded model and
stores its choice; `--batch-size auto` in a real run takes a stored result (and says so in the run's
settings), or the CPU default; a bad batch_size is still refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import gpuscale, run_together
from gpuscale.app import cli
from gpuscale.control.store import Store

REPO = Path(__file__).resolve().parents[2]
TINY_POWER = ["--set", "max_new_tokens=8", "--set", "blocks=2", "--set", "mcmc_steps=1"]


@pytest.mark.e2e
def test_tune_power_sampling_on_cpu_runs_real_trials_and_stores_the_choice(home, capsys, one_torch_thread):
    """`gpuscale tune` in this process (`cli.main`, as test_tune_recipes.py runs the other recipes'): the
    same trials without a second torch import."""
    code = cli.main(["tune", "--recipe", "power-sampling", "--max-batch", "4", *TINY_POWER])
    result = capsys.readouterr()
    assert code == 0, result.err
    progress = [line for line in result.err.splitlines() if line.startswith("trial ")]
    assert progress[0].startswith("trial 1: batch 1: ") and "problems_per_s" in progress[0]
    table = result.out.splitlines()
    assert table[0].split()[:2] == ["BATCH", "PROBLEMS_PER_S"]
    assert len(progress) == len([line for line in table[1:] if line.split()[0].isdigit()])
    [stored] = Store(home).list_tunings("power-sampling")
    assert stored["device"] == "cpu" and stored["precision"] == "fp32" and stored["model"] == "tiny-math"
    assert json.loads(stored["shape"])["max_new_tokens"] == 8
    assert stored["batch_size"] in (1, 2, 3, 4) and stored["throughput"] > 0
    assert stored["peak_memory_bytes"] > 50 * 2**20  # the process holds the model: tens of MB at least
    assert len(stored["trials"]) == len(progress)
    assert f"chosen: batch {stored['batch_size']}," in result.out


TUNED_AT = 1_795_000_000.0
TUNED_DAY = time.strftime("%Y-%m-%d", time.localtime(TUNED_AT))


def save_probe_tuning(home, batch_size: int, prompt_tokens: int = 4) -> None:
    key = {"recipe": "probe", "model": "tiny-math", "device": "cpu", "precision": "fp32",
           "shape": json.dumps({"prompt_tokens": prompt_tokens})}
    Store(home).save_tuning(key, batch_size=batch_size, throughput=1.0, figure="tokens_per_s", trials=[],
                            created_at=TUNED_AT)


@pytest.fixture(scope="module")
def auto_runs(module_home) -> dict:
    """The two probe runs with batch_size auto below, started together (each keeps one core busy), each
    in a home of its own: "stored" holds a tuning of the run's shape (batch 3), "other shape" one of
    prompt_tokens=16 only. Each entry: the home and the run's outcome."""
    homes = {"stored": module_home / "stored", "other shape": module_home / "other-shape"}
    save_probe_tuning(homes["stored"], batch_size=3)
    save_probe_tuning(homes["other shape"], batch_size=3, prompt_tokens=16)  # another shape: not the run's key
    ended = run_together(["--recipe", "probe", "--gpus", "1", "--batch-size", "auto", "--set", "steps=2",
                          "--set", "prompt_tokens=4"],
                         ["--recipe", "probe", "--gpus", "1", "--set", "batch_size=auto", "--set", "steps=2",
                          "--set", "prompt_tokens=4"],
                         envs=[{"GPUSCALE_HOME": str(home)} for home in homes.values()])
    return {name: (home, result) for (name, home), result in zip(homes.items(), ended)}


def succeeded_run(outcome: subprocess.CompletedProcess) -> dict:
    assert outcome.returncode == 0, outcome.stderr
    return json.loads(outcome.stdout)


@pytest.mark.e2e
def test_auto_in_a_real_run_uses_the_stored_result_and_records_it(auto_runs):
    home, outcome = auto_runs["stored"]
    run = succeeded_run(outcome)
    assert run["status"] == "succeeded"
    assert run["settings"]["batch_size"] == 3
    assert run["settings"]["batch_size_source"] == f"stored (tuned {TUNED_DAY})"
    rank_settings = json.loads((home / "runs" / str(run["id"]) / "settings.json").read_text())
    assert rank_settings["batch_size"] == 3  # what the rank ran with


@pytest.mark.e2e
def test_auto_on_cpu_with_nothing_stored_is_the_cpu_default(auto_runs):
    run = succeeded_run(auto_runs["other shape"][1])
    assert run["status"] == "succeeded"
    assert (run["settings"]["batch_size"], run["settings"]["batch_size_source"]) == (8, "default")


@pytest.mark.parametrize("value, reason", [("0", "greater than or equal to 1"), ("lots", "valid integer")])
def test_a_bad_batch_size_is_still_refused(home, value, reason):
    result = gpuscale("run", "--recipe", "probe", "--batch-size", value)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"gpuscale: error: batch_size: {value!r}: "
                                                  + result.stderr.split(f"{value!r}: ", 1)[1].strip()]
    assert reason in result.stderr
    assert not home.exists()


def test_tune_refuses_a_bad_memory_cap(home):
    result = gpuscale("tune", "--recipe", "probe", "--memory-cap", "1.5")
    assert result.returncode == 2 and "memory-cap: 1.5:" in result.stderr


@pytest.mark.e2e
def test_the_bench_script_runs_on_cpu_with_tiny_sizes(tmp_path, home):
    out = tmp_path / "tune.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "tune.py"), "--recipe", "probe", "--max-batch", "4",
                             "--sweep-items", "8", "--set", "steps=2", "--set", "prompt_tokens=4", "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())["figures"]  # bench/record.py's schema
    assert [row["batch_size"] for row in report["sweep"]] == [1, 2, 3, 4]
    assert report["tuned_batch"] in (1, 2, 3, 4) and report["device"] == "cpu"
    assert 0 < report["tuned_vs_best"] <= 1.0 + 1e-9 or report["tuned_batch"] != report["sweep_best_batch"]
    assert report["tune_seconds"] > 0 and report["sweep_seconds"] > 0
