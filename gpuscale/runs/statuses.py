"""A run's statuses, the one declaration: what the history records of a run (control/store.py), what
the front ends filter and mark by, and which runs are still live. On the every-process floor so that
every floor above `data/` may name them (the login node's store, the app, the bench scripts)."""

from __future__ import annotations

# A run not yet ended: queued (recorded, its supervisor starting, or with `--queue` waiting its turn:
# control/run_queue.py) or running.
LIVE_STATUSES = ("queued", "running")
# Every status a run may have, the live ones first; the others are ends.
STATUSES = (*LIVE_STATUSES, "succeeded", "failed", "stopped", "lost", "preempted")
