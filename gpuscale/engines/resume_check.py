"""A resumed rank's side of the resume check (runs/resume_check.py holds the rule and the words).

- `restored_optimizer(optimizer)`: the optimizer's state as it stands after the checkpoint was loaded,
  as `optimizer_part` judges it (Adam's `exp_avg` and `exp_avg_sq` per parameter).
- `ResumeCheckCallback`: a TrainerCallback for the TRL recipes. It reads the optimizer in
  `on_train_begin`, which transformers calls after loading the checkpoint's optimizer.pt (and without a
  word when that file is missing: Adam then starts afresh); it takes the checkpoint's step from its
  folder and the figure logged up to it from the trainer's own record in the checkpoint
  (trainer_state.json's `log_history`), counts the optimizer steps done and the first resumed values.
  Rank 0 writes the check into a partial summary as soon as a part is known (the monitor warns while
  the run goes on); `training_figures` puts the finished one in the summary.

eggroll fills its `ResumeCheck` in its own loop (recipes/eggroll/trainer.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from gpuscale.runs.checkpoints import checkpoint_step
from gpuscale.runs.resume_check import ResumeCheck, optimizer_part

MOMENTS = ("exp_avg", "exp_avg_sq")
TRAINER_STATE = "trainer_state.json"
GRADIENT_NORM = "grad_norm"  # transformers' Trainer logs it with every loss


def restored_optimizer(optimizer, gradient_norms_before: list[float] | None = None) -> dict:
    """`optimizer_part` of a torch optimizer (or accelerate's wrapper around one): every parameter of
    its groups, those whose state holds both of Adam's moments, and those whose moments are not all 0;
    `gradient_norms_before`, those logged up to the checkpoint (all 0: zero moments are the checkpoint's)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    name = type(inner).__name__
    parameters = [param for group in inner.param_groups for param in group["params"]]
    states = [inner.state.get(param, {}) for param in parameters]
    with_moments = [state for state in states if all(key in state for key in MOMENTS)]
    nonzero = sum(all(bool(state[key].any()) for key in MOMENTS) for state in with_moments)
    zero_gradients = bool(gradient_norms_before) and not any(gradient_norms_before)
    return optimizer_part(name, "adam" in name.lower(), len(parameters), len(with_moments), nonzero, zero_gradients)


def logged_before(checkpoint: str | Path, figure: str) -> list[float]:
    """The figure's values the trainer logged up to the checkpoint's step, oldest first, from the
    checkpoint's trainer_state.json ([] where it has none)."""
    path, step = Path(checkpoint) / TRAINER_STATE, checkpoint_step(checkpoint)
    if not path.is_file():
        return []
    history = json.loads(path.read_text()).get("log_history", [])
    return [float(entry[figure]) for entry in history
            if figure in entry and (step is None or entry.get("step", 0) <= step)]


class ResumeCheckCallback(TrainerCallback):
    """Fills a `ResumeCheck` from a TRL trainer resumed from `checkpoint`; `figure` is the trainer's
    log key to compare (its loss, or GRPO's reward)."""

    def __init__(self, reporter, checkpoint: str | Path, figure: str = "loss"):
        self.reporter = reporter
        self.check = ResumeCheck(str(checkpoint), figure, before=logged_before(checkpoint, figure))
        self.gradient_norms_before = logged_before(checkpoint, GRADIENT_NORM)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.check.total = int(state.max_steps)
        if optimizer is not None:
            self.check.optimizer = restored_optimizer(optimizer, self.gradient_norms_before)
        self._report(state)

    def on_step_end(self, args, state, control, **kwargs):
        self.check.done += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        value = (logs or {}).get(self.check.figure)
        if isinstance(value, (int, float)) and self.check.logged(value):
            self._report(state)

    def _report(self, state) -> None:
        if state.is_world_process_zero:
            self.reporter.summary({"resume_check": self.check.record()}, partial=True)
