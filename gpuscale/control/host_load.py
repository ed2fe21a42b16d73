"""Whether a run about to start oversubscribes its host: the memory and the cores that the live
gpuscale runs of this host use, plus this one's. One line the front end prints at launch (a warning:
the run still starts; `--queue` is the way to wait instead).

Memory: what the host uses now (psutil: total less available) plus this run's expected share, taken
as the mean of what each live run's processes hold (their RSS; the processes found by the run mark
every one of them carries, runs/process.py), against the host's total. Cores: the ranks of the live
runs plus this run's, against the cores. Both against `share` of the host, GPUSCALE_OVERSUBSCRIBED_AT
(1.0, all of it, unless set).
"""

from __future__ import annotations

import os
import socket

import psutil

from gpuscale.control import run_queue
from gpuscale.runs.devices import usable_cores
from gpuscale.runs.process import RUN_DIR_ENV
from gpuscale.runs.settings import SettingsError

SHARE_ENV = "GPUSCALE_OVERSUBSCRIBED_AT"
GIB = 1024 ** 3


def warn_share(environ=os.environ) -> float:
    """The share of the host's memory or cores over which a launch warns."""
    text = environ.get(SHARE_ENV, "").strip()
    if not text:
        return 1.0
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not share >= 0:  # also NaN
        raise SettingsError(f"{SHARE_ENV}: {text!r}: expected a share of the host, 0 or more (1 = all of it)")
    return share


def rss_by_run(run_dirs: set[str]) -> dict[str, int]:
    """The resident memory of every process of each run (by its run folder), in one pass over the
    host's processes."""
    found = dict.fromkeys(run_dirs, 0)
    for process in psutil.process_iter() if found else ():
        try:
            run_dir = process.environ().get(RUN_DIR_ENV)
            if run_dir in found:
                found[run_dir] += process.memory_info().rss
        except psutil.Error:
            continue
    return found


def oversubscription(live: list[dict], ranks: int, environ=os.environ) -> str | None:
    """The warning for a run of `ranks` ranks starting beside `live` (the history's live runs), or
    None. Runs of other hosts, and runs still waiting in the queue, hold nothing here."""
    share = warn_share(environ)
    host = socket.gethostname()
    going = [run for run in live if run.get("host") == host and not run_queue.waits_in_queue(run)]
    rss = rss_by_run({run["run_dir"] for run in going if run.get("run_dir")})
    expected = sum(rss.values()) / len(rss) if rss else 0.0
    memory = psutil.virtual_memory()
    used = memory.total - memory.available + expected
    cores = usable_cores()
    ranks_here = ranks + sum(run_queue.Demand.of_run(run).ranks for run in going)
    over = []
    if used > share * memory.total:
        over.append(f"memory {used / GIB:.1f} of {memory.total / GIB:.1f} GiB (this run about "
                    f"{expected / GIB:.1f} GiB, as the {len(rss)} live run(s) each use)")
    if ranks_here > share * cores:
        over.append(f"{ranks_here} ranks on {cores} cores")
    if not over:
        return None
    return (f"warning: this host is oversubscribed with this run and {len(going)} live gpuscale run(s): "
            f"{'; '.join(over)} (over {share:.0%}, {SHARE_ENV}); `--queue` waits for free devices instead")
