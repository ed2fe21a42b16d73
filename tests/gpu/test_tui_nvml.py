"""On a CUDA machine only: the TUI's data path with real NVML, headless (run_test).

The launch screen's GPU picker shows each real GPU's name and free memory; the monitor of a real run
on GPU 0 shows that GPU's name and its memory in use out of its real total.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from conftest import gpuscale, wait_for_metrics
from gpuscale.app.views.text import short_gpu_name
from gpuscale.control import launch, telemetry
from gpuscale.control.store import Store

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]  # real runs on the GPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tui"))


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_picker_and_monitor_show_the_real_gpu(home):
    if not cuda_available():
        pytest.skip("needs CUDA")
    from gpuscale.app.tui import GpuscaleApp
    from gpuscale.app.widgets.run_monitor import DeviceRow
    from tui_helpers import opened_monitor, settle, wait_for

    gpus = telemetry.list_gpus()
    assert gpus, "CUDA is there but NVML lists no GPU"
    first = gpus[0]
    run_id = int(gpuscale("run", "--recipe", "probe", "--gpus", "1", "--model", "random-qwen2.5-0.5b",
                          "--batch-size", "16", "--set", "steps=100000", "--set", "prompt_tokens=32",
                          "--detach").stdout)
    store = Store(home)
    try:
        wait_for_metrics(home, run_id, timeout=180)

        async def scenario():
            app = GpuscaleApp(cursor_blink=False, poll_s=0.5)
            async with app.run_test(size=(120, 40)) as pilot:
                monitor = await opened_monitor(pilot)  # the app opened on the live run's monitor
                rows = await wait_for(pilot, lambda: list(monitor.query(DeviceRow)), 30, "a GPU row")
                row = rows[0].view
                assert row.label == f"GPU {first['index']} {short_gpu_name(first['name'])}"
                assert row.mem_total_mb == pytest.approx(first["mem_total_mb"], rel=1e-3)
                assert 100 < row.mem_used_mb <= row.mem_total_mb  # the probe's weights and cache are in
                # Every field NVML reads on this GPU reaches the row, by its declared name (run_util: the probe's
                # own share of the card, from NVML's per-process samples).
                assert all(row.values.get(name) is not None
                           for name in ("util", "temp_c", "sm_clock_mhz", "run_util"))
                assert f"/{first['mem_total_mb'] / 1024:.1f} GiB" in row.mem_text  # e.g. 12.3/79.6 GiB 15%

                # The launch screen's picker lists every GPU with its name and free memory.
                await pilot.press("f2")
                await settle(pilot)
                picker = app.screen.query_one("#gpu-list")
                prompts = [str(picker.get_option_at_index(i).prompt) for i in range(picker.option_count)]
                assert len(prompts) == len(gpus)
                assert short_gpu_name(first["name"]) in prompts[0] and "free" in prompts[0]

        asyncio.run(scenario())
    finally:
        launch.stop_run(store, run_id)
