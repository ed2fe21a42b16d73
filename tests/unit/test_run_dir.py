"""RunDir: the run folder's layout, the one place that spells it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuscale.runs.run_dir import RunDir, merge_results


def test_the_layout(tmp_path):
    folder = RunDir(str(tmp_path))
    assert folder.root == tmp_path and isinstance(folder.root, Path)
    assert folder.settings == tmp_path / "settings.json"
    assert folder.plan == tmp_path / "plan.json"
    assert folder.results == tmp_path / "results.jsonl"
    assert folder.log(3) == tmp_path / "logs" / "rank3.log"
    assert folder.launcher_log == tmp_path / "logs" / "launcher.log"
    assert folder.supervisor_log == tmp_path / "logs" / "supervisor.log"
    assert folder.metrics(0) == tmp_path / "metrics" / "rank0.jsonl"
    assert folder.error(1) == tmp_path / "errors" / "rank1.json"
    assert folder.rank_results(2) == tmp_path / "results" / "rank2.jsonl"
    assert (folder.model, folder.trainer, folder.checkpoints) == (
        tmp_path / "model", tmp_path / "trainer", tmp_path / "checkpoints")


def test_make_and_the_rank_files_in_rank_order_of_name(tmp_path):
    folder = RunDir(tmp_path / "run").make()
    assert all(path.is_dir() for path in (folder.logs, folder.metrics_dir, folder.errors_dir))
    for rank in (1, 0):
        folder.log(rank).write_text("")
        folder.metrics(rank).write_text("")
        folder.error(rank).write_text("{}")
    folder.launcher_log.write_text("")  # not a rank's log
    folder.results_dir.mkdir()
    folder.rank_results(0).write_text("")
    assert folder.rank_logs() == [folder.log(0), folder.log(1)]
    assert folder.metrics_files() == [folder.metrics(0), folder.metrics(1)]
    assert folder.error_files() == [folder.error(0), folder.error(1)]
    assert folder.rank_results_files() == [folder.rank_results(0)]


def test_frozen_and_compared_by_root(tmp_path):
    assert RunDir(tmp_path) == RunDir(str(tmp_path))
    with pytest.raises(AttributeError):
        RunDir(tmp_path).root = Path("/")  # type: ignore[misc]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rank_results_are_merged_in_example_order_skipping_a_torn_line(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "rank0.jsonl").write_text('{"index": 2, "chain": 0}\n{"index": 0, "chain": 1}\n'
                                         '{"index": 0, "chain": 0}\n')
    (results / "rank1.jsonl").write_text('{"index": 1, "chain": 0}\n{"index": 3, "cha')  # killed mid-write
    merged = merge_results(tmp_path)
    assert merged == tmp_path / "results.jsonl"
    assert [(r["index"], r["chain"]) for r in rows_of(merged)] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    # Rank 0's own merge wins: an existing results.jsonl is never replaced.
    merged.write_text('{"index": 9}\n')
    assert merge_results(tmp_path) is None and merged.read_text() == '{"index": 9}\n'
    assert merge_results(tmp_path / "nothing") is None


def test_rank_0s_gathered_rows_are_written_in_the_same_order(tmp_path):
    """Rank 0's merge (power sampling's gathered rows) and the files' merge order rows alike: by index,
    then chain; rows without an index as they come."""
    gathered = [{"index": 1, "chain": 1}, {"index": 0}, {"index": 1, "chain": 0}, {"index": 0, "chain": 2}]
    merged = merge_results(tmp_path, gathered)
    assert rows_of(merged) == [{"index": 0}, {"index": 0, "chain": 2}, {"index": 1, "chain": 0},
                               {"index": 1, "chain": 1}]
    merged = merge_results(tmp_path, [{"index": 0}, {"index": 1}])  # rank 0 writes over any earlier file
    assert rows_of(merged) == [{"index": 0}, {"index": 1}]
    unindexed = [{"question": "b"}, {"question": "a"}, {"index": 0}]
    assert rows_of(merge_results(tmp_path, unindexed)) == unindexed
    assert merge_results(tmp_path, []).read_text() == ""  # a rank 0 with nothing to merge writes an empty file

