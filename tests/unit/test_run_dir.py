"""RunDir: the run folder's layout, the one place that spells it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuscale.runs.run_dir import RunDir


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
