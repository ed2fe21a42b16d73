"""The monitor's feed on a real store: only new rows read, late ranks never missed, chart series,
device rows on GPU and CPU machines; and the log tail."""

from __future__ import annotations

import pytest

from gpuscale.app.views import feed as feeds
from gpuscale.app.views.feed import RunFeed
from gpuscale.app.views.logs import LogTail, read_lines
from gpuscale.control.store import Store

NOW = 1_000_000.0


def gpu(idx: int, t: float, used: float, util: float, total: float = 80_000.0) -> dict:
    return {"kind": "gpu", "idx": idx, "t": t, "name": "NVIDIA H100 80GB HBM3", "mem_used_mb": used,
            "mem_total_mb": total, "util": util, "power_w": 300.0, "temp_c": 60.0, "run_mem_mb": used}


# ---- the feed, on a real store -------------------------------------------------------------------


def metric(run_id: int, rank: int, t: float, name: str, value: float, step: int = 1) -> dict:
    return {"run_id": run_id, "rank": rank, "t": t, "step": step, "name": name, "value": value}


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path)


def test_feed_reads_only_new_rows_and_never_misses_a_late_rank(store):
    run = store.create_run("probe", {}, [], "host")
    other = store.create_run("probe", {}, [], "host")
    feed = RunFeed(run)
    store.add_rows([metric(run, 0, NOW - 5.5, "tokens", 100.0), metric(other, 0, NOW - 5.5, "tokens", 7.0)], [])
    assert feed.poll(store, NOW)
    store.add_rows([metric(run, 0, NOW - 2.5, "tokens", 100.0)], [])
    assert feed.poll(store, NOW)
    # Rank 1's line for an earlier second reaches the store after rank 0's later one.
    store.add_rows([metric(run, 1, NOW - 5.2, "tokens", 50.0)], [])
    assert feed.poll(store, NOW)
    assert not feed.poll(store, NOW)  # nothing new
    assert feed.counts[("tokens", 0)] == {int(NOW - 6): 100.0, int(NOW - 3): 100.0}
    assert feed.counts[("tokens", 1)] == {int(NOW - 6): 50.0}
    assert feed.ranks() == [0, 1] and feed.first_work_t == NOW - 5.5
    series = feeds.rate_series(feed, "tokens", NOW, window_s=10, points=10)
    assert series.ys[-6:] == (150.0, 0.0, 0.0, 100.0, 0.0, 0.0)  # per second, both ranks
    assert series.xs == tuple(float(x) for x in range(-9, 1))  # each bucket's end, relative to now
    assert feeds.rate_series(feed, "tokens", NOW, 10, 10, rank=1).ys[4] == 50.0
    assert feeds.rate_series(feed, "tokens", NOW, 10, 5).ys[2] == 75.0  # 2 s buckets: 150 tokens / 2 s


def test_feed_figures_are_means_and_old_buckets_are_forgotten(store):
    run = store.create_run("probe", {}, [], "host")
    feed = RunFeed(run, keep_s=60)
    store.add_rows([metric(run, 0, NOW - 1.5, "loss", 1.0), metric(run, 1, NOW - 1.5, "loss", 3.0),
                    metric(run, 0, NOW - 1.5, "reward", 0.5), metric(run, 0, NOW - 1.5, "total", 9.0),
                    metric(run, 0, NOW - 300, "loss", 9.0)], [])
    feed.poll(store, NOW)
    assert feed.figure_names() == ["reward", "loss"]  # the usual ones first; counts and totals are no figures
    assert feeds.figure_series(feed, "loss", NOW, 10, 10).ys == (2.0,)
    assert int(NOW - 300) not in feed.figures["loss"]


def test_device_views_on_gpu_and_on_cpu(store):
    run = store.create_run("probe", {}, [], "host")
    rows = []
    for s in range(5):
        t = NOW - 5 + s
        rows.append({**gpu(1, t, 40_000.0, 90.0 + s), "run_id": run})
        rows.append({**gpu(0, t, 20_000.0, 50.0), "run_id": run})
        rows.append({"run_id": run, "t": t, "kind": "rank", "idx": 0, "name": "rank 0", "run_mem_mb": 300.0 + s,
                     "mem_total_mb": 16_000.0})
        rows.append({"run_id": run, "t": t, "kind": "host", "idx": -1, "name": "cpu", "mem_used_mb": 4_000.0,
                     "mem_total_mb": 16_000.0, "util": 75.0, "run_mem_mb": 600.0})
    store.add_rows([], rows)
    feed = RunFeed(run)
    feed.poll(store, NOW)
    views = feeds.device_views(feed, NOW, window_s=60)
    assert [v.label for v in views] == ["GPU 0 H100 80GB HBM3", "GPU 1 H100 80GB HBM3", "host CPU", "rank 0"]
    gpu1, host, rank0 = views[1], views[2], views[3]
    assert gpu1.util_series == (90.0, 91.0, 92.0, 93.0, 94.0) and gpu1.mem_series[0] == 50.0
    assert gpu1.mem_text == "39.1/78.1 GiB 50%" and gpu1.detail_text == " 94%  300 W  60°C"
    assert host.mem_text == "3.9/15.6 GiB 25%" and host.detail_text == " 75%"
    assert rank0.mem_text == "RSS 304 MiB" and rank0.mem_series == (300.0, 301.0, 302.0, 303.0, 304.0)
    assert len(feed.samples_since(NOW - 2)) == 2 * 4


def test_stored_resolution_gives_a_few_hundred_buckets():
    assert feeds.stored_resolution(60) == 1.0
    assert feeds.stored_resolution(36_000) == 120.0


# ---- logs ----------------------------------------------------------------------------------------


def test_log_tail_reads_the_end_then_only_what_is_new(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("x" * 40_000 + "\nfirst\nsecond\n")
    (logs / "rank10.log").write_text("ten\n")
    (logs / "rank2.log").write_text("two\npartial")
    (logs / "supervisor.log").write_text("not shown\n")
    tail = LogTail(logs, keep_lines=3)
    assert tail.read_new() == 4
    assert tail.sources() == ["rank0", "rank2", "rank10"]
    assert tail.lines("rank0") == ["first", "second"]  # the cut first line is dropped
    with open(logs / "rank2.log", "a") as handle:
        handle.write(" line\nthree\nfour\n")
    assert tail.read_new() == 3
    assert tail.lines("rank2") == ["partial line", "three", "four"]  # the last 3 kept
    assert tail.lines()[0] == "[rank0] first"


def test_read_lines_returns_complete_lines_and_where_to_go_on(tmp_path):
    path = tmp_path / "rank0.log"
    path.write_bytes(b"one\ntwo\nthr")
    lines, offset = read_lines(path, 0)
    assert lines == ["one", "two"] and offset == len("one\ntwo\n")
    with open(path, "ab") as handle:
        handle.write(b"ee\n")
    assert read_lines(path, offset) == (["three"], offset + len("three\n"))
    assert read_lines(path, 0, limit=5) == (["one"], 4)  # a limit inside a line stops before it
