"""Rank metrics, the writing side: `Reporter.log(step=..., tokens=..., loss=...)` appends one line per
call to RUN_DIR/metrics/rank<R>.jsonl; standard names are tokens and samples (counts done since the
last call), loss, reward, accuracy, and any other scalar. `Reporter.summary({...})` writes the rank's
final figures (rank 0's is the run's summary); a summary may be written in parts as the figures come
(`partial=True`), each later part merged over the earlier ones, so that a rank that dies keeps the
figures it had measured. A plain file keeps ranks free of database locks and
works the same on every node. The supervisor reads the files back with `gpuscale.control.metrics_tail`.

The same file carries the rank's heartbeat (runs/heartbeat.py): every line it writes says the rank
advanced, and `beat(phase)` (anywhere in the rank: the module's `beat` finds the rank's Reporter) says
what it is doing now, loading, a step, an evaluation or a save, without a line per call.

It also owns the rank's step phases (engines/step_phases.py): every `log` closes the step since the
previous one and writes each phase's seconds into the record of the step they belong to, that one
if its marks have completed (always on CPU), else a line of its own at a later `log` or at `close`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from gpuscale.engines import step_phases
from gpuscale.runs import heartbeat
from gpuscale.runs.run_dir import RunDir

# The rank's Reporter, for `beat` (one a process: the rank's; the latest made, in a test).
_current: Reporter | None = None


class Reporter:
    def __init__(self, run_dir: str | Path, rank: int):
        global _current
        self.rank = rank
        path = RunDir(run_dir).metrics(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered: the supervisor sees each line at once. Held for the rank's life; close() ends it.
        self._file = open(path, "a", buffering=1)  # noqa: SIM115
        fault = _parse_fault(os.environ.get("GPUSCALE_INJECT_FAULT"), rank)
        # Faults at a named point of a recipe (POINT_FAULTS) fire there, not at a logged step.
        self._fault = fault if fault and fault[0] not in POINT_FAULTS else None
        self._step, self._phase, self._written_at = 0, "", 0.0
        self._beats = heartbeat.beats_on()  # off only to time what they cost (bench/heartbeat_cost.py)
        self.phases = step_phases.StepPhases()
        _current = self
        # Timing off (a bench aid): no phase is marked, so no step closes and none is logged.
        self._timing = step_phases.timing_on()
        step_phases._current = self.phases if self._timing else None
        self._alternate = step_phases.alternation()  # K: K steps timed, K not (a bench aid), 0: not alternating
        self.phases.slowed = step_phases.slow_rank(rank)  # a straggler on purpose (a test aid)
        self.beat(heartbeat.LOADING)

    def log(self, step: int, **scalars: float) -> None:
        record = {"t": time.time(), "rank": self.rank, "step": int(step)}
        record.update({k: float(v) for k, v in scalars.items() if v is not None})
        self._step, self._phase = int(step), heartbeat.STEP  # a logged step: the rank is stepping
        if self._timing:  # an untimed step closes nothing: its time would go to the phase left open
            self.phases.finish(int(step))
        record.update(self._phase_figures(int(step)))
        self._write(record)
        if self._alternate:
            self._time_next_step_or_not(int(step) + 1)
        self._maybe_fail(step)

    def _phase_figures(self, step: int, wait: bool = False) -> dict[str, float]:
        """The phase figures of `step` if they are ready; those of earlier steps ready only now are
        written as lines of their own."""
        own = {}
        for done, seconds in self.phases.ready(wait):
            if done == step:
                own = step_phases.figures(seconds)
            else:
                self._write({"t": time.time(), "rank": self.rank, "step": done, **step_phases.figures(seconds)})
        return own

    def _time_next_step_or_not(self, step: int) -> None:
        """Under "alternate:K": mark the phases of logged step `step` or not. A timed stretch starts
        afresh here (`restart`): what was marked before it, or left open, is no step of its."""
        timed = step_phases.timed_step(step, self._alternate)
        if timed and not self._timing:
            self.phases.restart()
        self._timing = timed
        step_phases._current = self.phases if timed else None

    def beat(self, phase: str, step: int | None = None) -> None:
        """The rank advanced, and is now in `phase` (runs/heartbeat.py), at `step` (None: the step it
        last logged or beat). Written at once on a change of phase, else at most every BEAT_EVERY_S."""
        if not self._beats:
            return
        now = time.time()
        self._step = self._step if step is None else int(step)
        if phase == self._phase and now - self._written_at < heartbeat.BEAT_EVERY_S:
            return
        self._phase = phase
        self._write({"t": now, "rank": self.rank, "step": self._step, heartbeat.BEAT_KEY: phase})

    def total(self, steps: int) -> None:
        """How many steps this rank will log in all: the front ends show progress and ETA from it."""
        self._write({"t": time.time(), "rank": self.rank, "step": 0, "total": steps})

    def summary(self, figures: dict[str, Any], partial: bool = False) -> None:
        """The rank's final figures. `partial=True`: the figures known so far (the run goes on); the
        reader merges each summary record over the earlier ones, and a run that ends after a partial
        one only keeps them marked partial."""
        record = {"t": time.time(), "rank": self.rank, "summary": figures}
        if partial:
            record["partial"] = True
        self._write(record)

    def close(self) -> None:
        global _current
        # The steps still waiting for their marks: the rank is done (a rank that died of a CUDA error
        # may not have them: its error is the one to keep).
        with contextlib.suppress(RuntimeError):
            self._phase_figures(-1, wait=True)
        self._file.close()
        if _current is self:
            _current, step_phases._current = None, None

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._written_at = record["t"]

    def _maybe_fail(self, step: int) -> None:
        # Fault injection, for testing failure handling end to end: GPUSCALE_INJECT_FAULT=RANK:KIND:STEP
        if self._fault and step >= self._fault[1]:
            kind = self._fault[0]
            if kind == "slow":  # a step that takes a second: a test can signal the run mid-training
                time.sleep(1.0)
                return
            if kind == "oom":
                import torch

                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected fault)")
            if kind == "kill":  # as the kernel's out-of-memory killer ends a rank: no error file, no traceback
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")


def beat(phase: str, step: int | None = None) -> None:
    """`Reporter.beat` on this rank's Reporter, from code that is not handed it (the evaluation's
    batches, a checkpoint's writing); nothing outside a rank."""
    if _current is not None:
        _current.beat(phase, step)


# Fault kinds that fire at a named point of a recipe rather than at a logged step: the final held-out
# evaluation (after training and saving), and a reward function that turns NaN from STEP on.
POINT_FAULTS = ("final_eval", "nan_reward")


def injected_fault(kind: str, rank: int) -> int | None:
    """The step from which GPUSCALE_INJECT_FAULT=RANK:KIND:STEP asks for fault `kind` on this rank,
    None if it does not."""
    fault = _parse_fault(os.environ.get("GPUSCALE_INJECT_FAULT"), rank)
    return fault[1] if fault and fault[0] == kind else None


def fail_if_injected(kind: str, rank: int) -> None:
    """Raise the injected fault `kind` here, if GPUSCALE_INJECT_FAULT asks for it on this rank."""
    if injected_fault(kind, rank) is not None:
        raise RuntimeError(f"injected fault on rank {rank} at {kind}")


class NonFiniteFigure(FloatingPointError):
    """A training figure turned NaN or Inf. Its message is one line, the run's error as it is shown."""


def non_finite_message(step: int, figure: str, value: float, cause: str = "training diverged",
                       remedies: str = "--precision fp32, a lower learning_rate, or max_grad_norm") -> str:
    """The one line a run that turned NaN or Inf fails with, the same for every recipe:
    `step 168: grad_norm is nan (training diverged); try --precision fp32, a lower learning_rate, or
    max_grad_norm`."""
    shown = "nan" if value != value else ("inf" if value > 0 else "-inf")
    return f"step {step}: {figure} is {shown} ({cause}); try {remedies}"


def _parse_fault(spec: str | None, rank: int) -> tuple[str, int] | None:
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 3 or int(parts[0]) != rank:
        return None
    return parts[1], int(parts[2])
