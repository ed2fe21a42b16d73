"""A rank's heartbeat, the words both sides use: the rank writes it (engines/reporter.py:Reporter.beat,
into the metric file it already writes), the supervisor reads it (control/hang_watch.py) and ends a
run none of whose ranks has advanced for its `hang_timeout`.

A heartbeat line is `{"t": ..., "rank": R, "step": S, "beat": PHASE}`. Every line a rank writes is a
sign that it advanced (a step logged, a summary, a beat); the beat says besides what the rank is doing
now, which sets how long it may stay silent (`hang_watch.allowance`).

GPUSCALE_HEARTBEATS=0 in a run's environment (HEARTBEATS_ENV, read by `beats_on`) keeps its ranks from
writing beats: a bench and test aid, so that bench/heartbeat_cost.py can time the same run with and
without them. Their other lines still tell the supervisor that they advance, but a long evaluation or
save, which only beats show, may then be taken for a hang. `hang_timeout=off` stops the supervisor's
watch only: the ranks beat all the same.
"""

from __future__ import annotations

import os
import signal

from gpuscale.data.step_phases import EVALUATE, SAVE

# What a rank is doing. LOADING: from its start to its first step (imports, the model, the data, the
# process group); STEP: a training step or a generation batch, the work whose pace is measured;
# EVALUATE: a held-out evaluation (a beat per batch); SAVE: a checkpoint or the trained model written
# (the step phases' words for the same things: data/step_phases.py).
LOADING, STEP = "loading", "step"
PHASES = (LOADING, STEP, EVALUATE, SAVE)

# The key of a heartbeat line that holds the phase.
BEAT_KEY = "beat"

# A rank writes at most one beat a second in the same phase (a change of phase is written at once):
# a step of a few milliseconds costs no line each, and the supervisor, which looks once a tick, loses
# nothing.
BEAT_EVERY_S = 1.0

# The signal on which a rank writes every thread's Python stack to RunDir.stacks(rank) (faulthandler,
# which writes from the signal handler itself: a rank blocked in C code, a collective, still answers;
# a stopped one cannot). SIGUSR1 is SLURM's preemption (engines/preemption.py); torchrun and accelerate
# forward SIGTERM, SIGINT, SIGHUP and SIGQUIT.
STACKS_SIGNAL = signal.SIGUSR2


HEARTBEATS_ENV = "GPUSCALE_HEARTBEATS"


def beats_on(environ=os.environ) -> bool:
    """Whether a rank writes heartbeats: always, unless HEARTBEATS_ENV is "0" (the module's docstring)."""
    return environ.get(HEARTBEATS_ENV, "").strip() != "0"
