"""Every figure the CLI prints goes through one formatter: no `1.275e+04`, no `None`, no Python
reprs of lists or dicts; and library FutureWarnings stay off the user's terminal."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from conftest import gpuscale
from gpuscale.app.batch_choice import trial_line, trial_rows, tuning_summary
from gpuscale.app.views.text import format_number
from gpuscale.control.store import Store


def test_missing_values_lists_and_dicts_read_plainly():
    assert format_number(None) == "—"
    assert format_number([1341.0, 1778.0]) == "1,341 1,778"
    assert format_number({"train": 12750.0, "eval": 0.5, "skip": None}) == "train 12,750 · eval 0.5 · skip —"
    assert format_number(12750.0) == "12,750" and format_number(0.000123) == "0.000123"


def test_tuning_lines_use_the_same_numbers():
    trial = SimpleNamespace(failure=None, over_cap=False, batch_size=64, throughput=12_750.0,
                            peak_memory_bytes=2_000_000_000, step_seconds=0.25, phase="double")
    assert "12,750 tokens_per_s" in trial_line(1, trial, "tokens_per_s")
    row = {"batch_size": 64, "throughput": 12_750.0, "figure": "tokens_per_s", "peak_memory_bytes": 2e9,
           "memory_total_bytes": 8e10, "device": "H100", "precision": "bf16", "created_at": 1.0}
    assert "tuned batch 64: 12,750 tokens_per_s" in tuning_summary(row)
    trials = [{**vars(trial), "failure": None}]
    assert trial_rows(trials, "tokens_per_s")[1][1] == "12,750"


def test_show_prints_figures_one_way(home):
    store = Store(home)
    run_id = store.create_run("probe", {"gpus": [0, 3], "batch_size": 8}, [], "h")
    store.update_run(run_id, status="succeeded", started_at=1.0, ended_at=2.0,
                     summary={"tokens_per_s": 12_750.0, "mfu": None, "peak_mem_mb_per_rank": [1341.0, 1778.0],
                              "by_phase": {"train": 1500.0}})
    store.close()
    result = gpuscale("show", str(run_id))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # A figure's line may end with what it counts, in brackets (data/figures.py's notes).
    for line in ("  tokens_per_s: 12,750 tokens/s", "  mfu: —", "  peak_mem_mb_per_rank: 1,341 1,778 MiB",
                 "  by_phase: train 1,500", "  gpus: 0,3"):
        assert any(shown == line or shown.startswith(line + "  (") for shown in lines), result.stdout
    assert "None" not in result.stdout and "{" not in result.stdout and "e+0" not in result.stdout


def test_future_warnings_stay_off_the_terminal(home):
    """A library's FutureWarning raised while a command runs (here: `recipes`, wrapped to raise one)."""
    code = ("import sys, warnings; from gpuscale.app import cli; from gpuscale.app.commands import listings\n"
            "real = listings.cmd_recipes\n"
            "def noisy(args):\n"
            "    warnings.warn('`x` is deprecated', FutureWarning)\n"
            "    return real(args)\n"
            "listings.cmd_recipes = noisy; sys.exit(cli.main(['recipes']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "probe" in result.stdout
    assert "FutureWarning" not in result.stderr and "deprecated" not in result.stderr, result.stderr
