"""Process plumbing shared by the launcher, the supervisor and the ranks (Linux).

Every process of a run carries GPUSCALE_RUN_DIR in its environment. That is how a run's processes
are found again after their parent died and they were re-parented: `run_processes(run_dir)`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

RUN_DIR_ENV = "GPUSCALE_RUN_DIR"
# A private run's umask: its folders 0700 and its files 0600, whatever the user's umask says.
PRIVATE_UMASK = 0o077
_PR_SET_PDEATHSIG = 1


@contextmanager
def private_files(private: bool) -> Iterator[None]:
    """With `private`, what this process creates inside the block is its user's alone (umask 077:
    folders 0700, files 0600), and so is everything a process started inside it creates, for as long as
    that process lives (a child inherits the umask at its start): the supervisor, the launcher and the
    ranks of a run. The umask is the whole process's, so the block is kept short: the run folder's
    first files and the supervisor's start. It only ever narrows the modes, so another thread's file made
    meanwhile is at worst more private. Without `private` nothing changes: files follow the user's umask."""
    if not private:
        yield
        return
    before = os.umask(PRIVATE_UMASK)  # reading the umask means setting it
    os.umask(before | PRIVATE_UMASK)  # a stricter umask of the user's stays as strict
    try:
        yield
    finally:
        os.umask(before)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the next front end's sweep still cleans up


def process_alive(pid: int | None, started: float | None) -> bool:
    """True if `pid` runs and is the same process (same start time) as the one recorded."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.Error:
        return False


def run_processes(run_dir: str, exclude: set[int] | None = None) -> list[psutil.Process]:
    """Every live process whose environment marks it as part of the run at `run_dir`."""
    exclude = exclude or set()
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in exclude or proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(RUN_DIR_ENV) == run_dir and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_run_processes(run_dir: str, exclude: set[int] | None = None, timeout: float = 5.0) -> int:
    """SIGKILL every process of the run and wait for them to go; returns how many there were."""
    procs = run_processes(run_dir, exclude)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)
    return len(procs)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for(condition, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
