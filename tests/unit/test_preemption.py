"""A rank's side of SLURM's signal (engines/preemption.py), in this process: SIGUSR1 outside a loop
that checkpoints ends the rank at once, with no checkpoint; inside one it only sets the flag the loop
checks at its step's end; a signal that comes after the loop's last check still ends the rank."""

from __future__ import annotations

import os
import signal

import pytest

from gpuscale.engines import preemption


@pytest.fixture
def usr1_taken():
    before = signal.getsignal(signal.SIGUSR1)
    preemption.install()
    yield
    preemption.install()  # the flag down again: later tests train in this process
    signal.signal(signal.SIGUSR1, before)


def test_outside_a_checkpointing_loop_the_signal_ends_the_rank_with_no_checkpoint(usr1_taken):
    with pytest.raises(preemption.Preempted) as ended:
        os.kill(os.getpid(), signal.SIGUSR1)
        signal.sigtimedwait([], 0)  # a bytecode boundary, where Python runs the handler
    assert ended.value.checkpoint is None and str(ended.value) == "preempted with no checkpoint"
    os.kill(os.getpid(), signal.SIGUSR1)  # again (the front end and the supervisor both pass it on): ignored


def test_inside_a_loop_the_signal_waits_for_the_steps_end(usr1_taken, tmp_path):
    steps_done = []
    with pytest.raises(preemption.Preempted) as ended, preemption.cooperating():
        for step in range(1, 5):
            if step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
            steps_done.append(step)
            if preemption.agreed():  # alone: no collective
                raise preemption.Preempted(step, tmp_path / f"checkpoint-{step}")
    assert steps_done == [1, 2]
    assert str(ended.value) == "preempted after step 2, checkpoint-2 written"


def test_a_signal_after_the_loops_last_check_still_ends_the_rank(usr1_taken):
    with pytest.raises(preemption.Preempted), preemption.cooperating():
        os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.asked()
