"""A rank's heartbeat, the words both sides use: the rank writes it (engines/reporter.py:Reporter.beat,
into the metric file it already writes), the supervisor reads it (control/hang_watch.py) and ends a
run none of whose ranks has advanced for its `hang_timeout`.

A heartbeat line is `{"t": ..., "rank": R, "step": S, "beat": PHASE}`. Every line a rank writes is a
sign that it advanced (a step logged, a summary, a beat); the beat says besides what the rank is doing
now, which sets how long it may stay silent (`hang_watch.allowance`).
"""

from __future__ import annotations

import signal

# What a rank is doing. LOADING: from its start to its first step (imports, the model, the data, the
# process group); STEP: a training step or a generation batch, the work whose pace is measured;
# EVALUATE: a held-out evaluation (a beat per batch); SAVE: a checkpoint or the trained model written.
LOADING, STEP, EVALUATE, SAVE = "loading", "step", "evaluate", "save"
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
