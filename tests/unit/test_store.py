import multiprocessing
import sqlite3
import subprocess
import sys
import time

import pytest

from gpuscale.control.doctor import examine
from gpuscale.control.store import (
    SCHEMA_VERSION,
    HomeNotWritable,
    Store,
    StoreError,
    UnknownRun,
)


def test_create_update_finish(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {"batch_size": 2}, ["x"], "host")
    run = store.get_run(run_id)
    assert run["status"] == "queued" and run["settings"] == {"batch_size": 2}
    assert run["run_dir"].endswith(f"runs/{run_id}")
    store.update_run(run_id, status="running", progress={"step": 3})
    assert store.finish_run(run_id, "succeeded", summary={"tokens_per_s": 5.0})
    # A final status is never overwritten (a late `lost` must not hide a success).
    assert not store.finish_run(run_id, "lost")
    run = store.get_run(run_id)
    assert run["status"] == "succeeded" and run["summary"]["tokens_per_s"] == 5.0


def test_unknown_run_message(tmp_path):
    store = Store(tmp_path)
    for bad in (42, "abc"):
        with pytest.raises(UnknownRun, match="no such run"):
            store.get_run(bad)


def test_schema_version_and_reopen_keeps_data(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [], "h")
    again = Store(tmp_path)
    assert again.get_run(run_id)["recipe"] == "probe"
    version = sqlite3.connect(tmp_path / "runs.db").execute("select version from schema_version").fetchall()
    assert version == [(SCHEMA_VERSION,)]
    assert again.db.journal_mode == "wal"


def test_newer_schema_is_refused(tmp_path):
    Store(tmp_path)
    conn = sqlite3.connect(tmp_path / "runs.db")
    conn.execute("update schema_version set version = 99")
    conn.commit()
    with pytest.raises(RuntimeError, match="newer than this gpuscale"):
        Store(tmp_path)


def _writer(home, run_id, worker):
    store = Store(home)
    for i in range(200):
        metric = {"run_id": run_id, "rank": worker, "t": float(i), "step": i, "name": "tokens", "value": 1.0}
        store.add_rows([metric], [])


def test_several_writers_at_once(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [], "h")
    procs = [multiprocessing.get_context("spawn").Process(target=_writer, args=(tmp_path, run_id, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(store.metrics(run_id, "tokens")) == 800


def test_opening_a_current_history_takes_no_write_lock(tmp_path):
    """A front end or supervisor opening the history while another process writes does not wait for
    the write lock (fifty runs started at once each opened it): only a migration takes it."""
    Store(tmp_path).close()
    writer = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a supervisor's tick, held
    try:
        start = time.monotonic()
        store = Store(tmp_path)
        assert time.monotonic() - start < 5  # SQLite's busy wait would be its 30 s timeout
        assert store.list_runs() == []
        store.close()
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_delete_run_removes_rows(tmp_path):
    store = Store(tmp_path)
    keep, gone = store.create_run("probe", {}, [], "h"), store.create_run("probe", {}, [], "h")
    for run_id in (keep, gone):
        store.add_rows([{"run_id": run_id, "rank": 0, "t": 1.0, "step": 1, "name": "loss", "value": 0.5}],
                       [{"run_id": run_id, "t": 1.0, "kind": "host", "idx": -1, "name": "cpu"}])
    store.delete_run(gone)
    assert [r["id"] for r in store.list_runs()] == [keep]
    assert store.metrics(gone) == [] and store.samples(gone) == []
    assert len(store.metrics(keep)) == 1


def test_device_peaks_and_recipe_names(tmp_path):
    store = Store(tmp_path)
    run_id, other = store.create_run("probe", {}, [], "h"), store.create_run("power-sampling", {}, [], "h")
    gpu = {"run_id": run_id, "kind": "gpu", "idx": 1, "name": "H100", "mem_total_mb": 80_000.0}
    store.add_rows([], [
        {**gpu, "t": 1.0, "mem_used_mb": 10_000.0, "run_mem_mb": 9_000.0, "util": 40.0, "run_util": 10.0},
        {**gpu, "t": 2.0, "mem_used_mb": 30_000.0, "run_mem_mb": 29_000.0, "util": 80.0, "run_util": 30.0},
        {"run_id": run_id, "t": 2.0, "kind": "rank", "idx": 0, "name": "rank 0", "run_mem_mb": 700.0},
        {"run_id": run_id, "t": 2.0, "kind": "host", "idx": -1, "name": "cpu", "mem_used_mb": 99_999.0},
        {**gpu, "run_id": other, "t": 2.0, "mem_used_mb": 79_000.0, "run_mem_mb": 79_000.0, "util": 100.0},
    ])
    peaks = store.device_peaks(run_id)
    assert [(p["kind"], p["idx"]) for p in peaks] == [("gpu", 1), ("rank", 0)]  # no host, no other run
    assert peaks[0] == {"kind": "gpu", "idx": 1, "name": "H100", "peak_mem_used_mb": 30_000.0,
                        "mem_total_mb": 80_000.0, "peak_run_mem_mb": 29_000.0, "mean_util": 60.0,
                        "mean_run_util": 20.0, "samples": 2}
    assert [p["kind"] for p in store.device_peaks(run_id, kinds=("host",))] == ["host"]
    assert store.recipe_names() == ["power-sampling", "probe"]


def test_results_of_a_run(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [], "h")
    assert store.results(run_id) == []  # the recipe wrote none
    run_dir = tmp_path / "runs" / str(run_id)
    run_dir.mkdir(parents=True)
    (run_dir / "results.jsonl").write_text('{"i": 0}\n{"i": 1}\n')
    assert store.results(run_id) == [{"i": 0}, {"i": 1}]


def test_buckets_read_by_rowid_after_the_first_read(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [], "h")
    store.add_rows([{"run_id": run_id, "rank": 0, "t": 10.2, "step": 1, "name": "tokens", "value": 5.0},
                    {"run_id": run_id, "rank": 0, "t": 10.7, "step": 2, "name": "tokens", "value": 7.0}], [])
    _, mark = store.last_rowids()
    assert store.metric_buckets(run_id, 1.0, mark, since=0.0) == [("tokens", 0, 10, 12.0, 2, 10.2)]
    assert store.metric_buckets(run_id, 1.0, mark, since=11.0) == []  # the first read goes by time
    # A late row with an old timestamp: a read after the last mark still gets it.
    store.add_rows([{"run_id": run_id, "rank": 1, "t": 3.0, "step": 1, "name": "tokens", "value": 1.0}], [])
    _, new_mark = store.last_rowids()
    assert store.metric_buckets(run_id, 1.0, new_mark, after_rowid=mark) == [("tokens", 1, 3, 1.0, 1, 3.0)]
    store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        store.recipe_names()


# ---- a damaged history, run ids, results kept by a run that ended early -------------------


def damage_header(path) -> None:
    """What a disk or a careless copy does: the first page's header overwritten."""
    with open(path, "r+b") as handle:
        handle.write(b"this is not the SQLite header at all, just bytes...." * 2)


def test_a_damaged_history_is_one_line_naming_the_file_and_what_to_do(tmp_path):
    Store(tmp_path).close()
    damage_header(tmp_path / "runs.db")
    for opening in (lambda: Store(tmp_path), lambda: Store.for_reading(tmp_path),
                    lambda: Store(tmp_path, read_only=True)):
        with pytest.raises(StoreError) as caught:
            opening()
        message = str(caught.value)
        assert message.startswith(f"{tmp_path / 'runs.db'}: the run history is damaged (file is not a database)")
        assert "gpuscale doctor --repair" in message and "\n" not in message


def test_read_only_store_reads_and_refuses_every_write(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {"batch_size": 2}, [], "h")
    store.close()
    reader = Store(tmp_path, read_only=True)
    assert [r["id"] for r in reader.list_runs()] == [run_id]
    for write in (lambda: reader.create_run("probe", {}, [], "h"), lambda: reader.delete_run(run_id),
                  lambda: reader.finish_run(run_id, "lost")):
        with pytest.raises(HomeNotWritable, match=f"^{tmp_path}: opened read-only"):
            write()
    assert Store(tmp_path).get_run(run_id)["status"] == "queued"  # nothing was written
    # No history yet and none may be created: an empty one, and nothing appears on disk.
    empty = Store(tmp_path / "none", read_only=True)
    assert empty.list_runs() == [] and not (tmp_path / "none").exists()


def test_new_runs_are_numbered_above_kept_folders(tmp_path):
    """A deleted run keeps its folder, and so does a history started anew: a new run never reuses one."""
    store = Store(tmp_path)
    first, second = store.create_run("probe", {}, [], "h"), store.create_run("probe", {}, [], "h")
    (tmp_path / "runs" / str(second)).mkdir()
    store.delete_run(second)
    assert store.create_run("probe", {}, [], "h") == second + 1
    (tmp_path / "runs" / "40").mkdir()
    assert store.create_run("probe", {}, [], "h") == 41
    assert first == 1


# ---- gpuscale doctor ------------------------------------------------------------------------------


def texts(findings, ok: bool) -> list[str]:
    return [finding.text for finding in findings if finding.ok is ok]


def test_doctor_finds_a_healthy_history_healthy(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [], "h")
    (tmp_path / "runs" / str(run_id)).mkdir()
    store.finish_run(run_id, "succeeded")
    findings = examine(tmp_path)
    assert texts(findings, False) == []
    room, integrity = texts(findings, True)
    assert room.startswith(f"{tmp_path}: ") and " free of " in room  # and on which file system
    assert integrity == f"{tmp_path / 'runs.db'}: integrity ok, schema version {SCHEMA_VERSION}"


def test_doctor_marks_dead_runs_lost_and_reports_folders_and_rows_apart(tmp_path):
    store = Store(tmp_path)
    dead, gone = store.create_run("probe", {}, [], "h"), store.create_run("probe", {}, [], "h")
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    (tmp_path / "runs" / str(dead)).mkdir()
    store.update_run(dead, status="running", supervisor_pid=exited.pid, supervisor_started=time.time() - 5)
    store.finish_run(gone, "succeeded")  # its folder was never made (or was removed)
    (tmp_path / "runs" / "17").mkdir()  # a deleted run's folder
    findings = examine(tmp_path)
    assert f"run {dead}: its supervisor had died; marked lost (its results so far kept)" in texts(findings, True)
    assert store.get_run(dead)["status"] == "lost"
    assert any("1 folder(s) without a row" in text and text.endswith("17; kept") for text in texts(findings, True))
    assert texts(findings, False) == [f"run {gone}: its folder {tmp_path / 'runs' / str(gone)} is missing (its "
                                      "logs and results are gone; the row is kept)"]


def test_doctor_repair_moves_a_damaged_history_aside_and_keeps_the_run_folders(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [], "h")
    (tmp_path / "runs" / str(run_id) / "logs").mkdir(parents=True)
    store.close()
    damage_header(tmp_path / "runs.db")
    [room, problem] = examine(tmp_path)
    assert room.ok and not problem.ok
    assert "damaged (file is not a database)" in problem.text and "--repair" in problem.text
    assert (tmp_path / "runs.db").exists()  # only --repair moves it
    findings = examine(tmp_path, repair=True)
    assert texts(findings, False) == []
    assert "moved to runs.db.damaged-" in findings[1].text
    [aside] = tmp_path.glob("runs.db.damaged-*")
    assert aside.read_bytes().startswith(b"this is not the SQLite header")
    fresh = Store(tmp_path)
    assert fresh.list_runs() == [] and (tmp_path / "runs" / str(run_id) / "logs").is_dir()
    assert fresh.create_run("probe", {}, [], "h") == run_id + 1  # the kept folder is not reused
