"""RFT's generated set on disk: where an earlier run's is, reading and writing it (no torch: the
front end's check uses it too)."""

from __future__ import annotations

import json
from pathlib import Path

from gpuscale.runs.settings import SettingsError

GENERATED_FILE = "generated.jsonl"
GENERATION_FILE = "generation.json"  # the generation's figures (yield...), for a later data_from


def generated_set_path(data_from: str) -> Path:
    """The generated.jsonl that `data_from` names: a run folder or the file itself (a run id the user
    gave is that run's folder by now: the front end resolves it before launch,
    control/launch.py:run_ids_as_folders); for a run stopped while generating, the partial kept set its
    ranks saved (results.jsonl). SettingsError with one line if there is none."""
    text = str(data_from).strip()
    path = Path(text).expanduser()
    path = kept_set_in(path) if path.is_dir() else path
    if not path.is_file():
        raise SettingsError(f"data_from: {text!r}: {path} does not exist (a run of rft that finished generating "
                            "has one)")
    return path


def kept_set_in(run_dir: Path) -> Path:
    """A run folder's whole kept set, or else the partial one of a run stopped while generating."""
    from gpuscale.runs.run_dir import RunDir

    whole, partial = run_dir / GENERATED_FILE, RunDir(run_dir).results
    return partial if not whole.is_file() and partial.is_file() else whole


def read_generated(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise SettingsError(f"data_from: {path} holds no examples")
    return rows


def read_generation_figures(path: Path) -> dict:
    """The figures the run that generated `path` recorded next to it ({} if none)."""
    figures = Path(path).with_name(GENERATION_FILE)
    return json.loads(figures.read_text()) if figures.is_file() else {}


def write_generated(run_dir: Path, rows: list[dict], figures: dict) -> Path:
    from gpuscale.runs.run_dir import write_atomically

    path = Path(run_dir) / GENERATED_FILE
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
    write_atomically(path.with_name(GENERATION_FILE), json.dumps(figures, indent=1) + "\n")
    return path
