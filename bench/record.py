"""One schema for every bench result: `write_result` writes it, every bench script calls it.

A result file holds: date (ISO 8601, UTC), commit (`git rev-parse HEAD` of the checkout, null outside
git), tracked_files_match_commit (false when tracked files differ from that commit), command (the
script's command line, shell-quoted), card ({"names": [...], "count": N} of the visible CUDA devices,
or "cpu"), versions (python and, where installed, torch, transformers, trl, accelerate, peft, liger-kernel),
defaults_fingerprints (each recipe's defaults, hashed: a figure measured at other defaults is stale),
test_split (which of tiny-math's test splits `test` meant: data/splits.py; a result with none is test-v1's),
settings and figures (the script's own). By default it goes to bench/results/<recipe>/<name>-<date>-<card>.json;
a script's --out names another path.

Nothing here imports torch: the card comes from torch if the caller already imported it, else from
nvidia-smi; versions come from the installed packages' metadata.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
ROOT = BENCH.parent
PACKAGES = ("torch", "transformers", "trl", "accelerate", "peft", "liger-kernel")


def git(*args: str) -> str | None:
    """`git ARGS` in the checkout: its output, None outside git or on failure."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


# The commit a copy of the tree was taken at, given where the copy's .git is older than its files: the GPU
# machine's copy of a working tree keeps the .git of the session's start (`export GPUSCALE_TREE_COMMIT=$(git
# rev-parse HEAD)` written into the device's command line from the checkout it copies).
TREE_COMMIT_ENV = "GPUSCALE_TREE_COMMIT"


def commit() -> str | None:
    return os.environ.get(TREE_COMMIT_ENV, "").strip() or (git("rev-parse", "HEAD") or "").strip() or None


def tracked_files_match_commit() -> bool | None:
    """Whether the tracked files are the commit's (None outside git, or where the commit was given by
    TREE_COMMIT_ENV: this copy's .git cannot say). A copy of a working tree sent to a GPU machine with an
    older .git reported that older commit as HEAD while it ran newer files: this says so in the result
    rather than let the commit vouch for code it did not hold."""
    if os.environ.get(TREE_COMMIT_ENV, "").strip():
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return None if changes is None else not changes.strip()


def defaults_fingerprints() -> dict[str, str] | None:
    """Every recipe's defaults fingerprint (recipes/shared/defaults_fingerprint.py): what a figure measured
    at the defaults was measured with. None where gpuscale cannot be imported."""
    sys.path.insert(0, str(ROOT))
    try:
        from gpuscale.recipes.shared.defaults_fingerprint import defaults_fingerprints as fingerprints
    except ImportError:
        return None
    return fingerprints()


def test_split() -> str | None:
    """Which of tiny-math's test splits `test` means (data/splits.py); None where gpuscale cannot be imported."""
    sys.path.insert(0, str(ROOT))
    try:
        from gpuscale.data.splits import TEST_SPLIT_EDITION
    except ImportError:
        return None
    return TEST_SPLIT_EDITION


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed from the repository root: `python bench/x.py --flag value`, shell-quoted."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        try:
            argv[0] = os.path.relpath(os.path.abspath(argv[0]), ROOT)
        except ValueError:  # another drive
            pass
    return shlex.join(["python", *argv])


def card() -> dict | str:
    """The visible CUDA devices: {"names": [...], "count": N}, or "cpu" when there are none."""
    names: list[str] = []
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception:  # a broken driver: fall back to nvidia-smi
            names = []
    if not names and os.environ.get("CUDA_VISIBLE_DEVICES") != "" and shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20)
            rows = [line.split(",", 1) for line in done.stdout.splitlines() if "," in line]
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                wanted = [part.strip() for part in visible.split(",")]
                rows = [row for row in rows if row[0].strip() in wanted]
            names = [name.strip() for _, name in rows] if done.returncode == 0 else []
        except (OSError, subprocess.SubprocessError):
            names = []
    return {"names": names, "count": len(names)} if names else "cpu"


def one_card(name: str) -> dict | str:
    """The card of a measurement on one device, by its name ("cpu..." for the CPU)."""
    return "cpu" if name.lower().startswith("cpu") else {"names": [name], "count": 1}


def card_label(found: dict | str) -> str:
    """A file name's card part: "cpu", "h100", "h200x2" (the model number of the first card, x the count)."""
    if found == "cpu" or not isinstance(found, dict) or not found.get("names"):
        return "cpu"
    name = found["names"][0]
    match = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]*)\b", name.replace("NVIDIA", ""))
    label = (match.group(1) if match else re.sub(r"[^a-z0-9]+", "", name.lower())[:12] or "gpu").lower()
    return label if found["count"] == 1 else f"{label}x{found['count']}"


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def record(settings: dict, figures: dict, command: str | None = None, card_found: dict | str | None = None) -> dict:
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": commit(),
            "tracked_files_match_commit": tracked_files_match_commit(),
            "command": command if command is not None else command_line(),
            "card": card_found if card_found is not None else card(), "versions": versions(),
            "defaults_fingerprints": defaults_fingerprints(), "test_split": test_split(), "settings": settings,
            "figures": figures}


def parse_card(text: str | None) -> dict | None:
    """"1 x NVIDIA H200" -> {"names": ["NVIDIA H200"], "count": 1} (bench/record.py's card); None: none given."""
    if text is None:
        return None
    count, times, name = text.partition(" x ")
    if not times or not count.strip().isdigit() or not name.strip():
        raise SystemExit(f"--card: {text!r} is not 'N x NAME', e.g. '1 x NVIDIA H200'")
    return {"names": [name.strip()] * int(count), "count": int(count)}


def default_path(recipe: str, name: str, date: str, card_found: dict | str) -> Path:
    stem = f"{name}-{date[:10]}-{card_label(card_found)}"
    path = RESULTS / recipe / f"{stem}.json"
    number = 2
    while path.exists():  # never overwrite a measurement; rename the new file to say what differs
        path = RESULTS / recipe / f"{stem}-run{number}.json"
        number += 1
    return path


def write_result(recipe: str, name: str, settings: dict, figures: dict, command: str | None = None,
                 out: str | os.PathLike | None = None, card: dict | str | None = None) -> Path:
    """Write one result in the shared schema and return its path.

    recipe: the folder under bench/results/ (power_sampling, eggroll, rft, grpo_mtl, sft, probe, tune,
    generation, tui, scaling, diagnosis); name: what was measured, the file name's first part;
    command: default the running script's command line; out: write there instead of the default
    path; card: what to record instead of the visible CUDA devices (e.g. "cpu" for CPU ranks)."""
    result = record(settings, figures, command, card)
    path = Path(out) if out else default_path(recipe, name, result["date"], result["card"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"written to {path}", flush=True)
    return path


def figures_of(data: dict) -> dict:
    """A result's figures, from the shared schema or an older per-script file (the whole file)."""
    return data["figures"] if {"date", "commit", "command", "figures"} <= set(data) else data
