import json

from gpuscale.engines.metrics import MetricsTailer, Reporter, Throughput


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
