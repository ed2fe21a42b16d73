"""`gpuscale doctor`: check the run history in GPUSCALE_HOME and repair what can be repaired.

Checked: that the home can be read and written and has room for a run (a full disk named as one),
runs.db's integrity (SQLite's integrity_check) and schema version, runs recorded as live whose
supervisor is dead, run folders without a row and rows without a folder. Repaired: dead runs are marked
lost (their results so far kept), as every front end does; with `repair`, a damaged runs.db is moved
aside and a new history started, rebuilt from the run folders (`rebuild_from_folders`: settings, recipe,
label, parent, status, summary and metrics as the folders show them; the status and summary a run's end
recorded in its run.json, else the status the evidence gives: `status_from_folder`).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpuscale.control import disk_space, launch
from gpuscale.control.launch import recorded_end
from gpuscale.control.metrics_tail import MetricsTailer, Throughput
from gpuscale.control.run_errors import first_error
from gpuscale.control.store import SCHEMA_VERSION, Store, StoreError, connect_read_only
from gpuscale.control.supervisor import ended_summary
from gpuscale.runs.process import process_alive
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.statuses import LIVE_STATUSES


@dataclass(frozen=True)
class Finding:
    ok: bool  # False: a problem that is still there
    text: str


def examine(home: Path, repair: bool = False,
            recipe_of: Callable[[dict], str | None] | None = None) -> list[Finding]:
    """`recipe_of(settings)`: the recipe whose settings these are, for run folders written before
    folders recorded their recipe (the front end knows the recipes; this floor does not)."""
    home = Path(home)
    if not home.exists():
        return [Finding(True, f"{home}: no history yet (the first run creates it)"), _check_space(home)]
    if not os.access(home, os.R_OK | os.X_OK):
        return [Finding(False, f"{home}: cannot be read; check its owner and mode")]
    findings = [] if os.access(home, os.W_OK) else [Finding(
        False, f"{home}: not writable: the history can be read, but runs cannot be started, stopped or deleted")]
    findings.append(_check_space(home))
    had_history = (home / "runs.db").exists()
    findings += _check_database(home / "runs.db", repair)
    if not findings[-1].ok:
        return findings  # a history that cannot be opened: nothing more to check in it
    moved_aside = had_history and not (home / "runs.db").exists()
    try:
        store = Store.for_reading(home)
    except StoreError as error:
        return findings + [Finding(False, str(error))]
    try:
        if moved_aside and not store.read_only:
            findings += rebuild_from_folders(store, recipe_of)
        findings += _check_live_runs(store)
        findings += _check_folders(store)
    finally:
        store.close()
    return findings


def _check_space(home: Path) -> Finding:
    """The room on the home's file system: a full disk named as one (SQLite's own word for it is an
    I/O error or "database or disk is full", which reads like a damaged history)."""
    if disk_space.short_of_room(home):
        return Finding(False, f"disk full: {disk_space.disk_full_line(home)}")
    usage = shutil.disk_usage(disk_space.existing_part(home))
    return Finding(True, f"{home}: {disk_space.size_text(usage.free)} free of {disk_space.size_text(usage.total)} "
                         f"on {disk_space.file_system(home)}")


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
        return [_damaged(path, _first_lines(problems), repair)]
    if version is not None and version > SCHEMA_VERSION:
        return [Finding(False, f"{path}: schema version {version} is newer than this gpuscale's ({SCHEMA_VERSION}); "
                               "upgrade gpuscale")]
    if version is not None and version < SCHEMA_VERSION:
        return [Finding(True, f"{path}: integrity ok; schema version {version}, upgraded to {SCHEMA_VERSION} "
                              "when opened where it can be written")]
    return [Finding(True, f"{path}: integrity ok, schema version {version}")]


def _first_lines(problems: list[str], count: int = 3) -> str:
    """SQLite's integrity report in one line: its first lines (a damaged file can list thousands)."""
    lines = [line.strip() for problem in problems for line in problem.splitlines() if line.strip()]
    return "; ".join(lines[:count]) + (f"; ... ({len(lines) - count} more)" if len(lines) > count else "")


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


# ---- a lost history rebuilt from the run folders --------------------------------------------------


def rebuild_from_folders(store: Store, recipe_of: Callable[[dict], str | None] | None = None) -> list[Finding]:
    """One row per run folder with a settings.json (the others are not runs this gpuscale started),
    under the folder's own id: what a run folder keeps is enough for the history's list, its details
    and its charts; the telemetry samples were only in the history and are gone."""
    folders = store.home / "runs"
    ids = sorted(int(entry.name) for entry in os.scandir(folders) if entry.is_dir() and entry.name.isdigit()) \
        if folders.is_dir() else []
    rebuilt, skipped, findings = [], [], []
    for run_id in ids:
        folder = RunDir(folders / str(run_id))
        if not folder.settings.is_file():
            skipped.append(str(run_id))
            continue
        try:
            run, metrics = run_from_folder(run_id, folder, store.home, recipe_of)
            store.restore_run(run, metrics)
        except (OSError, ValueError, sqlite3.DatabaseError) as error:
            findings.append(Finding(False, f"run {run_id}: could not be rebuilt from {folder.root} ({error})"))
            continue
        rebuilt.append(f"{run_id} ({run['status']})")
    if rebuilt:
        findings.insert(0, Finding(True, f"{len(rebuilt)} run(s) rebuilt from their folders: {', '.join(rebuilt)}"))
    if skipped:
        findings.append(Finding(True, f"{folders}: folder(s) without settings.json not rebuilt: {', '.join(skipped)}"))
    return findings


def run_from_folder(run_id: int, folder: RunDir, home: Path,
                    recipe_of: Callable[[dict], str | None] | None = None) -> tuple[dict, list[dict]]:
    """The row of the run in `folder` and its metric rows, its status from the evidence
    (`status_from_folder`); a run whose supervisor still works on it stays running, and its
    supervisor records its end in the new history (it follows a replaced runs.db)."""
    settings = json.loads(folder.settings.read_text())
    info = folder.read_info()
    recipe = info.get("recipe") or (recipe_of(settings) if recipe_of else None) or "unknown"
    tailer = MetricsTailer(folder.metrics_dir, run_id)
    throughput = Throughput()
    metrics = tailer.read_new() if folder.metrics_dir.is_dir() else []
    throughput.add(metrics)
    metrics += throughput.run_wide_rows(run_id)
    created = info.get("created_at") or folder.settings.stat().st_mtime
    ended = info.get("ended") or {}
    ended_at = ended.get("ended_at") or max([created, *(m["t"] for m in metrics), *_file_times(folder)])
    progress = throughput.progress(ended_at, finished=True)
    supervisor = _live_supervisor(run_id, home)
    status, error = status_from_folder(folder, info, tailer.summaries.get(0), progress, supervisor is not None)
    summary = ended_summary(tailer.summaries.get(0, {}), progress, status == "succeeded")
    if status not in LIVE_STATUSES:
        summary["duration_s"] = round(ended_at - (ended.get("started_at") or created), 3)
    run = {
        "id": run_id, "recipe": recipe, "status": status, "settings": {**settings, **info.get("notes", {})},
        "summary": summary, "error": error, "created_at": created,
        "started_at": None if status == "queued" else ended.get("started_at") or created,
        "ended_at": None if status in LIVE_STATUSES else ended_at, "run_dir": str(folder.root),
        "command": info.get("command", []), "host": info.get("host"), "label": info.get("label"),
        "parent_id": info.get("parent_id") or _parent_of_checkpoint(settings.get("resume_from"), home),
        "progress": progress,
    }
    if ended and status not in LIVE_STATUSES:  # what the supervisor (or the front end that found it lost) recorded
        run.update(recorded_end(ended))
    if supervisor:
        run.update(supervisor_pid=supervisor.pid, supervisor_started=supervisor.create_time())
    return run, metrics


def status_from_folder(folder: RunDir, info: dict, rank0_summary: dict | None, progress: dict,
                       supervised: bool) -> tuple[str, str | None]:
    """The status of a run as its folder shows it, and its error. In order: a live supervisor
    (running, or queued where it waits its turn); the end recorded in run.json (every end since
    gpuscale recorded it there: the only evidence of a stop); a rank's error file (failed); rank 0's
    whole summary with every announced step done (succeeded: a summary marked partial is a run that
    did not end); else lost, with how far it got."""
    if supervised:  # a run queued with --queue whose supervisor still waits its turn has no launcher yet
        waiting = info.get("notes", {}).get("queue") and not folder.launcher_log.exists()
        return ("queued" if waiting else "running"), None
    if ended := info.get("ended"):
        return ended["status"], ended.get("error")
    if folder.error_files():
        return "failed", first_error(folder.root, 1)[0]
    step, total = progress.get("step") or 0, progress.get("total")
    whole = rank0_summary is not None and not rank0_summary.get("partial")
    if whole and (total is None or step >= total):
        return "succeeded", None
    where = f"at step {step}/{total}" if total else f"at step {step}"
    return "lost", (f"rebuilt from its folder after the history was lost: it ended {where} without recording "
                    "how (stopped, or its supervisor died)")


def _parent_of_checkpoint(checkpoint: str | None, home: Path) -> int | None:
    """The run whose folder holds `checkpoint` (HOME/runs/<id>/checkpoints/checkpoint-<step>): the
    parent of a run resumed before run.json kept it. (A run resumed from a checkpoint it inherited,
    its parent having stopped before its own first one, is linked to the run that wrote it.)"""
    if not checkpoint:
        return None
    path = Path(checkpoint)
    runs = path.parent.parent.parent
    if path.parent.name != "checkpoints" or not path.parent.parent.name.isdigit() or runs != Path(home) / "runs":
        return None
    return int(path.parent.parent.name)


def _file_times(folder: RunDir) -> list[float]:
    """When each file the run wrote was last written (its end, where its metrics stopped earlier)."""
    times = []
    for directory in (folder.logs, folder.metrics_dir, folder.errors_dir, folder.results_dir):
        if directory.is_dir():
            times += [entry.stat().st_mtime for entry in os.scandir(directory) if entry.is_file()]
    return times


# The supervisor's module as its command line names it: today's, and the one a supervisor started
# before the control plane moved from gpuscale/runs/ to gpuscale/control/ still runs under.
SUPERVISOR_MODULES = (launch.SUPERVISOR_MODULE, "gpuscale.runs.supervisor")


def _live_supervisor(run_id: int, home: Path) -> psutil.Process | None:
    """The supervisor still running this run, if any (its command line names the run and the home,
    the home however it was spelled)."""
    for process in psutil.process_iter(["cmdline", "cwd"]):
        cmdline = process.info["cmdline"] or []
        if (cmdline[-5:-1] in (["-m", module, str(run_id), "--home"] for module in SUPERVISOR_MODULES)
                and _same_folder(process.info["cwd"], cmdline[-1], home)):
            return process
    return None


def _same_folder(cwd: str | None, given: str, home: Path) -> bool:
    try:
        return (Path(cwd or "/") / given).resolve() == Path(home).resolve()
    except OSError:
        return False
