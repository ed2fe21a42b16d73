"""A resumed run checks that it carried on, and says so (`resume_check` in its summary).

A resume can exit cleanly having trained nothing, or go on with a fresh optimizer, and look like any
other run (verl#7401, verl#5725). A run started from a checkpoint (`resume_from`: `gpuscale resume`,
SLURM's requeue) therefore judges three things and records them:

- steps: the steps it did equal the steps that were left (the run's total minus the checkpoint's step);
- optimizer: the optimizer's state came back with the weights (Adam's two moments present and not zero
  for every parameter it trains, unless every gradient norm logged before the checkpoint was 0), where the
  recipe's optimizer keeps one;
- figure: the first resumed steps' loss (or, where the loss says nothing of where training stands, the
  recipe's own figure: grpo-mtl's reward, eggroll's fitness) is near the values logged up to the
  checkpoint (the tolerance and why: below).

The rank fills a `ResumeCheck` as it goes (engines/resume_check.py for a TRL trainer, eggroll's loop
itself) and writes its `record()` into the summary; the front ends read it back with `check_line` and
`check_failed`. A part not judged yet is None ("pending"): a run that ended before its steps were done
says so, never passed. Plain Python: the ranks and the front ends share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuscale.data.figures import label
from gpuscale.runs.checkpoints import checkpoint_step

# The figure's first RESUMED_STEPS values after the resume, averaged, against the average of the last
# RESUMED_STEPS logged up to the checkpoint's step (the state the run resumed from): one step's value
# depends on its batch, three smooth that without waiting long.
RESUMED_STEPS = 3
# The two averages may differ by the larger of RELATIVE_TOLERANCE of the one before and the spread
# (highest minus lowest) of the last SPREAD_STEPS values before. The spread of 10 values of a noisy
# figure is about 3 of its standard deviations, and the difference of two averages of 3 has 0.8 of one:
# a resume that carried on stays inside but about once in 5,000 checks; a falling loss's drift over the
# last steps is inside the spread too. A resume that lost its weights, its optimizer or its data
# position starts from further back: the untrained level, several times a loss that has fallen at all.
# Fewer than MIN_BEFORE values before say too little of the figure's noise (two rewards of 16
# completions can be equal, and the next one twice as high): the figure is then not compared, and the
# line says so.
RELATIVE_TOLERANCE = 0.5
SPREAD_STEPS = 10
MIN_BEFORE = 5


@dataclass
class ResumeCheck:
    """What a resumed rank saw: the checkpoint's step, the run's total, the optimizer's state as it
    was restored, the figure logged before the checkpoint and the first ones after, the steps done."""

    checkpoint: str
    figure: str = "loss"
    before: list[float] = field(default_factory=list)  # the figure up to the checkpoint's step, oldest first
    total: int | None = None
    optimizer: dict | None = None  # `optimizer_part`'s
    after: list[float] = field(default_factory=list)
    done: int = 0

    @property
    def checkpoint_step(self) -> int:
        return checkpoint_step(self.checkpoint) or 0

    def logged(self, value: float) -> bool:
        """One resumed step's figure; True when it completes the figure's judgement (report it then)."""
        if len(self.after) >= RESUMED_STEPS:
            return False
        self.after.append(float(value))
        return len(self.after) == RESUMED_STEPS

    def record(self, finished: bool = False) -> dict:
        """The summary's `resume_check`: each part, and `passed` (False if a part failed, None while one
        is pending, True once all passed). `finished`: the run's steps are over (otherwise the steps,
        and the figure short of RESUMED_STEPS values, are pending)."""
        parts = {
            "steps": steps_part(self.total, self.checkpoint_step, self.done) if finished else None,
            "optimizer": self.optimizer,
            "figure": (figure_part(self.figure, self.before, self.after, self.checkpoint_step)
                       if finished or len(self.after) >= RESUMED_STEPS else None),
        }
        return {"checkpoint": self.checkpoint, **parts, "passed": overall(parts.values())}


def steps_part(total: int | None, checkpoint_step: int, done: int) -> dict:
    """The steps done after the resume against those left: the run's total minus the checkpoint's step."""
    left = max((total or 0) - checkpoint_step, 0)
    return {"total": total, "checkpoint_step": checkpoint_step, "left": left, "done": done,
            "passed": total is not None and done == left}


def optimizer_part(name: str, adam_like: bool, parameters: int, with_moments: int, nonzero: int,
                   zero_gradients_before: bool = False) -> dict:
    """The optimizer's state as restored: of its `parameters`, how many have Adam's two moments and how
    many of those are not all zero. An optimizer without moments (SGD) has nothing to restore: passed.
    Moments all zero where every gradient norm logged up to the checkpoint was 0 (`zero_gradients_before`:
    a GRPO whose every group's rewards were equal, as a model of random weights gives) are what the
    checkpoint held, not a state lost: not judged (`passed` None), the words say why."""
    restored = parameters > 0 and with_moments == parameters
    if adam_like and restored and nonzero == 0 and zero_gradients_before:
        passed = None
    else:
        passed = not adam_like or (restored and nonzero == parameters)
    return {"name": name, "adam": adam_like, "parameters": parameters, "with_moments": with_moments,
            "nonzero": nonzero, "zero_gradients_before": zero_gradients_before, "passed": passed}


def figure_part(figure: str, before: list[float], after: list[float], checkpoint_step: int) -> dict:
    """The first resumed values' average against the last ones' before, within `tolerance`. Not judged
    (`passed` None, `reason` says why) with too few values on a side."""
    part = {"name": figure, "step_before": checkpoint_step, "after_values": list(after)}
    if len(before) < MIN_BEFORE or not after:
        reason = (f"{len(before)} value(s) logged up to step {checkpoint_step}, {MIN_BEFORE} needed to know its "
                  "step-to-step spread" if after else "none logged after the resume")
        return {**part, "passed": None, "reason": reason}
    reference, resumed = mean(before[-RESUMED_STEPS:]), mean(after)
    allowed = tolerance(before)
    return {**part, "before": reference, "after": resumed, "tolerance": allowed,
            "passed": abs(resumed - reference) <= allowed}


def tolerance(before: list[float]) -> float:
    recent = before[-SPREAD_STEPS:]
    return max(RELATIVE_TOLERANCE * abs(mean(before[-RESUMED_STEPS:])), max(recent) - min(recent))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def overall(parts) -> bool | None:
    """False if a judged part failed, None if a part is pending, True when every part passed. A figure
    that could not be compared (no value on a side), or Adam's moments zero as the checkpoint's, fail
    nothing: the line says why they were not judged."""
    judged = [part for part in parts if part is not None]
    if any(part["passed"] is False for part in judged):
        return False
    if len(judged) < 3:
        return None
    return True


# ---- the words, for the front ends ------------------------------------------------------------------


def check_failed(record: dict | None) -> bool:
    return bool(record) and record.get("passed") is False


def check_line(record: dict) -> str:
    """One line: `resume check: passed: 40 steps left, 40 done; Adam state restored; first loss 0.41
    against 0.39 before (means of up to 3 steps, tolerance ±0.2)`; FAILED puts what failed first (a narrow terminal
    cuts the end), `pending` says what is not known yet."""
    verdict = {True: "passed", False: "FAILED", None: "pending"}[record.get("passed")]
    parts = [(record.get(key), words(record.get(key))) for key, words in PART_WORDS]
    parts.sort(key=lambda part: not (part[0] and part[0].get("passed") is False))  # stable: failed ones first
    return f"resume check: {verdict}: " + "; ".join(words for _, words in parts)


def steps_words(part: dict | None) -> str:
    if part is None:
        return "steps not over yet"
    words = f"{part['left']} steps left, {part['done']} done"
    if part["passed"]:
        return words
    if part["total"] is None:
        return f"{words} (the run's total is unknown)"
    return f"{words} (of {part['total']} in all, from the checkpoint at step {part['checkpoint_step']})"


def optimizer_words(part: dict | None) -> str:
    if part is None:
        return "optimizer not seen yet"
    if not part["adam"]:
        return f"{part['name']}: no optimizer state to restore"
    if part["passed"]:
        return "Adam state restored"
    if part["passed"] is None:
        return "Adam state zero, as the checkpoint's: every gradient norm logged up to it was 0"
    if part["with_moments"] < part["parameters"]:
        return (f"Adam state missing ({part['with_moments']} of {part['parameters']} parameters have moments: "
                "the checkpoint's optimizer state was not restored)")
    return (f"Adam state zero ({part['parameters'] - part['nonzero']} of {part['parameters']} parameters' moments "
            "are all zero)")


def figure_words(part: dict | None) -> str:
    if part is None:
        return "first steps not logged yet"
    name = label(part["name"])
    if part["passed"] is None:
        return f"{name} not compared: {part['reason']}"
    words = (f"first {name} {part['after']:.3g} against {part['before']:.3g} before (means of up to "
             f"{RESUMED_STEPS} steps, tolerance ±{part['tolerance']:.2g})")
    return words if part["passed"] else f"{words} out of tolerance"


PART_WORDS = (("steps", steps_words), ("optimizer", optimizer_words), ("figure", figure_words))
