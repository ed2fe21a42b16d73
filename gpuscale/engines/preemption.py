"""A rank's side of SLURM preemption: SIGUSR1 asks the run to write a checkpoint and end.

`gpuscale sbatch --requeue` has SLURM send SIGUSR1 to the batch script ahead of the time limit; the
script passes it to every node's `gpuscale run`, which passes it to its supervisor, which passes it
to the ranks (control/supervisor.py; the launcher between them ignores it). Here, in each rank:

- While a loop that can checkpoint runs (`cooperating()`: TRL's trainer through `PreemptionCallback`,
  eggroll's steps), the signal only sets a flag. At the end of the next optimizer step the ranks agree
  on it (`agreed`: one all-reduce, so every rank stops after the same step; a rank that saw the signal
  a moment later still stops with the others), the checkpoint of that step is written, and the loop
  raises `Preempted` naming it.
- Anywhere else (loading, generating, the final evaluation, a recipe that writes no checkpoint) the
  signal raises `Preempted` at once, with no checkpoint: there is no consistent state to save there.

`engines/distributed.py:run_rank` catches `Preempted`: rank 0 writes RUN_DIR/preempted.json (the
step and the checkpoint, or none) and the rank exits 0; the supervisor then records the run as
`preempted`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuscale.data.step_phases import WAIT
from gpuscale.engines import step_phases

_state = {"asked": False, "cooperating": False}


class Preempted(BaseException):  # noqa: N818 - not an error: the run was asked to end here
    """The run ends here on SLURM's signal; `checkpoint`: the folder written for it, or None."""

    def __init__(self, step: int | None = None, checkpoint: str | Path | None = None):
        self.step = step
        self.checkpoint = str(checkpoint) if checkpoint else None
        where = f"after step {step}, {Path(self.checkpoint).name} written" if self.checkpoint else "with no checkpoint"
        super().__init__(f"preempted {where}")


def _on_signal(_signum, _frame) -> None:
    if _state["asked"]:
        return  # the signal may come again (from the front end and the supervisor): once is enough
    _state["asked"] = True
    if not _state["cooperating"]:
        raise Preempted()


def install() -> None:
    """Take SIGUSR1 in this rank (it arrives ignored: the launcher's disposition)."""
    _state.update(asked=False, cooperating=False)
    signal.signal(signal.SIGUSR1, _on_signal)


def asked() -> bool:
    """Whether this rank has received the signal."""
    return _state["asked"]


@contextmanager
def cooperating() -> Iterator[None]:
    """Inside: the signal only sets the flag, for a loop that checks `agreed` at each step's end. On
    leaving, a signal that came after the loop's last check ends the rank as anywhere else would."""
    _state["cooperating"] = True
    try:
        yield
    finally:
        _state["cooperating"] = False
    if _state["asked"]:
        raise Preempted()


def agreed(device=None) -> bool:
    """Whether any rank has received the signal: every rank must call this at the same point (one
    all-reduce of one number; alone, no collective)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return asked()
    # Called between steps, outside the recipe's phases: the all-reduce waits for the slowest rank,
    # which is the step's `wait` (engines/step_phases.py), not unexplained time.
    with step_phases.phase(WAIT):
        flag = torch.tensor([1.0 if asked() else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def preemption_callback(device):
    """A TRL TrainerCallback: at each optimizer step's end, if the ranks agree the signal came, the
    trainer saves that step's checkpoint (its usual one: model, optimizer, scheduler, RNG states, data
    position, into RUN_DIR/checkpoints whatever `checkpoint_every` says) and stops; `stopped_at`
    is then the step. `train_model` raises `Preempted` after `trainer.train` returns."""
    from transformers import TrainerCallback

    class PreemptionCallback(TrainerCallback):
        stopped_at: int | None = None

        def on_step_end(self, args, state, control, **kwargs):
            if agreed(device):
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step
            return control

    return PreemptionCallback()
