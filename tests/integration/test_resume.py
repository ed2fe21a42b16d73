"""`gpuscale resume` end to end on CPU ranks: a failed eggroll or grpo-mtl run continued from its
checkpoint ends with the weights of the same run left alone (eggroll's 2-rank run resumed on 2 ranks and
on 1 ends with those of the 1-rank run left alone); an sft run checkpointed on 2 ranks goes on to its end
on 1; a run with nothing to resume from is refused in one line."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import gpuscale, run_json, run_together
from gpuscale.control.store import Store
from gpuscale.runs.checkpoints import list_checkpoints

pytestmark = pytest.mark.e2e  # every test here starts real runs

# Adam, so that its state has to travel in the checkpoint too; a checkpoint every 2 of 4 steps.
TINY = ["--recipe", "eggroll", "--set", "population=8", "--set", "prompts_per_step=4", "--set", "max_new_tokens=16",
        "--set", "steps=4", "--set", "eval_examples=4", "--set", "eval_every=0", "--set", "sigma=0.05",
        "--set", "lr=0.05", "--set", "optimizer=adam", "--set", "checkpoint_every=2",
        "--set", "keep_checkpoints=1", "--set", "save_model=false", "--batch-size", "16",
        "--set", "max_examples=64"]  # not the whole 200,000-problem split: generating it costs a rank ~6 s


@pytest.fixture(scope="module")
def eggroll_runs(module_home) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """TINY left alone on one rank and TINY on two ranks failing at step 3, started together (neither reads
    the other): the resume's reference and its parent. eggroll's population splits over the ranks and
    every rank applies the same update, so one rank ends with the weights two do (the test below
    resumes the parent on both counts); the run left alone is also the succeeded run a resume refuses."""
    return tuple(run_together([*TINY, "--gpus", "1"], [*TINY, "--gpus", "2", "--label", "adam"],
                              envs=[{}, {"GPUSCALE_INJECT_FAULT": "0:error:3"}]))


def test_a_failed_run_resumed_ends_with_the_uninterrupted_runs_weights(module_home, eggroll_runs):
    ended, broken = eggroll_runs
    assert ended.returncode == 0, ended.stderr
    whole = json.loads(ended.stdout)
    assert whole["status"] == "succeeded", whole["error"]
    assert [p.name for p in list_checkpoints(whole["run_dir"])] == ["checkpoint-4"]  # keep_checkpoints=1

    assert broken.returncode == 1
    parent = json.loads(broken.stdout)
    assert parent["status"] == "failed"
    assert [p.name for p in list_checkpoints(parent["run_dir"])] == ["checkpoint-2"]
    leftovers = list((Path(parent["run_dir"]) / "checkpoints").iterdir())
    assert [p.name for p in leftovers] == ["checkpoint-2"]  # no partial folder left behind

    resumed = run_json("resume", str(parent["id"]))
    assert resumed["status"] == "succeeded", resumed["error"]
    assert resumed["parent_id"] == parent["id"] and resumed["label"] == "adam"  # the label is carried
    assert resumed["settings"]["resume_from"].endswith("checkpoint-2")
    assert (resumed["summary"]["world_size"], whole["summary"]["world_size"]) == (2, 1)
    assert resumed["summary"]["weights_checksum"] == whole["summary"]["weights_checksum"]
    check = resumed["summary"]["resume_check"]  # runs/resume_check.py: Adam's own state, eggroll's fitness
    assert check["passed"] is True, check
    assert (check["steps"]["left"], check["steps"]["done"]) == (2, 2)
    assert check["optimizer"]["name"] == "Adam" and check["optimizer"]["passed"]
    # 2 fitness values before the checkpoint say too little of its noise: not compared, and said so.
    assert check["figure"]["name"] == "fitness_mean" and check["figure"]["passed"] is None
    # It ran steps 3 and 4 only: the weights came from the checkpoint, not from running it all again.
    steps = {row["step"] for row in Store(module_home).metrics(resumed["id"], "fitness_mean") if row["rank"] >= 0}
    assert steps == {3, 4}
    # The figures go on from the parent's: the first step's fitness is the parent's, not step 3's.
    assert resumed["summary"]["fitness_mean_first"] == whole["summary"]["fitness_mean_first"]

    # Resumed already: a second resume is refused, naming the run that continued it, unless --force.
    again = gpuscale("resume", str(parent["id"]), "--gpus", "1")
    assert again.returncode == 2
    assert again.stderr == (f"gpuscale: error: run {parent['id']} was already resumed by run {resumed['id']} "
                            f"(succeeded); `gpuscale resume {parent['id']} --force` resumes run {parent['id']} "
                            "again\n")
    assert len(run_json("runs")) == 3  # nothing was started
    # On one rank instead of two: the checkpoint holds nothing tied to the rank count.
    alone = run_json("resume", str(parent["id"]), "--gpus", "1", "--force", "--label", "alone")
    assert alone["status"] == "succeeded", alone["error"]
    assert alone["summary"]["world_size"] == 1
    assert alone["summary"]["weights_checksum"] == whole["summary"]["weights_checksum"]

    listed = gpuscale("runs")
    assert f"{resumed['id']} ↻{parent['id']}" in listed.stdout
    shown = gpuscale("show", str(resumed["id"]))
    assert f"resumed from: run {parent['id']}" in shown.stdout
    children = f"continued by: run {resumed['id']} (succeeded), run {alone['id']} (succeeded)"
    assert children in gpuscale("show", str(parent["id"])).stdout.splitlines()
    assert alone["label"] == "alone"

    # runs.db truncated to 100 bytes: the repair keeps the resume links, the labels and the statuses.
    (module_home / "runs.db").write_bytes((module_home / "runs.db").read_bytes()[:100])
    assert gpuscale("doctor", "--repair").returncode == 0
    rebuilt = {run["id"]: run for run in run_json("runs")}
    assert [(rebuilt[i]["status"], rebuilt[i]["parent_id"], rebuilt[i]["label"])
            for i in (whole["id"], parent["id"], resumed["id"], alone["id"])] == [
        ("succeeded", None, None), ("failed", None, "adam"), ("succeeded", parent["id"], "adam"),
        ("succeeded", parent["id"], "alone")]
    assert rebuilt[resumed["id"]]["summary"] == resumed["summary"]
    assert children in gpuscale("show", str(parent["id"])).stdout.splitlines()
    assert gpuscale("resume", str(parent["id"])).returncode == 2  # still resumed already


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


def test_a_succeeded_run_and_an_unknown_one_are_refused(eggroll_runs):
    run = json.loads(eggroll_runs[0].stdout)  # the run left alone: it succeeded, with a checkpoint
    assert run["status"] == "succeeded", run["error"]
    refused = gpuscale("resume", str(run["id"]))
    assert refused.returncode == 2
    assert refused.stderr == f"gpuscale: error: run {run['id']} succeeded: there is nothing left to resume\n"
    assert gpuscale("resume", "99").returncode == 2


# ---- TRL recipes: checkpoints written and read by the trainer (engines/trl_checkpoints.py) --------------


def saved_model_checksum(model_dir: str | Path) -> str:
    """sha256 over the saved model's tensors, by name, as stored (bitwise)."""
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(-1).numpy().tobytes())
    return digest.hexdigest()


# PCGrad and the engine's sampling at temperature 1 after the checkpoint: both draw random numbers the
# trainer's own RNG files do not hold. 4 prompts x 4 completions a step, 2 micro-batches a rank.
TINY_GRPO = ["--recipe", "grpo-mtl", "--gpus", "2", "--set", "mtl=pcgrad", "--set", "rollout.n=4",
             "--set", "data.train_batch_size=4", "--set", "ppo_micro_batch_size_per_gpu=4",
             "--set", "max_response_length=16", "--set", "max_steps=3", "--set", "eval_examples=0",
             "--set", "max_examples=16", "--set", "checkpoint_every=2", "--set", "keep_checkpoints=1",
             "--set", "save_model=true"]


def test_a_failed_grpo_mtl_run_resumed_ends_with_the_uninterrupted_runs_weights(home):
    # The run left alone and the one that fails, at once: neither reads the other.
    ended, broken = run_together(TINY_GRPO, [*TINY_GRPO, "--label", "adam"],
                                 envs=[{}, {"GPUSCALE_INJECT_FAULT": "0:error:3"}])
    assert ended.returncode == 0, ended.stderr
    whole = json.loads(ended.stdout)
    assert whole["status"] == "succeeded", whole["error"]

    assert broken.returncode == 1
    parent = json.loads(broken.stdout)
    assert parent["status"] == "failed"
    checkpoint = list_checkpoints(parent["run_dir"])
    assert [p.name for p in checkpoint] == ["checkpoint-2"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoint[0].iterdir()}

    resumed = run_json("resume", str(parent["id"]))
    assert resumed["status"] == "succeeded", resumed["error"]
    assert resumed["parent_id"] == parent["id"] and resumed["label"] == "adam"  # the label is carried
    assert resumed["summary"]["steps"] == 3
    check = resumed["summary"]["resume_check"]  # GRPO's is checked on its reward (runs/resume_check.py)
    assert check["passed"] is True, check
    assert (check["steps"]["left"], check["steps"]["done"], check["figure"]["name"]) == (1, 1, "reward")
    assert check["optimizer"]["passed"] and check["figure"]["passed"] is None  # 2 rewards before: too few
    # It trained step 3 only, from the checkpoint's weights, optimizer, schedule and data position.
    rewards = [row["step"] for row in Store(home).metrics(resumed["id"], "reward") if row["rank"] >= 0]
    assert rewards == [3]
    # Bitwise: the same completions were sampled at step 3 and PCGrad took the domains in the same order.
    assert saved_model_checksum(resumed["summary"]["model_dir"]) == saved_model_checksum(whole["summary"]["model_dir"])
    assert saved_model_checksum(checkpoint[0]) != saved_model_checksum(whole["summary"]["model_dir"])  # step 3 moved it


TINY_SFT = ["--recipe", "sft", "--batch-size", "2", "--set", "max_examples=16", "--set", "max_steps=4",
            "--set", "max_length=64", "--set", "eval_examples=0", "--set", "learning_rate=1e-4",
            "--set", "checkpoint_every=2", "--set", "keep_checkpoints=1", "--set", "save_model=true"]


def test_an_sft_run_checkpointed_on_two_ranks_goes_on_to_its_end_on_one(home):
    """TRL saved rng_state_0.pth and rng_state_1.pth; one rank reads neither (transformers looks for
    rng_state.pth and goes on without it): the data order and the weights carry over, the random
    streams start afresh. Not bitwise the 2-rank run either way: each step sees half the rows."""
    broken = gpuscale("run", *TINY_SFT, "--gpus", "2", "--json", env={"GPUSCALE_INJECT_FAULT": "0:error:3"})
    assert broken.returncode == 1
    parent = json.loads(broken.stdout)
    assert parent["status"] == "failed"
    checkpoint = list_checkpoints(parent["run_dir"])[0]
    assert checkpoint.name == "checkpoint-2"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoint.iterdir()}

    alone = run_json("resume", str(parent["id"]), "--gpus", "1")
    assert alone["status"] == "succeeded", alone["error"]
    assert alone["parent_id"] == parent["id"] and alone["settings"]["gpus"] == 1
    assert alone["command"][1:3] == ["-m", "gpuscale.recipes"]  # one process: its rank, without a launcher
    summary = alone["summary"]
    assert summary["world_size"] == 1 and summary["steps"] == 4  # max_steps, counted from the checkpoint's 2
    losses = [row["step"] for row in Store(home).metrics(alone["id"], "loss") if row["rank"] >= 0]
    assert losses == [3, 4]
    assert summary["model_dir"] == str(Path(alone["run_dir"]) / "model")
    assert saved_model_checksum(summary["model_dir"]) != saved_model_checksum(checkpoint)  # steps 3-4 trained it
