"""The run history: one SQLite file (WAL) under GPUSCALE_HOME, read and written through sqlite-utils.

Every front end and every supervisor opens its own connection; WAL lets several runs write at once
while the TUI reads. The schema carries a version; `MIGRATIONS[i]` takes a database from version i to
i + 1, so an old runs.db is upgraded in place and nothing stored is lost.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import sys
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported for real by _sqlite_utils(), off the TUI's first frame
    import sqlite_utils


@functools.cache
def _sqlite_utils():
    """Imported when the first Store opens, off the TUI's first frame. sqlite-utils imports pandas and
    numpy when they are installed, for features gpuscale does not use; that costs about half a
    second, so they are hidden meanwhile."""
    hidden = [name for name in ("pandas", "numpy") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        import sqlite_utils
    finally:
        for name in hidden:
            sys.modules.pop(name, None)
    return sqlite_utils


STATUSES = ("queued", "running", "succeeded", "failed", "stopped", "lost")
# Per-item results a recipe may merge into its run folder (one JSON object a line).
RESULTS_FILE = "results.jsonl"
LIVE_STATUSES = ("queued", "running")


def gpuscale_home() -> Path:
    if os.environ.get("GPUSCALE_HOME"):
        return Path(os.environ["GPUSCALE_HOME"]).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "gpuscale"


def _v1(db: sqlite_utils.Database) -> None:
    db["runs"].create(
        {
            "id": int, "recipe": str, "status": str, "settings": str, "summary": str,
            "error": str, "hint": str, "created_at": float, "started_at": float, "ended_at": float,
            "supervisor_pid": int, "supervisor_started": float, "launcher_pid": int,
            "exit_code": int, "run_dir": str, "command": str, "host": str, "progress": str,
        },
        pk="id",
    )
    db["metrics"].create(
        {"run_id": int, "rank": int, "t": float, "step": int, "name": str, "value": float},
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["metrics"].create_index(["run_id", "name", "t"])
    db["samples"].create(
        {
            "run_id": int, "t": float, "kind": str, "idx": int, "name": str,
            "mem_used_mb": float, "mem_total_mb": float, "util": float, "power_w": float,
            "temp_c": float, "sm_clock_mhz": float, "run_mem_mb": float,
        },
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["samples"].create_index(["run_id", "t"])


MIGRATIONS = [_v1]
METRIC_COLUMNS = ("run_id", "rank", "t", "step", "name", "value")
SAMPLE_COLUMNS = ("run_id", "t", "kind", "idx", "name", "mem_used_mb", "mem_total_mb", "util", "power_w",
                  "temp_c", "sm_clock_mhz", "run_mem_mb")
SCHEMA_VERSION = len(MIGRATIONS)


def _enable_wal(conn: sqlite3.Connection, attempts: int = 100) -> None:
    """Put the file in WAL mode, once: asking again on every open needs a lock for which SQLite
    does not always wait (busy_timeout), so two processes opening the store at the same moment
    (two runs started at once) could fail with "database is locked". Retried briefly."""
    for attempt in range(attempts):
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode = wal")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or attempt == attempts - 1:
                raise
            time.sleep(0.05)


class UnknownRun(LookupError):
    def __init__(self, run_id: Any):
        super().__init__(f"run id: {run_id!r}: no such run (see `gpuscale runs`)")


class Store:
    """Thin layer over runs.db; all JSON columns are decoded on the way out."""

    def __init__(self, home: Path | None = None):
        self.home = Path(home) if home else gpuscale_home()
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "runs").mkdir(exist_ok=True)
        conn = sqlite3.connect(self.home / "runs.db", timeout=30, isolation_level=None)
        conn.execute("PRAGMA busy_timeout = 30000")
        _enable_wal(conn)
        self.db = _sqlite_utils().Database(conn)
        # WAL + NORMAL: a crash never corrupts the file; at worst the last tick is lost on power loss.
        conn.execute("PRAGMA synchronous = NORMAL")
        self._migrate()

    def close(self) -> None:
        self.db.conn.close()

    @contextmanager
    def transaction(self):
        """One SQLite transaction (the connection is in autocommit mode otherwise)."""
        self.db.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.conn.execute("ROLLBACK")
            raise
        self.db.conn.execute("COMMIT")

    def _migrate(self) -> None:
        with self.transaction():  # a half-migrated file is never left behind
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = self.db.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row else 0
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.home / 'runs.db'}: schema version {version} is newer than this gpuscale "
                    f"({SCHEMA_VERSION}); upgrade gpuscale"
                )
            for migrate in MIGRATIONS[version:]:
                migrate(self.db)
            self.db.execute("DELETE FROM schema_version")
            self.db.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION])

    # ---- runs -------------------------------------------------------------------------------

    def create_run(self, recipe: str, settings: dict, command: list[str], host: str) -> int:
        with self.transaction():
            run_id = self.db["runs"].insert(
                {
                    "recipe": recipe, "status": "queued", "settings": json.dumps(settings),
                    "summary": "{}", "created_at": time.time(), "command": json.dumps(command),
                    "host": host,
                }
            ).last_pk
            run_dir = self.home / "runs" / str(run_id)
            self.db["runs"].update(run_id, {"run_dir": str(run_dir)})
        return run_id

    def update_run(self, run_id: int, **fields: Any) -> None:
        for key in ("summary", "progress", "settings", "command"):
            if key in fields and not isinstance(fields[key], str):
                fields[key] = json.dumps(fields[key])
        sets = ", ".join(f"{key} = ?" for key in fields)
        with self.transaction():
            self.db.conn.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*fields.values(), run_id])

    def finish_run(self, run_id: int, status: str, **fields: Any) -> bool:
        """Set a final status unless the run already has one; True if this call set it."""
        assert status not in LIVE_STATUSES
        fields = {"status": status, "ended_at": time.time(), **fields}
        for key in ("summary", "progress"):
            if key in fields and not isinstance(fields[key], str):
                fields[key] = json.dumps(fields[key])
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction():
            cur = self.db.execute(
                f"UPDATE runs SET {sets} WHERE id = ? AND status IN ('queued', 'running')",
                [*fields.values(), run_id],
            )
        return cur.rowcount == 1

    def get_run(self, run_id: int | str) -> dict:
        try:
            row = self.db["runs"].get(int(run_id))
        except (ValueError, _sqlite_utils().db.NotFoundError):
            raise UnknownRun(run_id) from None
        return _decode_run(row)

    def list_runs(self, recipe: str | None = None, status: str | None = None) -> list[dict]:
        where, args = [], []
        if recipe:
            where.append("recipe = ?"), args.append(recipe)
        if status:
            where.append("status = ?"), args.append(status)
        rows = self.db["runs"].rows_where(" AND ".join(where) or None, args, order_by="id desc")
        return [_decode_run(r) for r in rows]

    def recipe_names(self) -> list[str]:
        """Every recipe that has a run in the history, sorted."""
        return [row[0] for row in self.db.execute("SELECT DISTINCT recipe FROM runs ORDER BY recipe")]

    def live_runs(self) -> list[dict]:
        rows = self.db["runs"].rows_where("status IN ('queued', 'running')", order_by="id")
        return [_decode_run(r) for r in rows]

    def delete_run(self, run_id: int) -> None:
        with self.transaction():
            self.db.execute("DELETE FROM metrics WHERE run_id = ?", [run_id])
            self.db.execute("DELETE FROM samples WHERE run_id = ?", [run_id])
            self.db["runs"].delete(run_id)

    # ---- metrics and samples ----------------------------------------------------------------

    def add_rows(self, metrics: Iterable[dict], samples: Iterable[dict]) -> None:
        """One transaction per supervisor tick, whatever it carries (plain executemany: this is
        the supervisor's hot path, run every second for the whole run)."""
        metrics, samples = list(metrics), list(samples)
        if not metrics and not samples:
            return
        with self.transaction():
            for table, rows, columns in (("metrics", metrics, METRIC_COLUMNS), ("samples", samples, SAMPLE_COLUMNS)):
                if rows:
                    self.db.conn.executemany(
                        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                        [[row.get(c) for c in columns] for row in rows],
                    )

    def metrics(self, run_id: int, name: str | None = None, since: float = float("-inf")) -> list[dict]:
        where, args = "run_id = ? AND t > ?", [run_id, since]
        if name:
            where, args = where + " AND name = ?", args + [name]
        return list(self.db["metrics"].rows_where(where, args, order_by="t, rowid"))

    def samples(self, run_id: int, since: float = float("-inf")) -> list[dict]:
        return list(self.db["samples"].rows_where("run_id = ? AND t > ?", [run_id, since], order_by="t, rowid"))

    def results(self, run_id: int) -> list[dict]:
        """The per-item results the recipe merged into RUN_DIR/results.jsonl (empty if it wrote none)."""
        run_dir = self.get_run(run_id)["run_dir"]
        path = Path(run_dir or "") / RESULTS_FILE
        if not run_dir or not path.exists():
            return []
        with open(path) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def latest_samples(self, run_id: int) -> list[dict]:
        """The last tick's samples (one row per GPU, or host + ranks on a CPU machine)."""
        row = self.db.execute("SELECT max(t) FROM samples WHERE run_id = ?", [run_id]).fetchone()
        if not row or row[0] is None:
            return []
        return list(self.db["samples"].rows_where("run_id = ? AND t = ?", [run_id, row[0]], order_by="kind, idx"))


    def device_peaks(self, run_id: int, kinds: Iterable[str] = ("gpu", "rank")) -> list[dict]:
        """Per device of the given kinds (a GPU, or a rank's RSS on CPU), over the whole run: the peak
        memory used, the peak memory of the run's own processes, the mean utilization, the sample count."""
        kinds = list(kinds)
        rows = self.db.execute(
            "SELECT kind, idx, max(name), max(mem_used_mb), max(mem_total_mb), max(run_mem_mb), avg(util), count(*) "
            f"FROM samples WHERE run_id = ? AND kind IN ({', '.join('?' * len(kinds))}) "
            "GROUP BY kind, idx ORDER BY kind, idx",
            [run_id, *kinds],
        ).fetchall()
        keys = ("kind", "idx", "name", "peak_mem_used_mb", "mem_total_mb", "peak_run_mem_mb", "mean_util", "samples")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    # ---- incremental reads for the live monitor ---------------------------------------------

    def last_rowids(self) -> tuple[int, int]:
        """The newest rowid of `samples` and of `metrics` (0 when empty). A reader that keeps them reads
        only what came later next time, whatever the rows' own timestamps say: a slow rank's late line
        is never skipped."""
        samples = self.db.execute("SELECT max(rowid) FROM samples").fetchone()[0] or 0
        metrics = self.db.execute("SELECT max(rowid) FROM metrics").fetchone()[0] or 0
        return samples, metrics

    def sample_buckets(self, run_id: int, bucket_s: float, upto_rowid: int, after_rowid: int | None = None,
                       since: float = float("-inf")) -> list[tuple]:
        """A run's samples up to `upto_rowid`, one row per (kind, idx, bucket of `bucket_s` seconds):
        `(kind, idx, name, bucket, last t, mem_used_mb, mem_total_mb, util, power_w, temp_c, run_mem_mb)`,
        means except the last time and the total memory. Rows after `after_rowid`, or (None) newer than `since`."""
        where, args = self._feed_range(run_id, upto_rowid, after_rowid, since)
        return self.db.execute(
            "SELECT kind, idx, name, CAST(t / ? AS INTEGER) AS bucket, max(t), avg(mem_used_mb), max(mem_total_mb), "
            f"avg(util), avg(power_w), avg(temp_c), avg(run_mem_mb) FROM samples WHERE {where} "
            "GROUP BY kind, idx, bucket",
            [bucket_s, *args],
        ).fetchall()

    def metric_buckets(self, run_id: int, bucket_s: float, upto_rowid: int, after_rowid: int | None = None,
                       since: float = float("-inf")) -> list[tuple]:
        """A run's metrics as `sample_buckets` selects them, one row per (name, rank, bucket):
        `(name, rank, bucket, sum of values, count, first t)`."""
        where, args = self._feed_range(run_id, upto_rowid, after_rowid, since)
        return self.db.execute(
            "SELECT name, rank, CAST(t / ? AS INTEGER) AS bucket, sum(value), count(*), min(t) FROM metrics "
            f"WHERE {where} GROUP BY name, rank, bucket",
            [bucket_s, *args],
        ).fetchall()

    @staticmethod
    def _feed_range(run_id: int, upto_rowid: int, after_rowid: int | None, since: float) -> tuple[str, list]:
        if after_rowid is None:  # the first read: the run's index, from `since` on
            return "run_id = ? AND t > ? AND rowid <= ?", [run_id, since, upto_rowid]
        # Rowid range first (the unary + keeps SQLite off the run_id index): a poll costs the new rows only.
        return "rowid > ? AND rowid <= ? AND +run_id = ?", [after_rowid, upto_rowid, run_id]


def _decode_run(row: dict) -> dict:
    row = dict(row)
    for key in ("settings", "summary", "progress", "command"):
        row[key] = json.loads(row[key]) if row.get(key) else ({} if key != "command" else [])
    return row
