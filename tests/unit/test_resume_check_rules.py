"""The resume check's rule and words (runs/resume_check.py), on plain values; the runs that fill it are
tests/integration/test_resume_check.py's."""

from __future__ import annotations

import json

import pytest

from gpuscale.app.views.runs import lineage_lines, resume_check_warnings, summary_lines
from gpuscale.runs.resume_check import (
    MIN_BEFORE,
    ResumeCheck,
    check_failed,
    check_line,
    figure_part,
    optimizer_part,
    steps_part,
)

ADAM_RESTORED = optimizer_part("AdamW", True, 38, 38, 38)
FALLING = [2.0, 1.6, 1.3, 1.1, 0.95, 0.85, 0.8]  # a loss still falling at the checkpoint


def finished_check(after: list[float], optimizer: dict = ADAM_RESTORED, done: int = 3) -> dict:
    check = ResumeCheck("/runs/1/checkpoints/checkpoint-7", before=list(FALLING), total=10, optimizer=optimizer)
    for value in after:
        check.logged(value)
    check.done = done
    return check.record(finished=True)


def test_a_resume_that_carried_on_passes_in_one_line():
    record = finished_check([0.78, 0.74, 0.71])
    assert record["passed"] is True and not check_failed(record)
    # the average of the last 3 before (0.8667) against the first 3 after (0.7433), within the spread of
    # the last 10 before (2.0 - 0.8 = 1.2: the loss was still falling)
    assert record["figure"]["tolerance"] == pytest.approx(1.2)
    assert check_line(record) == ("resume check: passed: 3 steps left, 3 done; Adam state restored; first loss "
                                  "0.743 against 0.867 before (means of up to 3 steps, tolerance ±1.2)")


def test_a_resume_whose_loss_went_back_to_the_start_is_flagged():
    steady = [0.52, 0.5, 0.49, 0.51, 0.5, 0.5]
    part = figure_part("loss", steady, [2.1, 2.0, 1.9], 6)
    assert part["passed"] is False and part["tolerance"] == pytest.approx(0.5 * 0.5033, rel=1e-3)


def test_failed_parts_come_first_and_each_says_why():
    record = finished_check([0.8, 0.8, 0.8], optimizer=optimizer_part("AdamW", True, 38, 0, 0), done=10)
    assert record["passed"] is False and check_failed(record)
    assert check_line(record) == (
        "resume check: FAILED: 3 steps left, 10 done (of 10 in all, from the checkpoint at step 7); Adam state "
        "missing (0 of 38 parameters have moments: the checkpoint's optimizer state was not restored); first loss "
        "0.8 against 0.867 before (means of up to 3 steps, tolerance ±1.2)")
    zeroed = optimizer_part("AdamW", True, 38, 38, 0)
    assert zeroed["passed"] is False
    assert check_line(finished_check([0.8], zeroed)).startswith(
        "resume check: FAILED: Adam state zero (38 of 38 parameters' moments are all zero); 3 steps left")


def test_what_is_not_known_yet_or_cannot_be_compared_is_said_never_passed():
    check = ResumeCheck("/runs/1/checkpoints/checkpoint-2", figure="reward", before=[0.125, 0.125], total=3,
                        optimizer=ADAM_RESTORED)
    assert check.record()["passed"] is None  # steps not over, nothing logged after
    assert check_line(check.record()) == ("resume check: pending: steps not over yet; Adam state restored; first "
                                          "steps not logged yet")
    check.logged(0.25)
    check.done = 1
    record = check.record(finished=True)
    assert record["passed"] is True and record["figure"]["passed"] is None  # compared with nothing: not failed
    assert check_line(record).endswith(f"reward not compared: 2 value(s) logged up to step 2, {MIN_BEFORE} needed "
                                       "to know its step-to-step spread")
    assert steps_part(None, 2, 0)["passed"] is False  # a run whose total is unknown never passes its steps
    assert optimizer_part("SGD", False, 0, 0, 0)["passed"]  # nothing to restore


def test_moments_zero_because_every_gradient_before_was_zero_are_not_a_lost_state():
    """A GRPO run of random weights: every group's rewards equal, every gradient 0, Adam's moments 0 in the
    checkpoint too (seen on 2 x H200 at random-qwen2.5-0.5b, bench/results/faults/faults-stop-*-h200x2.json)."""
    as_saved = optimizer_part("AdamW", True, 290, 290, 0, zero_gradients_before=True)
    assert as_saved["passed"] is None
    record = finished_check([0.8, 0.8, 0.8], optimizer=as_saved)
    assert record["passed"] is True and not check_failed(record)
    assert "; Adam state zero, as the checkpoint's: every gradient norm logged up to it was 0; " in check_line(record)
    # Moments missing are a lost state whatever the gradients were; zero moments after nonzero gradients too.
    assert optimizer_part("AdamW", True, 290, 0, 0, zero_gradients_before=True)["passed"] is False
    assert optimizer_part("AdamW", True, 290, 290, 0, zero_gradients_before=False)["passed"] is False


def test_the_trainer_side_reads_the_gradient_norms_logged_up_to_the_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    from gpuscale.engines.resume_check import GRADIENT_NORM, logged_before, restored_optimizer

    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    history = [{"step": 1, "loss": 0.0, GRADIENT_NORM: 0.0}, {"step": 2, "loss": 0.0, GRADIENT_NORM: 0.0},
               {"step": 3, "loss": 0.1, GRADIENT_NORM: 0.5}]  # after the checkpoint: not read
    (checkpoint / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert logged_before(checkpoint, GRADIENT_NORM) == [0.0, 0.0]
    weight = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([weight])
    weight.grad = torch.zeros(3)
    adam.step()  # a step of zero gradient: both moments present, all zero
    assert restored_optimizer(adam, [0.0, 0.0])["passed"] is None
    assert restored_optimizer(adam, [0.0, 0.5])["passed"] is False
    assert restored_optimizer(adam)["passed"] is False  # nothing logged: nothing says the zeros were saved


def test_the_views_warn_of_a_failed_check_from_the_summary_or_the_progress():
    failed = finished_check([0.8], optimizer=optimizer_part("AdamW", True, 38, 0, 0))
    ended = {"parent_id": 1, "settings": {"resume_from": "/c"}, "summary": {"resume_check": failed}}
    live = {"parent_id": 1, "settings": {}, "summary": None, "progress": {"resume_check": failed}}
    for run in (ended, live):
        assert resume_check_warnings(run) == [check_line(failed)]
        assert check_line(failed) in lineage_lines(run, [])
    assert f"  resume_check: {check_line(failed).removeprefix('resume check: ')}" in summary_lines(ended["summary"])
    passed = {"parent_id": 1, "settings": {}, "summary": {"resume_check": finished_check([0.8, 0.8, 0.8])}}
    assert resume_check_warnings(passed) == [] and lineage_lines(passed, [])[1].startswith("resume check: passed")
    assert resume_check_warnings({"summary": {}, "progress": {}}) == []  # not a resumed run
