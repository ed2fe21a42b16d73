"""SLURM preemption on CPU ranks (`gpuscale sbatch --requeue`'s job, by hand): a made-up SLURM job
environment, SIGUSR1 sent to `gpuscale run --slurm-requeue` as srun passes on SLURM's signal. The run
writes a checkpoint on it and ends `preempted`; the requeued job (same SLURM_JOB_ID,
SLURM_RESTART_COUNT=1) continues it from that checkpoint, as `gpuscale resume` would, and ends with
the weights of a run left alone. A recipe that writes no checkpoint ends `preempted` without one, and
its requeued job says so and starts over."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from test_resume import saved_model_checksum

from conftest import gpuscale, leftover_processes, spawn_gpuscale, wait_until
from gpuscale.control.store import Store
from gpuscale.runs.checkpoints import list_checkpoints
from gpuscale.runs.run_dir import RunDir

pytestmark = pytest.mark.e2e  # every test here starts real runs

# 4 steps, no scheduled checkpoint: the one the run resumes from is the one the signal asked for.
TINY_SFT = ["--recipe", "sft", "--gpus", "2", "--batch-size", "2", "--set", "max_examples=16",
            "--set", "max_steps=4", "--set", "max_length=64", "--set", "eval_examples=0",
            "--set", "learning_rate=1e-4", "--set", "checkpoint_every=0", "--set", "save_model=true"]
JOB = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}


def running_attempt(home: Path) -> dict | None:
    """The run of job 4242 that runs now."""
    runs = Store(home).list_runs(status="running") if (home / "runs.db").exists() else []
    return next((run for run in runs if run["settings"].get("slurm_job_id") == "4242"), None)


def preempted_after_first_step(home: Path, args: list[str]) -> tuple[dict, str]:
    """`gpuscale run ARGS --slurm-requeue --json` in job 4242, SIGUSR1 once rank 0 logged step 1; each
    step takes a second from there (GPUSCALE_INJECT_FAULT's `slow`), so the signal comes mid-run."""
    front = spawn_gpuscale("run", *args, "--slurm-requeue", "--json", env={**JOB, "GPUSCALE_INJECT_FAULT": "0:slow:1"})
    run = wait_until(lambda: running_attempt(home), timeout=120, message="the run of job 4242")
    metrics = RunDir(run["run_dir"]).metrics(0)
    wait_until(lambda: metrics.exists() and '"step": 1,' in metrics.read_text(), timeout=120, message="step 1")
    front.send_signal(signal.SIGUSR1)
    out, err = front.communicate(timeout=120)
    assert front.returncode == 0, err  # preempted under --slurm-requeue: the job requeues itself
    return json.loads(out), err


def test_a_preempted_sft_run_is_continued_by_the_requeued_job_to_the_uninterrupted_weights(home):
    alone = spawn_gpuscale("run", *TINY_SFT, "--json")  # the run left alone, meanwhile
    first, _ = preempted_after_first_step(home, TINY_SFT)
    out, err = alone.communicate(timeout=240)
    whole = json.loads(out)
    assert whole["status"] == "succeeded", err
    assert first["status"] == "preempted" and first["error"] is None
    assert first["settings"]["slurm_job_id"] == "4242" and first["settings"]["slurm_restart_count"] == 0
    marker = json.loads(RunDir(first["run_dir"]).preempted.read_text())
    step = marker["step"]
    assert 1 <= step < 4, marker  # it stopped mid-run, at a step's end
    checkpoints = list_checkpoints(first["run_dir"])
    assert [p.name for p in checkpoints] == [f"checkpoint-{step}"] and marker["checkpoint"] == str(checkpoints[0])
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoints[0].iterdir()}  # both ranks saved
    assert first["hint"].startswith(f"preempted after step {step}: checkpoint-{step} written")
    assert leftover_processes(first["run_dir"]) == []

    requeued = gpuscale("run", *TINY_SFT, "--slurm-requeue", "--json", env={**JOB, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr
    second = json.loads(requeued.stdout)
    assert f"resuming run {first['id']} of SLURM job 4242 (restart 1) from checkpoint-{step}" in requeued.stderr
    assert second["status"] == "succeeded", second["error"]
    assert second["parent_id"] == first["id"] and second["settings"]["slurm_restart_count"] == 1
    assert second["settings"]["resume_from"] == str(checkpoints[0])
    losses = [row["step"] for row in Store(home).metrics(second["id"], "loss") if row["rank"] >= 0]
    assert losses == list(range(step + 1, 5))  # only the steps after the checkpoint
    check = second["summary"]["resume_check"]  # the checkpoint the signal asked for held Adam's state too
    assert check["passed"] is True and check["optimizer"]["passed"] and check["steps"]["done"] == 4 - step
    assert saved_model_checksum(second["summary"]["model_dir"]) == saved_model_checksum(whole["summary"]["model_dir"])

    # The history shows the chain; a third start of the same job has nothing left to do.
    assert f"resumed from: run {first['id']}" in gpuscale("show", str(second["id"])).stdout
    again = gpuscale("run", *TINY_SFT, "--slurm-requeue", env={**JOB, "SLURM_RESTART_COUNT": "2"})
    assert again.returncode == 0 and f"run {second['id']} of this job succeeded: nothing left to do" in again.stderr
    assert len(Store(home).list_runs()) == 3


PROBE = ["--recipe", "probe", "--gpus", "1", "--set", "steps=400", "--set", "prompt_tokens=8", "--batch-size", "2"]


def test_a_recipe_without_checkpoints_ends_preempted_without_one_and_starts_over(home):
    first, _ = preempted_after_first_step(home, PROBE)
    assert first["status"] == "preempted"
    assert first["hint"].startswith("preempted with no checkpoint")
    assert list_checkpoints(first["run_dir"]) == [] and leftover_processes(first["run_dir"]) == []

    requeued = gpuscale("run", *PROBE, "--set", "steps=2", "--slurm-requeue", "--json",
                        env={**JOB, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr
    assert (f"SLURM job 4242 (restart 1): run {first['id']} ended preempted with no checkpoint (recipe probe writes "
            "none, or it ended before its first): starting over") in requeued.stderr
    second = json.loads(requeued.stdout)
    assert second["status"] == "succeeded" and second["parent_id"] is None


def test_slurm_requeue_outside_a_job_is_refused_before_anything_starts(home):
    refused = gpuscale("run", *PROBE, "--slurm-requeue", env={"SLURM_JOB_ID": ""})
    assert refused.returncode == 2
    assert refused.stderr == ("gpuscale: error: --slurm-requeue: SLURM_JOB_ID is not set: it is for the script of "
                              "`gpuscale sbatch --requeue`\n")
    assert not (home / "runs.db").exists() or Store(home).list_runs() == []
