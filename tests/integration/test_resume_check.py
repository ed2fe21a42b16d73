"""A resume checks itself (runs/resume_check.py), end to end on a CPU rank: a failed sft run resumed
from its checkpoint records the three parts passed; the same checkpoint with its Adam moments zeroed,
then without its optimizer.pt, is flagged in the summary and in `gpuscale show`; a checkpoint that lost
whose trainer state says step 0 (transformers then trains every step again) is flagged for its steps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import gpuscale, run_json
from gpuscale.runs.checkpoints import list_checkpoints

pytestmark = pytest.mark.e2e  # every test here starts real runs

# 8 steps, a checkpoint at step 5, the parent failing at step 6: 3 steps are left to the resume, and 5
# losses logged before the checkpoint are enough to compare the first resumed ones with.
TINY_SFT = ["--recipe", "sft", "--gpus", "1", "--batch-size", "2", "--set", "max_examples=16",
            "--set", "max_steps=8", "--set", "max_length=64", "--set", "eval_examples=0",
            "--set", "learning_rate=1e-4", "--set", "checkpoint_every=5", "--set", "keep_checkpoints=1",
            "--set", "save_model=false"]


@pytest.fixture(scope="module")
def failed_parent(module_home, tmp_path_factory) -> tuple[dict, Path, Path]:
    """TINY_SFT failed at step 6, once for both tests: the run, its checkpoint-5, and a copy of that
    checkpoint made before any test changes it (the first test alters the checkpoint its resumes read,
    the second alters the copy, which keeps the folder's name: its step)."""
    broken = gpuscale("run", *TINY_SFT, "--json", env={"GPUSCALE_INJECT_FAULT": "0:error:6"})
    assert broken.returncode == 1, broken.stderr
    parent = json.loads(broken.stdout)
    assert parent["status"] == "failed"
    [checkpoint] = list_checkpoints(parent["run_dir"])
    assert checkpoint.name == "checkpoint-5"
    copy = tmp_path_factory.mktemp("copy") / checkpoint.name
    shutil.copytree(checkpoint, copy)
    return parent, checkpoint, copy


def shown(run: dict) -> list[str]:
    return gpuscale("show", str(run["id"])).stdout.splitlines()


def warning(run: dict) -> str:
    """The warning `gpuscale show`'s progress line carries after the run's status (`! ...`)."""
    line = shown(run)[0]
    assert " · ! " in line, line
    return line.split(" · ! ", 1)[1]


def zero_adam_moments(checkpoint: Path) -> None:
    """optimizer.pt saved again with every moment 0, as a writer that lost the state would save it."""
    path = checkpoint / "optimizer.pt"
    saved = torch.load(path, weights_only=True)
    for state in saved["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].zero_()
    torch.save(saved, path)


def test_a_resume_passes_its_check_and_one_that_lost_its_optimizer_state_is_flagged(failed_parent):
    parent, checkpoint, _ = failed_parent

    resumed = run_json("resume", str(parent["id"]))
    assert resumed["status"] == "succeeded", resumed["error"]
    check = resumed["summary"]["resume_check"]
    assert check["passed"] is True
    assert check["checkpoint"] == str(checkpoint)
    assert {key: check["steps"][key] for key in ("total", "checkpoint_step", "left", "done")} == {
        "total": 8, "checkpoint_step": 5, "left": 3, "done": 3}
    optimizer = check["optimizer"]
    assert optimizer["adam"] and optimizer["parameters"] > 0
    assert optimizer["with_moments"] == optimizer["nonzero"] == optimizer["parameters"]
    figure = check["figure"]
    assert figure["name"] == "loss" and figure["step_before"] == 5 and len(figure["after_values"]) == 3
    assert abs(figure["after"] - figure["before"]) <= figure["tolerance"]
    passed = [line for line in shown(resumed) if line.startswith("resume check:")]
    assert passed == [f"resume check: passed: 3 steps left, 3 done; Adam state restored; first loss "
                      f"{figure['after']:.3g} against {figure['before']:.3g} before (means of up to 3 steps, "
                      f"tolerance ±{figure['tolerance']:.2g})"]

    zero_adam_moments(checkpoint)
    zeroed = run_json("resume", str(parent["id"]), "--force")
    assert zeroed["status"] == "succeeded", zeroed["error"]  # a warning, not a failed run
    check = zeroed["summary"]["resume_check"]
    assert check["passed"] is False and check["optimizer"]["passed"] is False
    assert check["optimizer"]["nonzero"] == 0 and check["steps"]["passed"] is True
    lines = shown(zeroed)
    assert warning(zeroed).startswith("resume check: FAILED: Adam state zero (")
    assert any(line.startswith("resume check: FAILED: Adam state zero (") for line in lines[1:])  # the record
    assert "  resume_check: FAILED: Adam state zero (" in "\n".join(lines)  # the summary
    # Known before the first resumed step: the rank wrote it then, and the monitor warns while the run goes on.
    records = [json.loads(line) for line in (Path(zeroed["run_dir"]) / "metrics" / "rank0.jsonl").open()]
    first_check = next(i for i, r in enumerate(records) if "resume_check" in r.get("summary", {}))
    first_step = next(i for i, r in enumerate(records) if r.get("step") == 6 and "loss" in r)
    assert first_check < first_step and records[first_check]["summary"]["resume_check"]["passed"] is False

    (checkpoint / "optimizer.pt").unlink()  # transformers then starts Adam afresh, without a word
    dropped = run_json("resume", str(parent["id"]), "--force")
    assert dropped["status"] == "succeeded", dropped["error"]
    check = dropped["summary"]["resume_check"]
    assert check["passed"] is False and check["optimizer"]["with_moments"] == 0
    missing = (f"resume check: FAILED: Adam state missing (0 of {check['optimizer']['parameters']} parameters "
               "have moments: the checkpoint's optimizer state was not restored); 3 steps left, 3 done")
    assert warning(dropped).startswith(missing)


def test_a_checkpoint_whose_trainer_state_says_step_0_is_flagged_for_its_steps(failed_parent):
    """The checkpoint gpuscale resumes from is checkpoint-5, but its trainer_state.json says step 0 (a
    state saved or copied wrong): transformers loads the weights and Adam and trains all 8 steps
    again where 3 were left. Nothing fails; only the check says so."""
    _, _, checkpoint = failed_parent
    state_file = checkpoint / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "global_step": 0}))
    run = run_json("run", *TINY_SFT, "--set", f"resume_from={checkpoint}")
    assert run["status"] == "succeeded", run["error"]
    check = run["summary"]["resume_check"]
    assert check["passed"] is False and check["optimizer"]["passed"] is True
    assert (check["steps"]["left"], check["steps"]["done"], check["steps"]["passed"]) == (3, 8, False)
    assert warning(run).startswith(
        "resume check: FAILED: 3 steps left, 8 done (of 8 in all, from the checkpoint at step 5); Adam state "
        "restored; first loss ")
