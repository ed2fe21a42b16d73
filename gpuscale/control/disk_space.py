"""Room on GPUSCALE_HOME's file system: the check before a run starts, the room a run's supervisor
keeps to record its end, and the one line that names a full disk wherever one is met (the launch, the
supervisor, the history, `gpuscale doctor`).

A run writes its history rows, logs, metrics and results under GPUSCALE_HOME, a training run its model
and checkpoints too. A run is refused before anything is recorded or started where the file system
holds less than `min_free_bytes()` (MIN_FREE_MB, or GPUSCALE_MIN_FREE_MB): enough for a CPU run's
files and history rows many times over, not for a large model's checkpoints, which a run that fills
the disk later ends `failed` on, with the same line.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
from pathlib import Path

from gpuscale.runs.settings import SettingsError

# A small run's folder and history rows take a few MB (a 2-rank CPU sft run of the embedded model: its
# model and logs, about 25 MB); 64 MB leaves room for them and for SQLite's write-ahead log.
MIN_FREE_MB = 64
MIN_FREE_ENV = "GPUSCALE_MIN_FREE_MB"
# Kept by a run's supervisor while the run lives (`keep_room`) and freed before it records the end
# (`free_room`), so that a run that filled the disk still ends `failed` saying so: run.json's end (a few
# KB with the summary) and the history's rows for it (a few SQLite pages in its write-ahead log).
END_RESERVE_BYTES = 2**20
# What a process says when it met a full disk (a rank's error line, SQLite's, torch.save's).
DISK_FULL_WORDS = ("no space left on device", "disk quota exceeded", "database or disk is full",
                   "file write failed")
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def min_free_bytes(environ=os.environ) -> int:
    """The room a run needs to start: MIN_FREE_MB, or GPUSCALE_MIN_FREE_MB where it is set (a whole
    number of MB, 0 to turn the check off). A value that is not one is refused, naming it."""
    text = environ.get(MIN_FREE_ENV, "").strip()
    if not text:
        return MIN_FREE_MB * 2**20
    if not text.isdigit():
        raise SettingsError(f"{MIN_FREE_ENV}: {text!r}: expected a whole number of MB (0 turns the check off)")
    return int(text) * 2**20


def existing_part(path: Path) -> Path:
    """`path`, or its nearest folder that exists (a home not made yet lives where it will be made)."""
    path = Path(path).absolute()
    while not os.path.exists(path) and path != path.parent:  # False where it cannot be looked at, too
        path = path.parent
    return path


def file_system(path: Path) -> str:
    """The file system holding `path`, as `df` names it: its type and mount point ("ext4 on /home")."""
    import psutil  # only when a full disk is named: the TUI's first frame opens the store without it

    where = os.path.realpath(existing_part(path))
    mounts = [part for part in psutil.disk_partitions(all=True)
              if where == part.mountpoint or where.startswith(part.mountpoint.rstrip("/") + "/")]
    if not mounts:
        return "its file system"
    mount = max(mounts, key=lambda part: len(part.mountpoint))
    return f"{mount.fstype} on {mount.mountpoint}"


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_part(path)).free


def size_text(count: float) -> str:
    """Bytes for a person: 0 B, 812 KB, 63.9 MB, 1.2 GB (powers of 1,024, as `df -h`)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1024 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" or count >= 100 else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def disk_full_line(home: Path, needed: int | None = None) -> str:
    """One line: GPUSCALE_HOME's file system, the room left on it and the room a run needs."""
    usage = shutil.disk_usage(existing_part(home))
    needed = min_free_bytes() if needed is None else needed
    return (f"GPUSCALE_HOME {home}: its file system ({file_system(home)}) has {size_text(usage.free)} free of "
            f"{size_text(usage.total)}; a run needs at least {size_text(needed)} there ({MIN_FREE_ENV}): "
            "free some space, or point GPUSCALE_HOME at another file system")


def short_of_room(home: Path) -> bool:
    """Whether `home`'s file system holds less than a run needs to start."""
    return free_bytes(home) < min_free_bytes()


def is_disk_full(error: BaseException) -> bool:
    """An OS error of a full disk or quota, or SQLite's SQLITE_FULL."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    if isinstance(error, sqlite3.DatabaseError) and getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return True
    return mentions_disk_full(str(error))


def mentions_disk_full(text: str) -> bool:
    lowered = text.lower()
    return any(words in lowered for words in DISK_FULL_WORDS)


def keep_room(reserve: Path) -> bool:
    """Set END_RESERVE_BYTES aside in the file `reserve` (allocated, not a sparse file); False where
    there is no room for it."""
    try:
        with open(reserve, "wb") as file:
            os.posix_fallocate(file.fileno(), 0, END_RESERVE_BYTES)
    except OSError:
        reserve.unlink(missing_ok=True)
        return False
    return True


def free_room(reserve: Path) -> None:
    reserve.unlink(missing_ok=True)
