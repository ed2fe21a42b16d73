"""Marking a step's phases inside a rank: `with phase("generate"): ...` from anywhere in the rank,
`switch(...)` from hooks that only see a phase's start (a TrainerCallback's), `lap(...)` from a
clock that names a phase once it has ended (eggroll's), and the rank's
Reporter, which owns the one `StepPhases` and closes a step at every `log`, writing the step's
phase -> seconds in that record (data/step_phases.py names them and summarises them).

A step is the time between two logged steps. Each change of phase is one mark: a `perf_counter` on
CPU, a CUDA event recorded on the current stream on a GPU (`use_cuda`). Nothing waits for the GPU
inside a step: a step's events are resolved at a `log` once its last event has completed
(`Event.query`, which does not wait), so on a GPU a phase's seconds are the stream's time between
its marks (work the CPU queued ahead counts where the GPU ran it). Phases nest: a phase opened
inside another takes the time until it closes, then the outer one goes on; time outside every
phase is `other`. Steps are closed only once a phase was marked, so a
recipe that names none logs no phase figures, and a logged step in which none was marked (all of it
`other`) is left out.

GPUSCALE_STEP_PHASES=0 in a run's environment (PHASES_ENV, read by `timing_on`) turns the timing off:
no mark is made and no phase figure logged, so that bench/step_phases.py can time the same run with
and without it. GPUSCALE_STEP_PHASES=alternate:K (read by `alternation`) times K logged steps, then
leaves K untimed, and so on (`timed_step`), so that one run's own steps tell what the timing costs,
free of the spread between runs (bench/RESULTS.md).

GPUSCALE_SLOW_RANK=RANK:SECONDS[:PHASE] (SLOW_RANK_ENV, read by `slow_rank`) is a test aid: rank RANK sleeps
SECONDS each time it enters phase PHASE (forward_backward unless given: each training pass), a straggler on
purpose, as a slower card would be, to see it named (data/step_phases.py's advice); it needs the timing on.
The other ranks then wait for it at their next collective (the gradient all-reduce: `wait`).

Waiting for the other ranks (`wait`) is told apart where it happens, without a sync: at every blocking
collective of torch.distributed the rank calls (`time_collectives`: accelerate's and TRL's gathers,
a recipe's own), and at DDP's gradient all-reduce, which runs inside the backward pass
(engines/trl_bridge.py marks it from the last gradient computed). On a GPU a collective's marks are
events on the compute stream around the call, which the stream reaches only once the collective is
done: the time is the wait for the slowest rank and the transfer.

No torch at import: it loads only where `use_cuda` is called.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gpuscale.data.step_phases import FORWARD_BACKWARD, OTHER, WAIT, figure_name

# The rank's StepPhases (its Reporter's), for `phase` and `switch`; None outside a rank, and where the
# timing is off.
_current: StepPhases | None = None

PHASES_ENV = "GPUSCALE_STEP_PHASES"
SLOW_RANK_ENV = "GPUSCALE_SLOW_RANK"


def timing_on(environ=os.environ) -> bool:
    """Whether a rank times its step phases: always, unless PHASES_ENV is "0" (the module's docstring)."""
    return environ.get(PHASES_ENV, "").strip() != "0"


def alternation(environ=os.environ) -> int:
    """K of PHASES_ENV's "alternate:K" (K >= 1), else 0: every step timed, or none."""
    value = environ.get(PHASES_ENV, "").strip()
    if not value.startswith("alternate:"):
        return 0
    k = value.partition(":")[2]
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"{PHASES_ENV}: {value!r}: alternate:K needs a whole K of at least 1")
    return int(k)


def timed_step(step: int, alternate: int) -> bool:
    """Whether logged step `step` (from 1) is timed under "alternate:K": steps 1..K yes, K+1..2K no, ..."""
    return alternate == 0 or (step - 1) // alternate % 2 == 0


def slow_rank(rank: int, environ=os.environ) -> tuple[str, float] | None:
    """(phase, seconds): how SLOW_RANK_ENV (RANK:SECONDS[:PHASE]) asks rank `rank` to be slowed; None
    for the other ranks and where it is not set. A malformed value is refused: a test aid that silently
    did nothing would pass for a run without a straggler."""
    value = environ.get(SLOW_RANK_ENV, "").strip()
    if not value:
        return None
    try:
        slowed, seconds, *named = value.split(":")
        if len(named) > 1:
            raise ValueError
        slowed_rank, seconds = int(slowed), float(seconds)
    except ValueError:
        raise ValueError(f"{SLOW_RANK_ENV}={value}: expected RANK:SECONDS[:PHASE], e.g. 1:0.5") from None
    return (named[0] if named else FORWARD_BACKWARD, seconds) if slowed_rank == rank else None


class WallClock:
    """The CPU's marks: perf_counter seconds, always complete."""

    def mark(self) -> float:
        return time.perf_counter()

    def done(self, mark) -> bool:
        return True

    def seconds(self, start, end) -> float:
        return end - start

    def wait(self, mark) -> None:
        pass

    def release(self, mark) -> None:
        pass


class CudaClock:
    """A GPU's marks: timing events recorded on the current stream, kept in a pool for reuse (an
    event is created once, not every step)."""

    def __init__(self, device):
        import torch

        self._torch, self._device, self._free = torch, device, []

    def mark(self):
        event = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(self._device))
        return event

    def done(self, mark) -> bool:
        return mark.query()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000

    def wait(self, mark) -> None:
        mark.synchronize()

    def release(self, mark) -> None:
        self._free.append(mark)


class StepPhases:
    """A rank's phase marks, step by step. `marks` of the open step: (mark, phase the time from it
    on goes to); `finish(step)` closes it, `ready()` hands back the closed steps whose marks have
    completed as (step, {phase: seconds})."""

    def __init__(self, clock=None):
        self.clock = clock or WallClock()
        self._stack: list[str] = []
        self._marks: list[tuple[object, str]] = []
        self._closed: list[tuple[int, list[tuple[object, str]]]] = []
        self.slowed: tuple[str, float] | None = None  # (phase, seconds): SLOW_RANK_ENV's test aid

    @property
    def in_phase(self) -> bool:
        """Whether a phase is open (the time now is not `other`)."""
        return bool(self._stack)

    def use_cuda(self, device) -> None:
        """Mark with CUDA events on `device`'s current stream (before any phase is marked)."""
        self.clock = CudaClock(device)

    def enter(self, name: str) -> None:
        self._stack.append(name)
        self._mark(name)
        self._entered(name)

    def exit(self) -> None:
        if self._stack:
            self._stack.pop()
        self._mark(self._stack[-1] if self._stack else OTHER)

    def switch(self, name: str) -> None:
        """The outermost phase is now `name` (a phase opened inside it keeps the time until it closes)."""
        if self._stack:
            self._stack[0] = name
        else:
            self._stack.append(name)
        if len(self._stack) == 1:
            self._mark(name)
            self._entered(name)

    def lap(self, name: str) -> None:
        """The time since the last mark was phase `name`; from now on, the phase open goes on (a
        clock that names a phase once it has ended: eggroll's laps)."""
        if self._marks:
            self._marks[-1] = (self._marks[-1][0], name)
        self._mark(self._stack[-1] if self._stack else OTHER)

    def restart(self, name: str = OTHER) -> None:
        """A step starts now, in phase `name`: the time since the last logged step is dropped (a
        trainer's set-up is no step)."""
        for mark, _ in self._marks[1:]:
            self.clock.release(mark)
        self._marks = []
        self._stack = [] if name == OTHER else [name]
        self._mark(name)

    def finish(self, step: int) -> None:
        """Close the open step as logged step `step`; the next starts at once, in the phase open now."""
        if not self._marks:  # no phase marked yet: the recipe names none
            return
        end = self.clock.mark()
        self._closed.append((step, [*self._marks, (end, OTHER)]))
        self._marks = [(end, self._stack[-1] if self._stack else OTHER)]

    def ready(self, wait: bool = False) -> list[tuple[int, dict[str, float]]]:
        """The closed steps whose marks have all completed, oldest first, as (step, phase ->
        seconds); the others stay for a later call. `wait=True` waits for them (at the rank's end)."""
        done = []
        while self._closed:
            step, marks = self._closed[0]
            last = marks[-1][0]
            if wait:
                self.clock.wait(last)
            elif not self.clock.done(last):
                break
            self._closed.pop(0)
            seconds = self._seconds(marks)
            if set(seconds) != {OTHER}:  # a step in which nothing was marked is not one the recipe times
                done.append((step, seconds))
        return done

    def _seconds(self, marks: list[tuple[object, str]]) -> dict[str, float]:
        seconds: dict[str, float] = {}
        for (start, name), (end, _) in zip(marks, marks[1:]):
            seconds[name] = seconds.get(name, 0.0) + self.clock.seconds(start, end)
        for mark, _ in marks[:-1]:  # the last mark opens the next step
            self.clock.release(mark)
        return seconds

    def _mark(self, name: str) -> None:
        self._marks.append((self.clock.mark(), name))

    def _entered(self, name: str) -> None:
        """SLOW_RANK_ENV's sleep, on entering its phase (not on coming back to it from one inside it)."""
        if self.slowed and name == self.slowed[0]:
            time.sleep(self.slowed[1])


# torch.distributed's collectives: a call without async_op=True returns once the others have joined in.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "gather", "gather_object",
               "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "scatter", "scatter_object_list", "barrier")


def time_collectives(dist) -> None:
    """Time every blocking call of `dist`'s (torch.distributed's) COLLECTIVES as phase WAIT of the
    rank's step, from now on in this process, where a phase is open (outside every phase the recipe
    times no step: the set-up's collectives, and those after its last step, stay out of the steps, as
    they were; a call given async_op=True is left alone: its wait comes later, where the caller waits)."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None and not getattr(original, "timed_as_wait", False):
            setattr(dist, name, _timed_as_wait(original))


def _timed_as_wait(collective):
    @functools.wraps(collective)
    def timed(*args, **kwargs):
        if kwargs.get("async_op") or _current is None or not _current.in_phase:
            return collective(*args, **kwargs)
        with phase(WAIT):
            return collective(*args, **kwargs)

    timed.timed_as_wait = True
    return timed


def figures(seconds: dict[str, float]) -> dict[str, float]:
    """A step's phase -> seconds as the figures of its record (data/step_phases.py's names)."""
    return {figure_name(name): value for name, value in seconds.items()}


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase `name` of the rank's current step (nothing outside a rank)."""
    timer = _current
    if timer is None:
        yield
        return
    timer.enter(name)
    try:
        yield
    finally:
        timer.exit()


def switch(name: str) -> None:
    """`StepPhases.switch` on the rank's timer (nothing outside a rank)."""
    if _current is not None:
        _current.switch(name)


def lap(name: str) -> None:
    """`StepPhases.lap` on the rank's timer (nothing outside a rank)."""
    if _current is not None:
        _current.lap(name)


def restart(name: str = OTHER) -> None:
    """`StepPhases.restart` on the rank's timer (nothing outside a rank)."""
    if _current is not None:
        _current.restart(name)
