import json

from gpuscale.control.metrics_tail import RUN_WIDE_RANK, MetricsTailer, Throughput
from gpuscale.engines.reporter import Reporter


def test_reporter_and_tailer_roundtrip(tmp_path):
    reporter = Reporter(tmp_path, rank=1)
    reporter.total(3)
    reporter.log(step=1, tokens=8, loss=2.5, note=None)
    tailer = MetricsTailer(tmp_path / "metrics", run_id=7)
    rows = tailer.read_new()
    assert {(r["name"], r["value"]) for r in rows} == {("total", 3.0), ("tokens", 8.0), ("loss", 2.5)}
    assert all(r["run_id"] == 7 and r["rank"] == 1 for r in rows)
    assert tailer.read_new() == []  # nothing new
    reporter.summary({"accuracy": 0.5})
    reporter.close()
    assert tailer.read_new() == [] and tailer.summaries == {1: {"accuracy": 0.5}}


def test_tailer_waits_for_complete_lines_and_skips_torn_ones(tmp_path):
    path = tmp_path / "metrics" / "rank0.jsonl"
    path.parent.mkdir()
    line = json.dumps({"t": 1.0, "rank": 0, "step": 1, "tokens": 4})
    path.write_text(line[:10])
    tailer = MetricsTailer(path.parent, run_id=1)
    assert tailer.read_new() == []
    path.write_text(line + "\n" + "{torn\n" + json.dumps({"t": 2.0, "rank": 0, "step": 2, "tokens": 4}) + "\n")
    assert [r["step"] for r in tailer.read_new()] == [1, 2]


def test_throughput_rates_per_rank_and_total():
    tp = Throughput()
    rows = []
    for rank in (0, 1):
        rows.append({"rank": rank, "t": 100.0, "step": 0, "name": "total", "value": 10})
        for i in range(5):  # 100 tokens every 0.5 s = 200 tokens/s per rank
            rows.append({"rank": rank, "t": 100.0 + 0.5 * i, "step": i + 1, "name": "tokens", "value": 100})
    rows.append({"rank": 0, "t": 102.0, "step": 5, "name": "loss", "value": 1.5})
    tp.add(rows)
    progress = tp.progress(now=102.0)
    assert progress["tokens_per_s_by_rank"] == {"0": 200.0, "1": 200.0}
    assert progress["tokens_per_s"] == 400.0
    assert (progress["step"], progress["total"], progress["tokens"]) == (5, 10, 1000)
    assert progress["latest"] == {"loss": 1.5}


def accuracy_rows(rank: int, batches: list[tuple[int, int]], t0: float = 100.0) -> list[dict]:
    """What a rank logs per batch: `samples` done and its running accuracy so far (as power sampling does)."""
    rows, done, correct = [], 0, 0
    for step, (samples, right) in enumerate(batches, start=1):
        done, correct = done + samples, correct + right
        t = t0 + step
        rows += [{"rank": rank, "t": t, "step": step, "name": "samples", "value": samples},
                 {"rank": rank, "t": t, "step": step, "name": "accuracy", "value": correct / done}]
    return rows


def test_figures_combine_every_rank_weighted_by_samples():
    tp = Throughput()
    tp.add(accuracy_rows(0, [(2, 2), (2, 1)]))  # rank 0: 3 of 4 right, running value 0.75
    tp.add(accuracy_rows(1, [(4, 1), (4, 1)]))  # rank 1: 2 of 8 right, running value 0.25
    assert tp.latest["accuracy"] == 5 / 12  # the run's 5 of 12, not the last rank's 0.25 (or rank 0's 0.75)
    rows = tp.run_wide_rows(run_id=3)
    assert [(r["rank"], r["name"], r["value"], r["t"]) for r in rows] == [(RUN_WIDE_RANK, "accuracy", 5 / 12, 102.0)]
    assert tp.run_wide_rows(run_id=3) == []  # nothing changed since
    # Ranks that count no samples (a benchmark): the plain mean.
    bench = Throughput()
    bench.add([{"rank": r, "t": 1.0, "step": 1, "name": "step_time_ms", "value": v} for r, v in ((0, 10.0), (1, 20.0))])
    assert bench.latest == {"step_time_ms": 15.0}


def test_a_finished_runs_rates_are_its_averages_not_an_empty_window():
    tp = Throughput()
    tp.add([{"rank": r, "t": 100.0 + i, "step": i, "name": "tokens", "value": 50.0} for r in (0, 1) for i in range(5)])
    assert tp.progress(now=1000.0)["tokens_per_s"] == 0.0  # long after the ranks stopped: the window is empty
    final = tp.progress(now=1000.0, finished=True)
    assert final["tokens_per_s"] == 500.0 / 4.0 and final["tokens_per_s_by_rank"] == {"0": 62.5, "1": 62.5}


def test_a_partial_summary_is_merged_under_the_whole_one_and_stays_marked_until_it_comes(tmp_path):
    from gpuscale.control.supervisor import ended_summary

    reporter = Reporter(tmp_path, rank=0)
    tailer = MetricsTailer(tmp_path / "metrics", run_id=1)
    reporter.summary({"accuracy_greedy_before": 0.25, "model_dir": None}, partial=True)
    reporter.summary({"model_dir": "/runs/1/model"}, partial=True)
    tailer.read_new()
    written = tailer.summaries[0]
    assert written == {"accuracy_greedy_before": 0.25, "model_dir": "/runs/1/model", "partial": True}
    # A run that failed after it keeps those figures, over the progress-derived ones.
    failed = ended_summary(written, {"step": 3, "total": 10, "latest": {"loss": 1.5}}, succeeded=False)
    assert failed["accuracy_greedy_before"] == 0.25 and failed["loss"] == 1.5 and failed["steps_done"] == 3
    assert failed["partial"] is True
    # The whole summary, later, wins where it repeats a figure and ends the partial mark.
    reporter.summary({"accuracy_greedy_before": 0.5, "accuracy_greedy_after": 0.75})
    reporter.close()
    tailer.read_new()
    whole = tailer.summaries[0]
    assert whole == {"accuracy_greedy_before": 0.5, "accuracy_greedy_after": 0.75, "model_dir": "/runs/1/model"}
    assert ended_summary(whole, {"step": 3}, succeeded=False).items() >= whole.items()
    assert ended_summary(whole, {"step": 3}, succeeded=True) == whole


def test_point_faults_fire_at_their_point_only(tmp_path, monkeypatch):
    import pytest

    from gpuscale.engines.reporter import fail_if_injected, injected_fault

    monkeypatch.setenv("GPUSCALE_INJECT_FAULT", "0:final_eval:0")
    reporter = Reporter(tmp_path, rank=0)
    reporter.log(step=5, loss=1.0)  # a point fault is not a step fault
    reporter.close()
    assert injected_fault("final_eval", 0) == 0 and injected_fault("final_eval", 1) is None
    assert injected_fault("nan_reward", 0) is None
    fail_if_injected("final_eval", 1)
    with pytest.raises(RuntimeError, match="injected fault on rank 0 at final_eval"):
        fail_if_injected("final_eval", 0)


def test_the_pace_of_the_steps_is_measured_from_the_first_step_seen():
    """The supervisor reads the ranks' rows as they come: the first read that shows a step is where
    the ETA's pace starts (the loading and evaluation before it left out), and it stays there."""
    tp = Throughput()
    assert "paced_from_t" not in tp.progress(now=50.0)  # nothing logged yet: no pace
    tp.add([{"rank": r, "t": 100.0, "step": 1, "name": "tokens", "value": 1.0} for r in (0, 1)])
    first = tp.progress(now=100.5)
    assert (first["paced_from_t"], first["paced_from_step"]) == (100.0, 1)
    tp.add([{"rank": 0, "t": 110.0, "step": 11, "name": "tokens", "value": 1.0},
            {"rank": 1, "t": 111.0, "step": 9, "name": "tokens", "value": 1.0}])
    later = tp.progress(now=111.0)
    assert later["step"] == 9 and (later["paced_from_t"], later["paced_from_step"]) == (100.0, 1)
