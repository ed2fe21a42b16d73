"""Checkpoints in a run folder, the plain-path side (no torch): RUN_DIR/checkpoints/checkpoint-<step>/.

Two writers share the layout: TRL's trainer (the sft, rft and grpo-mtl recipes) and gpuscale's own
loops (eggroll). A folder counts as a checkpoint only once it is complete: TRL writes
`trainer_state.json` after the model, optimizer, scheduler and RNG files; gpuscale's loops write the
whole folder under a temporary name and rename it into place (`writing_checkpoint`), with
`checkpoint.json` inside. A run killed while writing thus never leaves a folder that
`latest_checkpoint` would pick.

The control plane (`gpuscale resume`) and the ranks both use these.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuscale.runs.run_dir import RunDir

PREFIX = "checkpoint-"
# gpuscale's own marker, and the file TRL's trainer writes last.
MARKERS = ("checkpoint.json", "trainer_state.json")
_NAME = re.compile(rf"{PREFIX}(\d+)")


def checkpoint_step(path: str | Path) -> int | None:
    """The step in a `checkpoint-<step>` folder's name; None for any other name."""
    match = _NAME.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return checkpoint_step(path) is not None and path.is_dir() and any((path / m).is_file() for m in MARKERS)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints, oldest step first."""
    folder = RunDir(run_dir).checkpoints
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if is_complete(path)]
    return sorted(found, key=lambda path: checkpoint_step(path) or 0)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete `checkpoint-<step>` folder of the run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and partial folders left by a killed
    writer; returns what was deleted."""
    found = list_checkpoints(run_dir)
    doomed = found[: max(0, len(found) - max(1, keep))]
    folder = RunDir(run_dir).checkpoints
    if folder.is_dir():
        doomed += [path for path in folder.iterdir() if path.name.startswith(f".{PREFIX}")]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


@contextmanager
def writing_checkpoint(run_dir: str | Path, step: int) -> Iterator[Path]:
    """A temporary folder to fill; renamed to checkpoints/checkpoint-<step> when the block ends
    without an error (removed otherwise). The caller writes `checkpoint.json` last inside it."""
    folder = RunDir(run_dir).checkpoints
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{PREFIX}{step}"
    partial = folder / f".{PREFIX}{step}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if final.exists():  # the same step written again: the newer copy wins
        shutil.rmtree(final)
    os.replace(partial, final)
