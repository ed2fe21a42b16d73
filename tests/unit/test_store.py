import multiprocessing
import sqlite3

import pytest

from gpuscale.engines.store import SCHEMA_VERSION, Store, UnknownRun


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
        store.add_rows([{"run_id": run_id, "rank": worker, "t": float(i), "step": i, "name": "tokens", "value": 1.0}], [])


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
