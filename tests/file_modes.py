"""Tests of a GPUSCALE_HOME that file modes make read-only or unreadable.

Root ignores file modes (CAP_DAC_OVERRIDE and friends), and CI runs the suite as root. There the
process under test runs with those capabilities dropped from its bounding set (util-linux's setpriv):
a mode of 0555 then stops its writes exactly as it stops any user's. As another user nothing needs
dropping. (A module of its own: the CLI and the TUI tests both use it.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from gpuscale.control.store import Store

NO_FILE_OVERRIDE = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]


def as_file_modes_apply(tmp_path) -> list[str]:
    """The argv prefix under which file modes bind a process; skips the test where that cannot be had."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: file modes would not stop the CLI's writes")
    probe = tmp_path / "mode-probe"
    probe.mkdir(mode=0o555)
    attempt = f"try:\n    open({str(probe / 'x')!r}, 'w')\nexcept PermissionError:\n    raise SystemExit(13)"
    tried = subprocess.run([*NO_FILE_OVERRIDE, sys.executable, "-c", attempt], capture_output=True, text=True)
    probe.chmod(0o755)
    if tried.returncode != 13:  # 0: root still writes; anything else: setpriv itself failed
        pytest.skip(f"file modes cannot be made to bind root here: {tried.stderr.strip() or 'it still writes'}")
    return NO_FILE_OVERRIDE


def write_history(home) -> int:
    """One finished run with a metric and a folder, written as a run would leave it (store closed)."""
    store = Store(home)
    run_id = store.create_run("probe", {"batch_size": 2}, ["true"], "host")
    (home / "runs" / str(run_id) / "logs").mkdir(parents=True)
    (home / "runs" / str(run_id) / "logs" / "rank0.log").write_text("rank 0/1\n")
    store.add_rows([{"run_id": run_id, "rank": 0, "t": 1.0, "step": 1, "name": "tokens", "value": 8.0}], [])
    store.finish_run(run_id, "succeeded", summary={"tokens_per_s": 5.0})
    store.close()
    return run_id


def set_modes(home, mode: int) -> None:
    """`mode` on the home and every folder in it; its files get the same without any x bit."""
    for path in [home, *home.rglob("*")]:
        path.chmod(mode if path.is_dir() else mode & 0o444)
