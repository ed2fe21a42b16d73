"""The run folder's layout, in one place: every path a front end, the supervisor or a rank reads or
writes under RUN_DIR goes through `RunDir`.

    RUN_DIR/
        settings.json           the run's settings (the recipe's pydantic model), read by every rank
        run.json                what the history records of the run besides (recipe, command, host,
                                label, notes, parent_id; at its end `ended`: status, error, summary),
                                so that a history lost can be rebuilt from the folders
        plan.json               the device plan: number of ranks and GPU indices
        logs/rank<R>.log        each rank's stdout and stderr
        logs/launcher.log       torchrun's or accelerate's own output (a one-process run, which has no
                                launcher: what its rank wrote before it opened its own log)
        logs/supervisor.log     the supervisor's
        metrics/rank<R>.jsonl   each rank's metric lines (engines.reporter.Reporter)
        errors/rank<R>.json     the error a rank died of
        errors/stacks-rank<R>.txt  each rank's Python stacks, asked for by the supervisor of a hung run
        errors/hung.json        where each rank stood when its run was ended as hung (control/hang_watch.py)
        results/rank<R>.jsonl   each rank's per-example results, as they are done
        results.jsonl           every rank's results merged, in example order
        generations.jsonl       a bounded selection of what the model generated, by step
                                (runs/generations.py; samples.jsonl in a run made before the rename)
        held_out.jsonl          a held-out evaluation's answers, each with its gold and extracted answer
                                (the first evaluation's and the latest; runs/generations.py)
        model/                  a trained model and its tokenizer
        trainer/                TRL's output folder
        checkpoints/            checkpoint-<step>/ folders to resume from (runs/checkpoints.py)
        .room-reserve           room the supervisor keeps while the run lives and frees to record its
                                end on a disk the run filled (control/disk_space.py)

Plain paths only (no torch): the front ends, the supervisor and the ranks all use it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

# The folders a run starts with; the others are made by whoever writes into them.
START_FOLDERS = ("logs", "metrics", "errors")
# What a run's generations file was called before it was named for them (a run folder keeps its files).
GENERATIONS_BEFORE_RENAME = "samples.jsonl"


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    # ---- files ----

    @property
    def settings(self) -> Path:
        return self.root / "settings.json"

    @property
    def run_info(self) -> Path:
        return self.root / "run.json"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def results(self) -> Path:
        return self.root / "results.jsonl"

    @property
    def generations(self) -> Path:
        """What the model generated, a few per step (runs/generations.py): where a rank writes it."""
        return self.root / "generations.jsonl"

    @property
    def held_out_answers(self) -> Path:
        """The held-out evaluations' answers (runs/generations.py: `add_held_out`)."""
        return self.root / "held_out.jsonl"

    @property
    def generations_to_read(self) -> Path:
        """The generations file a reader opens: `generations`, or, in a run folder that has only the
        older name (`GENERATIONS_BEFORE_RENAME`: a run made before the rename), that one."""
        old = self.root / GENERATIONS_BEFORE_RENAME
        return old if not self.generations.exists() and old.exists() else self.generations

    # ---- folders ----

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    @property
    def errors_dir(self) -> Path:
        return self.root / "errors"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def trainer(self) -> Path:
        return self.root / "trainer"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard's event files, for a training run with `report_to` tensorboard (the ranks'
        TENSORBOARD_LOGGING_DIR, unless the user set it): `tensorboard --logdir HOME/runs` shows every
        run by its id."""
        return self.root / "tensorboard"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"checkpoint-{step}"

    @property
    def preempted(self) -> Path:
        """Written by rank 0 when the run ends on SLURM's signal: the step and the checkpoint (or
        none) it ended with (engines/preemption.py)."""
        return self.root / "preempted.json"

    @property
    def room_reserve(self) -> Path:
        return self.root / ".room-reserve"

    # ---- per rank ----

    def log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def metrics(self, rank: int) -> Path:
        return self.metrics_dir / f"rank{rank}.jsonl"

    def error(self, rank: int) -> Path:
        return self.errors_dir / f"rank{rank}.json"

    def stacks(self, rank: int) -> Path:
        """Where the rank's Python stacks go when the supervisor asks for them (runs/heartbeat.py)."""
        return self.errors_dir / f"stacks-rank{rank}.txt"

    def rank_results(self, rank: int) -> Path:
        return self.results_dir / f"rank{rank}.jsonl"

    @property
    def launcher_log(self) -> Path:
        return self.logs / "launcher.log"

    @property
    def supervisor_log(self) -> Path:
        return self.logs / "supervisor.log"

    @property
    def hung(self) -> Path:
        """Where each rank stood when the run was ended as hung (phase, step, silence, stack)."""
        return self.errors_dir / "hung.json"

    # ---- every rank's files ----

    def rank_logs(self) -> list[Path]:
        return sorted(self.logs.glob("rank*.log"))

    def metrics_files(self) -> list[Path]:
        return sorted(self.metrics_dir.glob("rank*.jsonl"))

    def error_files(self) -> list[Path]:
        return sorted(self.errors_dir.glob("rank*.json"))

    def stacks_files(self) -> list[Path]:
        return sorted(self.errors_dir.glob("stacks-rank*.txt"))

    def rank_results_files(self) -> list[Path]:
        return sorted(self.results_dir.glob("rank*.jsonl"))

    # ---- run.json: the history's record of the run, kept in its folder ----

    def read_info(self) -> dict:
        """run.json's fields; {} where it is missing or unreadable (a folder of an older gpuscale,
        or a file torn by a full disk): the caller then falls back on the other evidence."""
        try:
            info = json.loads(self.run_info.read_text())
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def update_info(self, **fields) -> None:
        """Merge `fields` into run.json, written whole or not at all (a reader never sees half)."""
        write_atomically(self.run_info, json.dumps({**self.read_info(), **fields}, indent=1) + "\n")

    def record_end(self, status: str, **fields) -> None:
        """How the run ended, in run.json's `ended` (status, and error, hint, exit_code, summary...), written
        by whoever records the end in the history, before it does: the one evidence of a stop, and
        the end of a run whose history was damaged or replaced meanwhile."""
        self.update_info(ended={"status": status, "ended_at": time.time(), **fields})

    def try_record_end(self, status: str, **fields) -> OSError | None:
        """`record_end`, or where the folder cannot be written (a full disk) the error, for the caller
        to say: the end is then in the history alone, which must still be written."""
        try:
            self.record_end(status, **fields)
        except OSError as error:
            return error
        return None

    def make(self) -> RunDir:
        """Create the run folder and the folders a run starts with."""
        for name in START_FOLDERS:
            (self.root / name).mkdir(parents=True, exist_ok=True)
        return self


def write_atomically(path: Path, text: str) -> None:
    """Write a whole file or nothing: a reader (or a process killed mid-write) never sees half of it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def example_order(row: dict) -> tuple[int, int]:
    """The order of results.jsonl's rows: by example ("index"), then by sample of it ("chain": power
    sampling's several answers to one problem; 0 where a row has none)."""
    return row["index"], row.get("chain") or 0


def merge_results(run_dir: str | Path, rows: list[dict] | None = None) -> Path | None:
    """RUN_DIR/results.jsonl: every rank's per-example rows, in example order (`example_order`) where
    every row has an index, else as they come; written whole or not at all. Two writers:

    - rank 0 at the end of its run, with every rank's `rows` gathered: the file is written (over any);
    - whoever records the end of a run whose rank 0 never got there (stopped, failed, lost), without
      rows: they are read from the ranks' RUN_DIR/results/rank<R>.jsonl, so that what was finished is
      kept, a torn last line (a rank killed mid-write) skipped. Nothing is done where results.jsonl
      exists (rank 0's merge wins) or no rank wrote a row.

    Returns the merged file, or None where nothing was written."""
    folder = RunDir(run_dir)
    merged = folder.results
    if rows is None:
        if merged.exists():
            return None
        rows = []
        for path in folder.rank_results_files():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        if not rows:
            return None
    if all(isinstance(row, dict) and isinstance(row.get("index"), int) for row in rows):
        rows = sorted(rows, key=example_order)
    write_atomically(merged, "".join(json.dumps(row) + "\n" for row in rows))
    return merged
