"""The run history: one SQLite file (WAL) under GPUSCALE_HOME, read and written through sqlite-utils.

Every front end and every supervisor opens its own connection; WAL lets several runs write at once
while the TUI reads. The schema carries a version; `MIGRATIONS[i]` takes a database from version i to
i + 1, so an old runs.db is upgraded in place and nothing stored is lost. The `samples` table's measured
columns follow `control/sample_fields.py`'s declaration instead: one it lacks is added at every writable
open (old rows read NULL there), so a new telemetry field needs no migration.

A home that cannot be written (a shared, read-only copy of someone's runs) is still read:
`Store.for_reading` falls back to a read-only connection, and any write then fails with a `StoreError`
naming the path. Every failure to open or write the history is a `StoreError` of one line (the path,
the reason, what to do), never SQLite's bare message.
"""

from __future__ import annotations

import errno
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

from gpuscale.control import disk_space, run_queue, sample_fields
from gpuscale.data.paths import absolute_path
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.statuses import LIVE_STATUSES

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


def gpuscale_home() -> Path:
    """The history's folder, absolute: a run's folder under it is named in its settings and command,
    which its supervisor and ranks read from elsewhere (ranks start in the run folder)."""
    if os.environ.get("GPUSCALE_HOME"):
        return absolute_path(os.environ["GPUSCALE_HOME"])
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return absolute_path(Path(xdg) / "gpuscale")


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
        {**SAMPLE_KEYS, **{f.name: f.sql_type for f in sample_fields.SAMPLE_FIELDS}},
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["samples"].create_index(["run_id", "t"])


def _v2(db: sqlite_utils.Database) -> None:
    """Tuned batch sizes, one row per key (recipe, model, device, precision, shape)."""
    db["tunings"].create(
        {
            "id": int, "recipe": str, "model": str, "device": str, "precision": str, "shape": str,
            "batch_size": int, "throughput": float, "figure": str, "peak_memory_bytes": int,
            "memory_total_bytes": int, "memory_cap": float, "compile": int, "trials": str, "stopped": str,
            "seconds": float, "created_at": float,
        },
        pk="id",
    )
    db["tunings"].create_index(["recipe", "model", "device", "precision", "shape"], unique=True)


def _v3(db: sqlite_utils.Database) -> None:
    """A run's label: a name the user gives it (`gpuscale run --label`), usable where an id is."""
    db["runs"].add_column("label", str)
    db["runs"].create_index(["label"])


def _v4(db: sqlite_utils.Database) -> None:
    """A resumed run's parent: the run whose checkpoint it continues (`gpuscale resume`)."""
    db["runs"].add_column("parent_id", int)


MIGRATIONS = [_v1, _v2, _v3, _v4]


def _add_declared_sample_columns(db: sqlite_utils.Database) -> None:
    """The columns of fields declared since the history was made (`control/sample_fields.py`); the
    rows already stored keep their values and read NULL in the new column."""
    present = db["samples"].columns_dict
    for field in sample_fields.SAMPLE_FIELDS:
        if field.name not in present:
            db["samples"].add_column(field.name, field.sql_type)


# A run waiting its turn in the queue (`gpuscale run --queue`: control/run_queue.py), as SQL.
WAITING_SQL = "(status = 'queued' AND coalesce(json_extract(settings, '$.queue'), 0))"
TUNING_KEY = ("recipe", "model", "device", "precision", "shape")
METRIC_COLUMNS = ("run_id", "rank", "t", "step", "name", "value")
# A sample's identity; what it measures is `sample_fields.SAMPLE_FIELDS`.
SAMPLE_KEYS = {"run_id": int, "t": float, "kind": str, "idx": int, "name": str}
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


class StoreError(RuntimeError):
    """The run history cannot be opened or written; the message is one line: path, reason, what to do."""


class HomeNotWritable(StoreError):
    """GPUSCALE_HOME (or its runs.db) cannot be written; reading may still work (`Store.for_reading`)."""


class DiskFull(HomeNotWritable):
    """GPUSCALE_HOME's file system is full, or too full for a run to start (control/disk_space.py):
    the line names the file system and the room left. The history can still be read."""


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    return str(error) or type(error).__name__


def _is_damaged(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, sqlite3.DatabaseError) and ("not a database" in text or "malformed" in text)


def _is_not_writable(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, PermissionError) or (
        isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES)
    ) or "readonly" in text or "read-only" in text or "unable to open" in text


def _full_disk_io_error(home: Path, error: BaseException) -> bool:
    """SQLite's "disk I/O error" where it could not make its write-ahead log on a full disk."""
    return isinstance(error, sqlite3.DatabaseError) and "disk i/o error" in str(error).lower() \
        and disk_space.free_bytes(home) < disk_space.MIN_FREE_MB * 2**20


def store_error(home: Path, error: BaseException, writing: bool = True) -> StoreError:
    """The one-line error for an OS or SQLite error met opening or using the history in `home`."""
    database = Path(home) / "runs.db"
    if isinstance(error, StoreError):
        return error
    if disk_space.is_disk_full(error) or _full_disk_io_error(home, error):
        return DiskFull(disk_space.disk_full_line(home))
    if _is_damaged(error):
        return StoreError(
            f"{database}: the run history is damaged ({_reason(error)}); move it aside "
            f"(`gpuscale doctor --repair` does, keeping the run folders) and gpuscale starts a new one"
        )
    if writing and _is_not_writable(error):
        return HomeNotWritable(
            f"{home}: not writable ({_reason(error)}); starting, stopping or deleting runs needs a writable "
            f"GPUSCALE_HOME (reading the history works)"
        )
    return StoreError(f"{database}: cannot read the run history ({_reason(error)}); check the owner and mode "
                      f"of {home}, or point GPUSCALE_HOME elsewhere")


def connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that never writes. `mode=ro` reads a WAL database whose -wal and -shm files exist
    or can be created. In a read-only folder after a clean close they do not exist and cannot be:
    SQLite then refuses mode=ro ("attempt to write a readonly database"), and the file is opened as
    `immutable`, which is safe there because a clean close leaves nothing in a WAL file."""
    uri = Path(path).resolve().as_uri()
    try:
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=30, isolation_level=None)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError:
        conn = sqlite3.connect(f"{uri}?immutable=1", uri=True, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


class UnknownRun(LookupError):
    def __init__(self, run_id: Any, reason: str = "no such run (see `gpuscale runs`)"):
        super().__init__(f"run id: {run_id!r}: {reason}")


def label_problem(label: str) -> str | None:
    """Why `label` cannot name a run, or None: `find_run` reads digits as an id, and an empty label
    names nothing. The one rule for `--label` and the TUI form's label field."""
    if not label.strip() or label.strip().isdigit():
        return "give a name with a letter in it (a number would read as a run id)"
    return None


class Store:
    """Thin layer over runs.db; all JSON columns are decoded on the way out.

    `Store(home)` opens the history for reading and writing (creating it), and raises `HomeNotWritable`
    where that is not allowed; `Store(home, read_only=True)` never writes (an absent history reads as
    empty), and every write method raises `HomeNotWritable`."""

    def __init__(self, home: Path | None = None, read_only: bool = False):
        self.home = Path(home).absolute() if home else gpuscale_home()
        self.path = self.home / "runs.db"
        self.read_only = False  # until the schema is in place
        try:
            empty = read_only and not self.path.exists()  # raises PermissionError in an unreadable home
            if empty:  # no history yet: an empty one, in memory
                conn = sqlite3.connect(":memory:", isolation_level=None)
            else:
                conn = self._connect_read_only() if read_only else self._connect_for_writing()
            self.db = _sqlite_utils().Database(conn)
            if read_only and not empty:
                self._check_version()
            else:
                self._migrate()
        except (OSError, sqlite3.DatabaseError) as error:
            raise store_error(self.home, error, writing=not read_only) from None
        self.read_only = read_only
        self.file_id = self._file_id()

    def _file_id(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino

    def replaced(self) -> bool:
        """Whether runs.db is now another file than the one this store opened (`gpuscale doctor
        --repair` moved a damaged one aside and started a new one): a long-lived writer, the
        supervisor, then opens the new one, or its rows would go to the file moved aside."""
        now = self._file_id()
        return now is not None and self.file_id is not None and now != self.file_id

    @classmethod
    def for_reading(cls, home: Path | None = None) -> Store:
        """The history to read: writable where the home allows it (so front ends can still mark dead
        runs lost), else read-only. A damaged or unreadable history still raises StoreError."""
        try:
            return cls(home)
        except HomeNotWritable as not_writable:
            try:
                return cls(home, read_only=True)
            except StoreError:
                if isinstance(not_writable, DiskFull):  # e.g. a runs.db the full disk left unmade: the cause
                    raise not_writable from None
                raise

    def _connect_for_writing(self) -> sqlite3.Connection:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "runs").mkdir(exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA busy_timeout = 30000")
        _enable_wal(conn)
        # WAL + NORMAL: a crash never corrupts the file; at worst the last tick is lost on power loss.
        conn.execute("PRAGMA synchronous = NORMAL")
        return conn

    def _connect_read_only(self) -> sqlite3.Connection:
        return connect_read_only(self.path)

    def _check_version(self) -> None:
        """A read-only history cannot be migrated: it must be at this gpuscale's schema version."""
        tables = {row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        row = self.db.execute("SELECT version FROM schema_version").fetchone() if "schema_version" in tables else None
        version = row[0] if row else 0
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path}: schema version {version} is newer than this gpuscale "
                             f"({SCHEMA_VERSION}); upgrade gpuscale")
        if version < SCHEMA_VERSION:
            raise StoreError(f"{self.path}: schema version {version} is older than this gpuscale's "
                             f"({SCHEMA_VERSION}) and the home is read-only; open it once where it can be written")

    def close(self) -> None:
        self.db.conn.close()

    @contextmanager
    def transaction(self):
        """One SQLite transaction (the connection is in autocommit mode otherwise)."""
        if self.read_only:
            raise HomeNotWritable(f"{self.home}: opened read-only (the folder or its runs.db cannot be written); "
                                  "starting, stopping or deleting runs needs a writable GPUSCALE_HOME")
        self.db.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            # SQLite has rolled back already after some errors (SQLITE_FULL: a full disk); a ROLLBACK
            # then would raise "no transaction is active" over the error that says what happened.
            if self.db.conn.in_transaction:
                self.db.conn.execute("ROLLBACK")
            raise
        self.db.conn.execute("COMMIT")

    def _require_writable(self) -> None:
        """SQLite opens a file it may not write read-only without a word, and a current history takes no
        write lock to open: a home that cannot be written is found here, as a write would find it."""
        if not (os.access(self.path, os.W_OK) and os.access(self.home, os.W_OK)):
            raise PermissionError(errno.EACCES, "the folder or its runs.db cannot be written", str(self.path))

    def _is_current(self) -> bool:
        """Whether the history is at this gpuscale's schema, every declared sample column in place:
        read without the write lock, which every front end and supervisor opening it would otherwise
        take in turn (fifty runs started at once queued on it)."""
        tables = {row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "schema_version" not in tables:
            return False
        row = self.db.execute("SELECT version FROM schema_version").fetchone()
        present = self.db["samples"].columns_dict if row and row[0] == SCHEMA_VERSION else {}
        return bool(present) and all(field.name in present for field in sample_fields.SAMPLE_FIELDS)

    def _migrate(self) -> None:
        if self._is_current():
            self._require_writable()
            return
        with self.transaction():  # a half-migrated file is never left behind
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = self.db.execute("SELECT version FROM schema_version").fetchone()
            version = row[0] if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.home / 'runs.db'}: schema version {version} is newer than this gpuscale "
                    f"({SCHEMA_VERSION}); upgrade gpuscale"
                )
            for migrate in MIGRATIONS[version:]:
                migrate(self.db)
            _add_declared_sample_columns(self.db)
            self.db.execute("DELETE FROM schema_version")
            self.db.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION])

    # ---- runs -------------------------------------------------------------------------------

    def create_run(self, recipe: str, settings: dict, command: list[str], host: str,
                   parent_id: int | None = None) -> int:
        """`parent_id`: the run a resumed run continues."""
        with self.transaction():
            run_id = self._next_run_id()
            # One plain INSERT, as update_run writes: sqlite-utils' insert and update read the table's
            # columns first, 0.47 ms a run against 0.13 (tests fill histories of 10,000 runs).
            row = {
                "id": run_id, "recipe": recipe, "status": "queued", "settings": json.dumps(settings),
                "summary": "{}", "created_at": time.time(), "command": json.dumps(command),
                "host": host, "parent_id": parent_id, "run_dir": str(self.home / "runs" / str(run_id)),
            }
            self.db.conn.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                                 list(row.values()))
        return run_id

    def restore_run(self, run: dict, metrics: Iterable[dict]) -> None:
        """Insert a run rebuilt from its folder (`gpuscale doctor --repair` after the history was lost),
        under its own id, with its metric rows, in one transaction: a run is restored whole or not
        at all. `run` holds columns of `runs`; JSON columns may be given decoded."""
        row = dict(run)
        for key in ("settings", "summary", "progress", "command"):
            if key in row and not isinstance(row[key], str):
                row[key] = json.dumps(row[key])
        metrics = list(metrics)
        with self.transaction():
            self.db.conn.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                                 list(row.values()))
            self.db.conn.executemany(
                f"INSERT INTO metrics ({', '.join(METRIC_COLUMNS)}) VALUES ({', '.join('?' * len(METRIC_COLUMNS))})",
                [[m.get(c) for c in METRIC_COLUMNS] for m in metrics])

    def _next_run_id(self) -> int:
        """Above every id in the table and every run folder: a deleted run keeps its folder, and so does
        a history started anew (a damaged runs.db moved aside), so a new run must not reuse either."""
        in_table = self.db.execute("SELECT max(id) FROM runs").fetchone()[0] or 0
        folders = [int(entry.name) for entry in os.scandir(self.home / "runs") if entry.name.isdigit()]
        return max([in_table, *folders]) + 1

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
        return self._with_queue_positions([_decode_run(row)])[0]

    def _with_queue_positions(self, runs: list[dict]) -> list[dict]:
        """`runs`, each one waiting in the queue given its `queue_position` (1: the next on its host)."""
        if any(run_queue.waits_in_queue(run) for run in runs):
            waiting = self.db.execute(f"SELECT id, host FROM runs WHERE {WAITING_SQL} ORDER BY id").fetchall()
            places = run_queue.positions([{"id": run_id, "host": host} for run_id, host in waiting])
            for run in runs:
                if run["id"] in places:
                    run["queue_position"] = places[run["id"]]
        return runs

    def take_turn(self, run_id: int, may_start, **fields: Any) -> str | None:
        """A queued run's supervisor asking whether it may start: `may_start(run, live)` is given the
        run and the live runs of its host (itself included). Where it says yes, the run becomes
        `running` (with `fields`) in the same write transaction as the check, so that two waiters
        never both start on the same devices; the check is made once without the lock first, so that
        waiters cost the running supervisors no lock. Returns the run's status after (`running`: its
        turn came; `queued`: not yet; an end: it was ended meanwhile), None if the history does not
        hold the run (runs.db replaced, the run not yet restored)."""

        def check() -> str | None:
            rows = [_decode_run(row) for row in self.db["runs"].rows_where(
                "host IS (SELECT host FROM runs WHERE id = ?) AND status IN ('queued', 'running')", [run_id],
                order_by="id")]
            run = next((row for row in rows if row["id"] == run_id), None)
            if run is None:
                return self.get_run(run_id)["status"]  # ended, or UnknownRun
            return "go" if run["status"] == "queued" and may_start(run, rows) else run["status"]

        try:
            if (status := check()) != "go":
                return status
            with self.transaction():
                if (status := check()) == "go":
                    sets = {"status": "running", **fields}
                    self.db.conn.execute(f"UPDATE runs SET {', '.join(f'{key} = ?' for key in sets)} WHERE id = ?",
                                         [*sets.values(), run_id])
                    status = "running"
            return status
        except UnknownRun:
            return None

    def find_run(self, ref: int | str) -> dict:
        """The run a user means by `ref`: its id (digits), else its label, which must name one run."""
        if isinstance(ref, int) or str(ref).strip().isdigit():
            return self.get_run(ref)
        ids = [row[0] for row in self.db.execute("SELECT id FROM runs WHERE label = ? ORDER BY id", [ref])]
        if len(ids) > 1:
            raise UnknownRun(ref, f"the label is on runs {', '.join(map(str, ids))}; give one of those ids")
        if not ids:
            raise UnknownRun(ref)
        return self.get_run(ids[0])

    def list_runs(self, recipe: str | None = None, status: str | None = None,
                  limit: int | None = None, label: str | None = None) -> list[dict]:
        """Newest first; `limit`: only the newest that many (a page of a long history); `label`: the
        runs whose label it matches, as the shell matches names (SQLite's GLOB: `*`, `?` and `[...]`,
        case counts), so a plain label names exactly its runs and `sweep-*` a family of them."""
        where, args = [], []
        if recipe:
            where.append("recipe = ?"), args.append(recipe)
        if status:
            where.append("status = ?"), args.append(status)
        if label is not None:
            where.append("label GLOB ?"), args.append(label)
        rows = self.db["runs"].rows_where(" AND ".join(where) or None, args, order_by="id desc", limit=limit)
        return self._with_queue_positions([_decode_run(r) for r in rows])

    def children(self, run_id: int) -> list[dict]:
        """The runs that continue `run_id` (`gpuscale resume`), oldest first."""
        return [_decode_run(row) for row in self.db["runs"].rows_where("parent_id = ?", [run_id], order_by="id")]

    def recipe_names(self) -> list[str]:
        """Every recipe that has a run in the history, sorted."""
        return [row[0] for row in self.db.execute("SELECT DISTINCT recipe FROM runs ORDER BY recipe")]

    def live_runs(self) -> list[dict]:
        rows = self.db["runs"].rows_where("status IN ('queued', 'running')", order_by="id")
        return self._with_queue_positions([_decode_run(r) for r in rows])

    def live_ranks_on(self, host: str | None) -> int:
        """The ranks of every live run on `host` but those still waiting in the queue, by their device
        plans (a plan that cannot be read counts one rank)."""
        rows = self.db.execute("SELECT run_dir FROM runs WHERE status IN ('queued', 'running') AND host IS ? "
                               f"AND NOT {WAITING_SQL}", [host])
        return sum(_planned_ranks(run_dir) for (run_dir,) in rows)

    def runs_sharing_gpus(self, run_id: int, host: str | None, gpu_indices: list[int], start: float,
                          end: float) -> dict[int, list[int]]:
        """The other runs on `host` that used any of `gpu_indices` at some time between `start` and
        `end` (a live run has no end yet), by id, each with those of `gpu_indices` it used: NVML's
        energy counter of a GPU counts every process on it. A run's GPUs are its folder's plan.json
        (the history keeps none); a run whose plan cannot be read is not counted."""
        if not gpu_indices:
            return {}
        rows = self.db.execute(
            "SELECT id, run_dir FROM runs WHERE id != ? AND host IS ? AND started_at < ? "
            "AND (ended_at IS NULL OR ended_at > ?) ORDER BY id", [run_id, host, end, start])
        sharing = {}
        for other, run_dir in rows:
            if shared := [gpu for gpu in planned_gpus(run_dir) if gpu in gpu_indices]:
                sharing[other] = shared
        return sharing

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
            sample_columns = (*SAMPLE_KEYS, *sample_fields.field_names())
            for table, rows, columns in (("metrics", metrics, METRIC_COLUMNS), ("samples", samples, sample_columns)):
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

    def last_metric_times(self, run_id: int) -> dict[int, float]:
        """Per rank, the time of the run's newest metric row (rank RUN_WIDE_RANK included)."""
        rows = self.db.execute("SELECT rank, max(t) FROM metrics WHERE run_id = ? GROUP BY rank", [run_id])
        return dict(rows.fetchall())

    def recent_steps(self, run_id: int, names: Iterable[str], steps: int,
                     rows_per_step: int = 64) -> dict[str, list[tuple[int, float]]]:
        """Per name, the last `steps` steps the ranks logged it at, oldest first: `(step, value)`, the
        value the mean over the ranks that logged the step (the ranks' own rows, not the supervisor's
        combined ones, which hold one value per tick however many steps it carried). Reads the newest
        rows only (up to `rows_per_step` ranks a step), through the (run_id, name, t) index."""
        found = {}
        for name in names:
            rows = self.db.execute(
                "SELECT step, value FROM metrics WHERE run_id = ? AND name = ? AND rank >= 0 "
                "ORDER BY t DESC, rowid DESC LIMIT ?", [run_id, name, steps * rows_per_step]).fetchall()
            by_step: dict[int, list[float]] = {}
            for step, value in rows:
                if value is not None:
                    by_step.setdefault(step, []).append(value)
            if by_step:
                newest = sorted(by_step)[-steps:]
                found[name] = [(step, sum(by_step[step]) / len(by_step[step])) for step in newest]
        return found

    def samples(self, run_id: int, since: float = float("-inf")) -> list[dict]:
        return list(self.db["samples"].rows_where("run_id = ? AND t > ?", [run_id, since], order_by="t, rowid"))

    def results(self, run_id: int) -> list[dict]:
        """The per-item results the recipe merged into RUN_DIR/results.jsonl (empty if it wrote none)."""
        run_dir = self.get_run(run_id)["run_dir"]
        path = RunDir(run_dir or "").results
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
        memory used, the peak memory of the run's own processes, the mean utilization, the mean of the run's own
        utilization (its processes' kernels; None where not reported), the sample count."""
        kinds = list(kinds)
        rows = self.db.execute(
            "SELECT kind, idx, max(name), max(mem_used_mb), max(mem_total_mb), max(run_mem_mb), avg(util), "
            "avg(run_util), count(*) "
            f"FROM samples WHERE run_id = ? AND kind IN ({', '.join('?' * len(kinds))}) "
            "GROUP BY kind, idx ORDER BY kind, idx",
            [run_id, *kinds],
        ).fetchall()
        keys = ("kind", "idx", "name", "peak_mem_used_mb", "mem_total_mb", "peak_run_mem_mb", "mean_util",
                "mean_run_util", "samples")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    # ---- tuned batch sizes (`gpuscale tune`, `--batch-size auto`) ----------------------------------------------------

    def save_tuning(self, key: dict, **fields: Any) -> None:
        """Store the tuning result for `key` (TUNING_KEY's fields), replacing an earlier one.
        `trials` may be a list (stored as JSON)."""
        if not isinstance(fields.get("trials", ""), str):
            fields["trials"] = json.dumps(fields["trials"])
        row = {**{name: key[name] for name in TUNING_KEY}, "created_at": time.time(), **fields}
        with self.transaction():
            self.db.execute(f"DELETE FROM tunings WHERE {' AND '.join(f'{k} = ?' for k in TUNING_KEY)}",
                            [key[name] for name in TUNING_KEY])
            self.db["tunings"].insert(row)

    def find_tuning(self, key: dict) -> dict | None:
        """The stored result for `key`, trials decoded; None when none is stored."""
        rows = list(self.db["tunings"].rows_where(" AND ".join(f"{k} = ?" for k in TUNING_KEY),
                                                  [key[name] for name in TUNING_KEY]))
        return _decode_tuning(rows[0]) if rows else None

    def list_tunings(self, recipe: str | None = None) -> list[dict]:
        rows = self.db["tunings"].rows_where("recipe = ?" if recipe else None, [recipe] if recipe else [],
                                             order_by="created_at desc")
        return [_decode_tuning(row) for row in rows]

    # ---- incremental reads for the live monitor ---------------------------------------------

    def last_rowids(self) -> tuple[int, int]:
        """The newest rowid of `samples` and of `metrics` (0 when empty). A reader that keeps them reads
        only what came later next time, whatever the rows' own timestamps say: a slow rank's late line
        is never skipped."""
        samples = self.db.execute("SELECT max(rowid) FROM samples").fetchone()[0] or 0
        metrics = self.db.execute("SELECT max(rowid) FROM metrics").fetchone()[0] or 0
        return samples, metrics

    def sample_buckets(self, run_id: int, bucket_s: float, upto_rowid: int, after_rowid: int | None = None,
                       since: float = float("-inf")) -> list[dict]:
        """A run's samples up to `upto_rowid`, one dict per (kind, idx, bucket of `bucket_s` seconds): `kind`,
        `idx`, `name`, `bucket`, `t` (the bucket's last time) and every declared sample field by its name,
        combined by its `bucket` aggregate (None where this history has no column for it: a read-only
        one made before the field was declared). Rows after `after_rowid`, or (None) newer than `since`."""
        where, args = self._feed_range(run_id, upto_rowid, after_rowid, since)
        present = self.db["samples"].columns_dict
        fields = ", ".join(f"{f.bucket}({f.name}) AS {f.name}" if f.name in present else f"NULL AS {f.name}"
                           for f in sample_fields.SAMPLE_FIELDS)
        cursor = self.db.execute(
            f"SELECT kind, idx, name, CAST(t / ? AS INTEGER) AS bucket, max(t) AS t, {fields} FROM samples "
            f"WHERE {where} GROUP BY kind, idx, bucket",
            [bucket_s, *args],
        )
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

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


def planned_gpus(run_dir: str | None) -> list[int]:
    """The GPUs of a run's device plan (RunDir.plan); none where it cannot be read."""
    try:
        return list(json.loads(RunDir(run_dir).plan.read_text())["gpu_indices"])
    except (OSError, TypeError, ValueError, KeyError):
        return []


def _planned_ranks(run_dir: str | None) -> int:
    try:
        return max(1, int(json.loads(RunDir(run_dir).plan.read_text())["nproc"]))
    except (OSError, TypeError, ValueError, KeyError):
        return 1


def _decode_tuning(row: dict) -> dict:
    row = dict(row)
    row["trials"] = json.loads(row["trials"]) if row.get("trials") else []
    row["compile"] = bool(row.get("compile"))
    return row


def _decode_run(row: dict) -> dict:
    row = dict(row)
    for key in ("settings", "summary", "progress", "command"):
        row[key] = json.loads(row[key]) if row.get(key) else ({} if key != "command" else [])
    return row
