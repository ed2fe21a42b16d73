"""The ranks' logs (RUN_DIR/logs/rank<R>.log, launcher.log), read incrementally by byte offset:
the TUI keeps the last lines of each (`LogTail`), the CLI prints them as they come (`read_lines`)."""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path

from gpuscale.runs.run_dir import RunDir


def world_size(run: dict) -> int | None:
    """How many ranks the run has: its device plan's ranks per node times its nodes, or for a run
    without a plan the rank logs it wrote; None when neither tells."""
    run_dir = Path(run.get("run_dir") or "")
    try:
        plan = json.loads(RunDir(run_dir).plan.read_text())
        return int(plan["nproc"]) * int((run.get("settings") or {}).get("nnodes") or 1)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ranks = [int(m.group(1)) for path in RunDir(run_dir).rank_logs()
             if (m := re.fullmatch(r"rank(\d+)\.log", path.name))]
    return max(ranks) + 1 if ranks and run.get("run_dir") else None


def read_lines(path: Path, offset: int, limit: int | None = None) -> tuple[list[str], int]:
    """The complete lines of `path` from byte `offset` on (at most `limit` bytes of it), and the offset
    after the last complete line: a line still being written is read next time, whole."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        data = handle.read() if limit is None else handle.read(limit)
    complete = data[: data.rfind(b"\n") + 1]
    return complete.decode(errors="replace").splitlines(), offset + len(complete)


class LogTail:
    """The last lines of each rank's log (and the launcher's), read incrementally by byte offset."""

    FIRST_READ_BYTES = 32 * 1024

    def __init__(self, log_dir: str | Path, keep_lines: int = 200):
        self.log_dir = Path(log_dir)
        self.keep_lines = keep_lines
        self._offsets: dict[str, int] = {}
        self._lines: dict[str, deque[str]] = {}

    def sources(self) -> list[str]:
        """`rank0`, `rank1`, ... by rank, then `launcher`."""
        ranks = sorted((s for s in self._lines if s.startswith("rank")), key=lambda s: int(s[4:] or 0))
        return ranks + [s for s in self._lines if not s.startswith("rank")]

    def read_new(self) -> int:
        """Read what the logs gained since the last call; returns how many lines were added."""
        added = 0
        for path in sorted(self.log_dir.glob("*.log")):
            source = path.stem
            if source == "supervisor" or not (source.startswith("rank") or source == "launcher"):
                continue
            added += self._read_file(path, source)
        return added

    def _read_file(self, path: Path, source: str) -> int:
        try:
            size = path.stat().st_size
        except OSError:
            return 0
        first_read = source not in self._offsets
        offset = max(0, size - self.FIRST_READ_BYTES) if first_read else self._offsets[source]
        if size <= offset:
            return 0
        lines, self._offsets[source] = read_lines(path, offset, size - offset)
        if offset and first_read and lines:
            lines = lines[1:]  # the first read started mid-line
        self._lines.setdefault(source, deque(maxlen=self.keep_lines)).extend(lines)
        return len(lines)

    def lines(self, source: str | None = None) -> list[str]:
        """The kept lines of one source, or of all (each prefixed with its source)."""
        if source is not None:
            return list(self._lines.get(source, ()))
        return [f"[{s}] {line}" for s in self.sources() for line in self._lines[s]]
