"""Rank metrics, the writing side: `Reporter.log(step=..., tokens=..., loss=...)` appends one line per
call to RUN_DIR/metrics/rank<R>.jsonl; standard names are tokens and samples (counts done since the
last call), loss, reward, accuracy, and any other scalar. `Reporter.summary({...})` writes the rank's
final figures (rank 0's is the run's summary). A plain file keeps ranks free of database locks and
works the same on every node. The supervisor reads the files back with `gpuscale.runs.metrics`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from gpuscale.runs.run_dir import RunDir


class Reporter:
    def __init__(self, run_dir: str | Path, rank: int):
        self.rank = rank
        path = RunDir(run_dir).metrics(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered: the supervisor sees each line at once. Held for the rank's life; close() ends it.
        self._file = open(path, "a", buffering=1)  # noqa: SIM115
        self._fault = _parse_fault(os.environ.get("GPUSCALE_INJECT_FAULT"), rank)

    def log(self, step: int, **scalars: float) -> None:
        record = {"t": time.time(), "rank": self.rank, "step": int(step)}
        record.update({k: float(v) for k, v in scalars.items() if v is not None})
        self._file.write(json.dumps(record) + "\n")
        self._maybe_fail(step)

    def total(self, steps: int) -> None:
        """How many steps this rank will log in all: the front ends show progress and ETA from it."""
        self._file.write(json.dumps({"t": time.time(), "rank": self.rank, "step": 0, "total": steps}) + "\n")

    def summary(self, figures: dict[str, Any]) -> None:
        self._file.write(json.dumps({"t": time.time(), "rank": self.rank, "summary": figures}) + "\n")

    def close(self) -> None:
        self._file.close()

    def _maybe_fail(self, step: int) -> None:
        # Fault injection, for testing failure handling end to end: GPUSCALE_INJECT_FAULT=RANK:KIND:STEP
        if self._fault and step >= self._fault[1]:
            kind = self._fault[0]
            if kind == "oom":
                import torch

                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected fault)")
            raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")


def _parse_fault(spec: str | None, rank: int) -> tuple[str, int] | None:
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 3 or int(parts[0]) != rank:
        return None
    return parts[1], int(parts[2])
