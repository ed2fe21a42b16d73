"""A rank's per-example results kept on disk as it goes (`RankResults`, RUN_DIR/results/rank<R>.jsonl),
and rank 0's merge of every rank's rows into RUN_DIR/results.jsonl (`merge_results`)."""

from __future__ import annotations

import json
from pathlib import Path

from gpuscale.runs.run_dir import RunDir, write_atomically


class RankResults:
    """A rank's per-example results, appended to RUN_DIR/results/rank<R>.jsonl as each batch is
    done: a run that is stopped or dies keeps what it finished. Rank 0 merges every rank's rows into
    RUN_DIR/results.jsonl at the end (`merge_results`); where it never gets there, whoever records the
    run's end merges the files (`gpuscale.control.store.merge_rank_results`)."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = RunDir(run_dir).rank_results(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.rows: list[dict] = []

    def add(self, rows: list[dict]) -> None:
        self.rows += rows
        with self.path.open("a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


def merge_results(run_dir: Path, rows: list[dict], key=lambda row: (row["index"], row.get("chain", 0))) -> Path:
    """Every rank's rows, in example order, as RUN_DIR/results.jsonl (written by rank 0, whole or not
    at all: a run stopped meanwhile gets the supervisor's merge of the rank files instead)."""
    path = RunDir(run_dir).results
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in sorted(rows, key=key)))
    return path
