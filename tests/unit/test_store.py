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
        {**gpu, "t": 1.0, "mem_used_mb": 10_000.0, "run_mem_mb": 9_000.0, "util": 40.0},
        {**gpu, "t": 2.0, "mem_used_mb": 30_000.0, "run_mem_mb": 29_000.0, "util": 80.0},
        {"run_id": run_id, "t": 2.0, "kind": "rank", "idx": 0, "name": "rank 0", "run_mem_mb": 700.0},
        {"run_id": run_id, "t": 2.0, "kind": "host", "idx": -1, "name": "cpu", "mem_used_mb": 99_999.0},
        {**gpu, "run_id": other, "t": 2.0, "mem_used_mb": 79_000.0, "run_mem_mb": 79_000.0, "util": 100.0},
    ])
    peaks = store.device_peaks(run_id)
    assert [(p["kind"], p["idx"]) for p in peaks] == [("gpu", 1), ("rank", 0)]  # no host, no other run
    assert peaks[0] == {"kind": "gpu", "idx": 1, "name": "H100", "peak_mem_used_mb": 30_000.0,
                        "mem_total_mb": 80_000.0, "peak_run_mem_mb": 29_000.0, "mean_util": 60.0, "samples": 2}
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
