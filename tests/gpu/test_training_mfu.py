"""On a CUDA machine only: a GPU training run shows its MFU in `gpuscale run`'s progress
line, in its summary and in the TUI's monitor, and one with a deliberately tiny batch is warned,
live, that its MFU stays under 10%. GPU_TEST_EVIDENCE=DIR keeps the monitor's screenshot and the
progress lines there (the closing note's evidence)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from conftest import gpuscale, wait_until
from gpuscale.control import launch
from gpuscale.control.store import Store

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.e2e,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tui"))

SFT_05B = ("run", "--recipe", "sft", "--gpus", "1", "--model", "random-qwen2.5-0.5b", "--set", "eval_examples=0",
           "--set", "save_model=false", "--set", "checkpoint_every=0")


def keep(name: str, text: str) -> None:
    folder = os.environ.get("GPU_TEST_EVIDENCE")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_text(text)


def test_mfu_in_the_progress_line_and_the_summary(home):
    # 64 rows a step, the micro-batch left auto: a filled card.
    done = gpuscale(*SFT_05B, "--set", "max_examples=4096", "--set", "max_steps=40",
                    "--set", "rows_per_step=64", timeout=600)
    keep("sft_progress.txt", done.stderr + done.stdout)
    assert done.returncode == 0, done.stderr[-2000:]
    # `MFU 31.2%` on the line, the catalogue's label (data/figures.py)
    assert " MFU " in done.stderr and "%" in done.stderr.split(" MFU ")[-1][:8]
    store = Store(home)
    run = store.get_run(store.list_runs()[0]["id"])
    summary = run["summary"]
    assert 0 < summary["mfu"] < 1.0  # the figures themselves are bench/train_speed.py's, on a card of its own
    assert "batch_size auto" in summary["batch_size_reason"]
    # liger-kernel is an extra: where it is missing the run says so and trains without it.
    liger_installed = importlib.util.find_spec("liger_kernel") is not None
    assert summary["liger_kernels"] == ("on" if liger_installed else "not installed (pip install liger-kernel)")
    shown = gpuscale("show", str(run["id"]))
    keep("sft_show.txt", shown.stdout)
    assert "mfu: " in shown.stdout and "%" in shown.stdout.split("mfu: ")[1][:8]


def test_a_tiny_batch_is_warned_in_the_monitor(home):
    from gpuscale.app.tui import GpuscaleApp
    from tui_helpers import opened_monitor, wait_for

    run_id = int(gpuscale(*SFT_05B, "--batch-size", "1", "--set", "max_examples=4096", "--set", "max_steps=400",
                          "--detach").stdout)
    store = Store(home)
    try:
        wait_until(lambda: len(store.recent_steps(run_id, ("mfu",), 6).get("mfu", [])) >= 6, timeout=300,
                   message="6 logged steps with MFU")

        async def scenario():
            app = GpuscaleApp(cursor_blink=False, poll_s=0.5)
            async with app.run_test(size=(120, 40)) as pilot:
                monitor = await opened_monitor(pilot)
                view = await wait_for(pilot, lambda: monitor.view if monitor.view and any(
                    w.startswith("MFU") for w in monitor.view.warnings) else None, 60, "the MFU warning")
                keep("monitor_tiny_batch.svg", app.export_screenshot())
                assert "MFU " in view.figures
                (warning,) = [w for w in view.warnings if w.startswith("MFU")]
                assert "under 10%" in warning and "rows_per_step" in warning

        asyncio.run(scenario())
    finally:
        launch.stop_run(store, run_id)
