"""`gpuscale doctor`: check the run history in GPUSCALE_HOME and repair what can be repaired.

Checked: that the home can be read and written, runs.db's integrity (SQLite's integrity_check) and
schema version, runs recorded as live whose supervisor is dead, run folders without a row and rows
without a folder. Repaired: dead runs are marked lost (their results so far kept), as every front
end does; with `repair`, a damaged runs.db is moved aside and a new, empty history started, the run
folders kept (new runs are numbered above them).
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from gpuscale.runs import launch
from gpuscale.runs.process import process_alive
from gpuscale.runs.store import LIVE_STATUSES, SCHEMA_VERSION, Store, StoreError, connect_read_only


@dataclass(frozen=True)
class Finding:
    ok: bool  # False: a problem that is still there
    text: str


def examine(home: Path, repair: bool = False) -> list[Finding]:
    home = Path(home)
    if not home.exists():
        return [Finding(True, f"{home}: no history yet (the first run creates it)")]
    if not os.access(home, os.R_OK | os.X_OK):
        return [Finding(False, f"{home}: cannot be read; check its owner and mode")]
    findings = [] if os.access(home, os.W_OK) else [Finding(
        False, f"{home}: not writable: the history can be read, but runs cannot be started, stopped or deleted")]
    findings += _check_database(home / "runs.db", repair)
    if not findings[-1].ok:
        return findings  # a history that cannot be opened: nothing more to check in it
    try:
        store = Store.for_reading(home)
    except StoreError as error:
        return findings + [Finding(False, str(error))]
    try:
        findings += _check_live_runs(store)
        findings += _check_folders(store)
    finally:
        store.close()
    return findings


def _check_database(path: Path, repair: bool) -> list[Finding]:
    if not path.exists():
        return [Finding(True, f"{path}: no runs.db yet (the first run creates it)")]
    try:
        conn = connect_read_only(path)
        try:
            problems = [row[0] for row in conn.execute("PRAGMA integrity_check")]
            version = _schema_version(conn)
        finally:
            conn.close()
    except sqlite3.DatabaseError as error:
        problems, version = [str(error)], None
    if problems != ["ok"]:
        return [_damaged(path, "; ".join(problems[:3]), repair)]
    if version is not None and version > SCHEMA_VERSION:
        return [Finding(False, f"{path}: schema version {version} is newer than this gpuscale's ({SCHEMA_VERSION}); "
                               "upgrade gpuscale")]
    if version is not None and version < SCHEMA_VERSION:
        return [Finding(True, f"{path}: integrity ok; schema version {version}, upgraded to {SCHEMA_VERSION} "
                              "when opened where it can be written")]
    return [Finding(True, f"{path}: integrity ok, schema version {version}")]


def _schema_version(conn: sqlite3.Connection) -> int:
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    row = conn.execute("SELECT version FROM schema_version").fetchone() if "schema_version" in tables else None
    return row[0] if row else 0


def _damaged(path: Path, reason: str, repair: bool) -> Finding:
    if not repair:
        return Finding(False, f"{path}: damaged ({reason}); `gpuscale doctor --repair` moves it aside and starts "
                              "a new history (the run folders are kept)")
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        for suffix in ("", "-wal", "-shm"):  # a WAL file belongs to its database: it goes with it
            if Path(f"{path}{suffix}").exists():
                os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    except OSError as error:
        return Finding(False, f"{path}: damaged ({reason}); could not move it aside: {error.strerror or error}")
    return Finding(True, f"{path}: damaged ({reason}); moved to {aside.name}, a new history is started "
                         "(the run folders are kept)")


def _check_live_runs(store: Store) -> list[Finding]:
    if store.read_only:
        dead = [run for run in store.live_runs() if not process_alive(run["supervisor_pid"], run["supervisor_started"])]
        return [Finding(False, f"run {run['id']}: recorded as {run['status']} but its supervisor is gone; "
                               "the read-only history cannot mark it lost") for run in dead]
    return [Finding(True, f"run {run_id}: its supervisor had died; marked lost (its results so far kept)")
            for run_id in launch.reconcile(store)]


def _check_folders(store: Store) -> list[Finding]:
    runs = store.list_runs()
    known = {str(run["id"]) for run in runs}
    folders = store.home / "runs"
    names = [entry.name for entry in os.scandir(folders) if entry.is_dir()] if folders.is_dir() else []
    orphans = sorted((name for name in names if name not in known), key=lambda name: name.zfill(20))
    findings = []
    if orphans:
        shown = ", ".join(orphans[:10]) + (" ..." if len(orphans) > 10 else "")
        findings.append(Finding(True, f"{folders}: {len(orphans)} folder(s) without a row in the history (deleted "
                                      f"runs, or an older history): {shown}; kept"))
    for run in runs:
        if run["status"] not in LIVE_STATUSES and not (run["run_dir"] and Path(run["run_dir"]).is_dir()):
            findings.append(Finding(False, f"run {run['id']}: its folder {run['run_dir']} is missing (its logs and "
                                           "results are gone; the row is kept)"))
    return findings
