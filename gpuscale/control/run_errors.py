"""What a failed run died of, read from its folder: one line naming the rank (`first_error`), never the
launcher's wrapper, and a hint where the error suggests one (`hint_for`). The supervisor records them
at a run's end; `gpuscale doctor` reads them from the folder of a run it rebuilds."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from gpuscale.runs.run_dir import RunDir

# The launchers' own exceptions: they only say that a rank failed, never why.
LAUNCHER_WRAPPERS = ("ChildFailedError", "CalledProcessError")
# The last line of a Python traceback: `package.module.SomeError: message` (or a bare exception name).
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)\b(?::.*)?$")
# torchrun's table of failed ranks: `rank : 1 (local_rank: 1)` then `exitcode : -9 (pid: 123)`.
FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
# accelerate's one process (no torchrun): its CalledProcessError says how the process ended.
ONE_PROCESS_KILLED = re.compile(r"died with <Signals\.SIG\w+: (\d+)>")
ONE_PROCESS_EXITED = re.compile(r"returned non-zero exit status (\d+)")


def first_error(run_dir: Path, exit_code: int, direct_rank: bool = False) -> tuple[str, str | None]:
    """The error the run died of, one line naming the rank, never the launcher's wrapper
    (`ChildFailedError:`, `CalledProcessError`), which only says that a rank failed. `direct_rank`: the
    run's one rank was started without a launcher (control/launch.py:launcher_argv), so `exit_code` is
    rank 0's own and launcher.log holds what it wrote before it opened its log. In order:

    1. a rank the kernel killed (SIGKILL in torchrun's table, no error file of its own): the others'
       errors are only their peer going away;
    2. the first error a rank recorded (errors/rank<R>.json, by time);
    3. the last exception line of a rank's log: a rank that died before it could record one;
    4. the launcher log's last error line that is not a wrapper, else how the launcher ended."""
    folder = RunDir(run_dir)
    recorded = _error_records(folder)
    launcher_text = folder.launcher_log.read_text(errors="replace") if folder.launcher_log.exists() else ""
    failed = [(0, exit_code)] if direct_rank and exit_code else _failed_ranks(launcher_text)
    for rank, code in failed:
        if code == -signal.SIGKILL and rank not in {record["rank"] for record in recorded}:
            return f"rank {rank}: killed by SIGKILL with no error of its own", OOM_KILLER_HINT
    if recorded:
        first = min(recorded, key=lambda record: record["t"])
        return f"rank {first['rank']}: {first['message']}", None
    for rank in _ranks_in_failure_order(folder, failed):
        line = last_exception_line(folder.log(rank))
        if line:
            return f"rank {rank}: {line}", None
    writer = "rank 0: " if direct_rank else ""  # launcher.log is then the rank's output before its own log
    for line in reversed(launcher_text.splitlines()):
        if ("Error" in line or "error:" in line) and not any(wrapper in line for wrapper in LAUNCHER_WRAPPERS):
            return writer + line.strip(), None
    for rank, code in failed:
        if code < 0:
            return f"rank {rank}: killed by signal {-code} ({_signal_name(-code)})", None
        return f"rank {rank}: exited with code {code} and no error message (see gpuscale logs)", None
    if exit_code < 0:
        return f"launcher killed by signal {-exit_code}", None
    return f"launcher exited with code {exit_code}", None


OOM_KILLER_HINT = ("the kernel's out-of-memory killer ends a process with SIGKILL: `dmesg` says whether it did; "
                   "lower batch_size or the data's longest question, or run fewer ranks")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def _error_records(folder: RunDir) -> list[dict]:
    records = []
    for path in folder.error_files():
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return records


def _failed_ranks(launcher_text: str) -> list[tuple[int, int]]:
    """(rank, exit code) of each failed rank in torchrun's table, the root cause first (torchrun
    prints it last), or of accelerate's single process (rank 0); exit codes below 0 are signals."""
    table = [(int(rank), int(code)) for rank, code in reversed(FAILED_RANK.findall(launcher_text))]
    if table:
        return table
    if killed := ONE_PROCESS_KILLED.search(launcher_text):
        return [(0, -int(killed.group(1)))]
    if exited := ONE_PROCESS_EXITED.search(launcher_text):
        return [(0, int(exited.group(1)))]
    return []


def _ranks_in_failure_order(folder: RunDir, failed: list[tuple[int, int]]) -> list[int]:
    """Ranks to look for an error in: the failed ones (`_failed_ranks`: those torchrun's table names, the
    root cause first), then every rank with a log."""
    named = [rank for rank, _code in failed]
    logged = sorted(int(path.stem.removeprefix("rank")) for path in folder.rank_logs())
    return list(dict.fromkeys(named + logged))


def last_exception_line(log: Path) -> str | None:
    """The last line of a rank's log that ends a Python traceback (`SomeError: message`), else None."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if EXCEPTION_LINE.match(line.strip()) and not any(wrapper in line for wrapper in LAUNCHER_WRAPPERS):
            return line.strip()
    return None


def hint_for(error: str, settings: dict) -> str | None:
    text = error.lower()
    if "out of memory" in text or "outofmemoryerror" in text:
        size = settings.get("batch_size")
        smaller = max(1, size // 2) if isinstance(size, int) else None
        return f"out of GPU memory: lower batch_size (now {size}; try {smaller})" if smaller else "lower batch_size"
    if "address already in use" in text:
        return "the rendezvous port is taken: pick another --rdzv-endpoint port"
    return None
