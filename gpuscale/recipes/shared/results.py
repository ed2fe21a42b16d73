"""A rank's per-example results kept on disk as it goes (`RankResults`, RUN_DIR/results/rank<R>.jsonl);
rank 0 merges every rank's rows into RUN_DIR/results.jsonl with `gpuscale.runs.run_dir.merge_results`."""

from __future__ import annotations

import json
from pathlib import Path

from gpuscale.runs.run_dir import RunDir


class RankResults:
    """A rank's per-example results, appended to RUN_DIR/results/rank<R>.jsonl as each batch is
    done: a run that is stopped or dies keeps what it finished. Rank 0 merges every rank's rows into
    RUN_DIR/results.jsonl at the end; where it never gets there, whoever records the run's end merges
    the files (both through `gpuscale.runs.run_dir.merge_results`)."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = RunDir(run_dir).rank_results(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.rows: list[dict] = []

    def add(self, rows: list[dict]) -> None:
        self.rows += rows
        with self.path.open("a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)

