"""File modes of a run: they follow the user's umask, and a private run (`private`, GPUSCALE_PRIVATE=1) keeps
its folder 0700 and its files 0600 whatever the umask, the history too where that run creates it."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # real runs

QUICK_PROBE = ["run", "--recipe", "probe", "--gpus", "1", "--set", "steps=2", "--set", "warmup_steps=0", "--json"]


def start_under_umask(umask: int, home: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`gpuscale ARGS` as started from a shell whose umask is `umask`."""
    return subprocess.Popen([sys.executable, "-m", "gpuscale.app.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.umask(umask),
                            env={**os.environ, "GPUSCALE_HOME": str(home), **(env or {})})


def finished(front: subprocess.Popen) -> dict:
    out, err = front.communicate(timeout=240)
    assert front.returncode == 0, err
    run = json.loads(out)
    assert run["status"] == "succeeded", run["error"]
    return run


def modes(root: Path) -> dict[str, int]:
    """Every folder's and file's permission bits under `root`, `root` itself as '.'."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_a_private_run_and_a_history_it_creates_are_the_user_s_alone_and_others_follow_the_umask(tmp_path):
    private_home, shared_home = tmp_path / "private-home", tmp_path / "shared-home"
    fronts = [start_under_umask(0o022, private_home, *QUICK_PROBE, env={"GPUSCALE_PRIVATE": "1"}),
              start_under_umask(0o027, shared_home, *QUICK_PROBE)]
    private, shared = (finished(front) for front in fronts)
    assert private["settings"]["private"] is True and shared["settings"]["private"] is False

    private_modes = modes(Path(private["run_dir"]))
    assert {"settings.json", "run.json", "logs/rank0.log", "logs/supervisor.log", "metrics/rank0.jsonl"} \
        <= set(private_modes)
    assert {name: mode for name, mode in private_modes.items()
            if mode != (0o700 if (Path(private["run_dir"]) / name).is_dir() else 0o600)} == {}
    # The history the run created with it, its WAL files, and the folders above the run's.
    for path in (private_home, private_home / "runs", private_home / "runs.db"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in private_home.glob("runs.db*"))

    # Without `private`, every file follows the umask the user started gpuscale under (027 here).
    shared_modes = modes(Path(shared["run_dir"]))
    assert {name: mode for name, mode in shared_modes.items()
            if mode != (0o750 if (Path(shared["run_dir"]) / name).is_dir() else 0o640)} == {}
    assert stat.S_IMODE((shared_home / "runs.db").stat().st_mode) == 0o640

