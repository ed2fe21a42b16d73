"""The run page of a probe shows its node check as the CLI does: one table, each GPU's figures beside
its card's data sheet, the all-reduce line and the slow GPU named; the per-rank figures not repeated
in the summary's list."""

from __future__ import annotations

from pathlib import Path

from gpuscale.app.screens.history import HistoryScreen
from gpuscale.app.screens.run_detail import RunDetailScreen
from gpuscale.control.store import Store
from tui_helpers import FROZEN_NOW, PROBE_SETTINGS, frozen_app, run_async, screen_text, settle, wait_for

H100 = "NVIDIA H100 80GB HBM3"
SLOW = "GPU 1: memory bandwidth 2,000 GB/s is 40% below its peers' median 3,300 GB/s"


def probe_run(home: Path) -> int:
    """A finished 2-GPU probe whose GPU 1 has slow memory (made-up figures)."""
    store = Store(home)
    summary = {"world_size": 2, "devices": [H100, H100], "node_check_gpus": ["GPU 0", "GPU 1"],
               "throughput_batch_size": 64, "allreduce_mib": 256, "allreduce_algbw_gb_per_s": 300.0,
               "allreduce_busbw_gb_per_s": 300.0, "node_check_flags": [SLOW], "tokens_per_s": 1234.0}
    for rank, copy in enumerate([3300.0, 2000.0]):
        summary.update({f"copy_gb_per_s_rank_{rank}": copy, f"matmul_tflops_rank_{rank}": 700.0,
                        f"latency_tokens_per_s_rank_{rank}": 250.0, f"throughput_tokens_per_s_rank_{rank}": 9e4})
    run_id = store.create_run("probe", PROBE_SETTINGS, [], "node1")
    store.update_run(run_id, status="succeeded", created_at=FROZEN_NOW - 100, started_at=FROZEN_NOW - 99,
                     ended_at=FROZEN_NOW - 10, exit_code=0, summary=summary)
    store.close()
    return run_id


def test_the_run_page_shows_the_node_check_table(home):
    run_id = probe_run(home)

    async def scenario():
        app = frozen_app(home)
        async with app.run_test(size=(160, 50)) as pilot:
            await settle(pilot)
            await pilot.press("f4")
            await settle(pilot)
            assert isinstance(app.screen, HistoryScreen)
            await pilot.press("enter")
            await wait_for(pilot, lambda: "node check:" in screen_text(app), 10, "the node check",
                           explain=lambda: screen_text(app))
            assert isinstance(app.screen, RunDetailScreen) and app.screen.run_id == run_id
            shown = screen_text(app)
            for text in ["3,300 (99% of 3,350)", "2,000 (60% of 3,350)", "700 (71% of 989)", "decode b=64 tokens/s",
                         "all-reduce bus bandwidth 300 GB/s across 2 ranks", f"slow: {SLOW}"]:
                assert text in shown, f"{text!r} not on the run page:\n{shown}"
            assert "copy_gb_per_s_rank_0" not in shown and "tokens_per_s" in shown

    run_async(scenario())
