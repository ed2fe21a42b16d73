"""liger-kernel's dispatcher logs a warning for every backend of an op that does not import (CuTe DSL,
Ascend NPU, cuTile: packages a CUDA machine does not have): a dozen lines in every training run's log.
A rank keeps them out of its log (engines/distributed.py:quiet_unused_liger_backends) and lets every
other line of that logger through, a failing Triton backend (the one gpuscale uses) above all.

Each test runs a real rank body (`run_rank`: its log file, its logging set-up) in a fresh interpreter
whose work logs what liger logs: through liger's own dispatcher where liger-kernel is installed, and
the same record by hand otherwise (liger-kernel is the `gpu` extra; CI has no CUDA)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# What liger-kernel 0.8.5 logs (liger_kernel/backends/registry.py:_discover), one line a backend.
LIGER_FORMAT = "Backend impl '%s' for op '%s' could not be imported: %s: %s"


def rank_log(tmp_path: Path, work: str) -> str:
    """rank 0's log of a one-rank run whose work is `work` (Python, in the rank's main)."""
    (tmp_path / "settings.json").write_text(json.dumps({}))
    script = textwrap.dedent("""
        import logging, sys
        from gpuscale.engines.distributed import run_rank
        from gpuscale.runs.settings import RunSettings

        def main(settings, ctx, reporter):
        {work}

        run_rank(RunSettings, main, sys.argv[1])
    """).format(work=textwrap.indent(textwrap.dedent(work), "    "))
    env = {"RANK": "0", "WORLD_SIZE": "1", "GPUSCALE_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "settings.json")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr + (tmp_path / "logs" / "rank0.log").read_text()
    return (tmp_path / "logs" / "rank0.log").read_text()


def test_lines_about_backends_not_installed_stay_out_of_the_rank_log(tmp_path):
    log = rank_log(tmp_path, f"""
        liger = logging.getLogger("liger_kernel.backends.registry")
        for backend in ("_cutedsl", "_ascend", "_cutile", "_triton"):
            liger.warning({LIGER_FORMAT!r}, f"liger_kernel.ops.backends.{{backend}}.rms_norm", "rms_norm",
                          "ModuleNotFoundError", "No module named 'cutlass'")
        liger.warning("_discover('rms_norm'): all declared paths imported but no @register_op ran")
        logging.getLogger("elsewhere").warning("another library's warning")
        print("work done", flush=True)
    """)
    assert "work done" in log
    assert "_cutedsl" not in log and "_ascend" not in log and "_cutile" not in log, log
    # The backend gpuscale uses, failing, is said; so is any other warning of liger's, and of anyone's.
    assert "Backend impl 'liger_kernel.ops.backends._triton.rms_norm' for op 'rms_norm' could not be imported" in log
    assert "no @register_op ran" in log and "another library's warning" in log


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_liger_own_dispatcher_leaves_no_line_about_an_uninstalled_backend(tmp_path):
    log = rank_log(tmp_path, """
        import liger_kernel
        print("impls", liger_kernel.available_impls("rms_norm"), flush=True)
    """)
    assert "impls" in log
    assert "_cutedsl" not in log and "_ascend" not in log, log
