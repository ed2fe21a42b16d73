"""`gpuscale resume` end to end on CPU ranks: a failed eggroll run continued from its checkpoint ends
with the weights of the same run left alone, on the same or another number of ranks; a run with
nothing to resume from is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import gpuscale, run_json
from gpuscale.runs.checkpoints import list_checkpoints
from gpuscale.runs.store import Store

# Adam, so that its state has to travel in the checkpoint too; a checkpoint every 2 of 4 steps.
TINY = ["--recipe", "eggroll", "--set", "population=8", "--set", "prompts_per_step=4", "--set", "max_new_tokens=16",
        "--set", "steps=4", "--set", "eval_examples=4", "--set", "eval_every=0", "--set", "sigma=0.05",
        "--set", "lr=0.05", "--set", "optimizer=adam", "--set", "checkpoint_every=2",
        "--set", "keep_checkpoints=1", "--set", "save_model=false", "--batch-size", "16"]


def test_a_failed_run_resumed_ends_with_the_uninterrupted_runs_weights(home):
    whole = run_json("run", *TINY, "--gpus", "2")
    assert whole["status"] == "succeeded", whole["error"]
    assert [p.name for p in list_checkpoints(whole["run_dir"])] == ["checkpoint-4"]  # keep_checkpoints=1

    broken = gpuscale("run", *TINY, "--gpus", "2", "--json", env={"GPUSCALE_INJECT_FAULT": "0:error:3"})
    assert broken.returncode == 1
    parent = json.loads(broken.stdout)
    assert parent["status"] == "failed"
    assert [p.name for p in list_checkpoints(parent["run_dir"])] == ["checkpoint-2"]
    leftovers = list((Path(parent["run_dir"]) / "checkpoints").iterdir())
    assert [p.name for p in leftovers] == ["checkpoint-2"]  # no partial folder left behind

    resumed = run_json("resume", str(parent["id"]))
    assert resumed["status"] == "succeeded", resumed["error"]
    assert resumed["parent_id"] == parent["id"]
    assert resumed["settings"]["resume_from"].endswith("checkpoint-2")
    assert resumed["summary"]["weights_checksum"] == whole["summary"]["weights_checksum"]
    # It ran steps 3 and 4 only: the weights came from the checkpoint, not from running it all again.
    steps = {row["step"] for row in Store(home).metrics(resumed["id"], "fitness_mean") if row["rank"] >= 0}
    assert steps == {3, 4}
    # The figures go on from the parent's: the first step's fitness is the parent's, not step 3's.
    assert resumed["summary"]["fitness_mean_first"] == whole["summary"]["fitness_mean_first"]

    # On one rank instead of two: the checkpoint holds nothing tied to the rank count.
    alone = run_json("resume", str(parent["id"]), "--gpus", "1")
    assert alone["status"] == "succeeded", alone["error"]
    assert alone["summary"]["world_size"] == 1
    assert alone["summary"]["weights_checksum"] == whole["summary"]["weights_checksum"]

    listed = gpuscale("runs")
    assert f"{resumed['id']} ↻{parent['id']}" in listed.stdout
    shown = gpuscale("show", str(resumed["id"]))
    assert f"resumed from: run {parent['id']}" in shown.stdout


def test_a_run_without_checkpoint_is_refused_in_one_line(home):
    failed = gpuscale("run", *TINY, "--set", "checkpoint_every=0", "--gpus", "1", "--json",
                      env={"GPUSCALE_INJECT_FAULT": "0:error:1"})
    run = json.loads(failed.stdout)
    assert run["status"] == "failed"
    refused = gpuscale("resume", str(run["id"]))
    assert refused.returncode == 2
    assert refused.stderr == (f"gpuscale: error: run {run['id']} has no checkpoint to resume from "
                              "(it saved none: checkpoint_every was 0)\n")
    assert len(run_json("runs")) == 1  # nothing was started


def test_a_succeeded_run_and_an_unknown_one_are_refused(home):
    run = run_json("run", "--recipe", "probe", "--set", "steps=2", "--set", "prompt_tokens=8", "--batch-size", "2",
                   "--gpus", "1")
    refused = gpuscale("resume", str(run["id"]))
    assert refused.returncode == 2
    assert refused.stderr == f"gpuscale: error: run {run['id']} succeeded: there is nothing left to resume\n"
    assert gpuscale("resume", "99").returncode == 2
