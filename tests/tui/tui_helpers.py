"""Helpers for the TUI tests: a fixed run history for snapshots, and waiting on a running app.

(A module rather than a conftest.py: tests/conftest.py is imported as `conftest` by other test
folders, and a second conftest module of that name would shadow it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import math
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest
from bench_loader import load_bench
from textual.worker import WorkerCancelled

from gpuscale.app.tui import GpuscaleApp
from gpuscale.control import launch
from gpuscale.control.store import Store

svg_screen_text = load_bench("svg_text.py").svg_screen_text  # the one reading of a capture

# 2027-01-15 08:00:00 UTC: the frozen "now" of every snapshot.
FROZEN_NOW = 1_800_000_000.0
GPU_NAME = "NVIDIA H100 80GB HBM3"
GPU_TOTAL_MB = 81_559.0
SNAPSHOT_SIZES = [(80, 24), (120, 40)]


@pytest.fixture(scope="module")
def frozen_template(tmp_path_factory):
    """The fixed history, written once per test module (its run folders, with the logs, stay here)."""
    template = tmp_path_factory.mktemp("frozen-history")
    return template, write_frozen_history(template)


@pytest.fixture
def frozen_home(home, frozen_template, monkeypatch):
    """A copy of the fixed history in this test's GPUSCALE_HOME, shown in UTC."""
    template, ids = frozen_template
    shutil.copytree(template, home, dirs_exist_ok=True)
    monkeypatch.setenv("TZ", "UTC")  # the tables show local times
    time.tzset()
    yield home, ids
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def snap_compare(snap_compare, request):
    """The plugin's snap_compare, whose failure shows the two screens' text where they differ: CI
    prints the test's output, not the plugin's HTML report, so a mismatch seen only there (under a
    busy machine's timing) must say itself what differed."""
    import pickle

    from pytest_textual_snapshot import node_to_report_path

    def compare(app, **options) -> bool:
        __tracebackhide__ = True  # the failure reads at the test's line
        if snap_compare(app, **options):
            return True
        # The plugin keeps (passed, expected SVG, actual SVG, ...) for its report: read them back.
        _, expected, actual, *_ = pickle.loads(node_to_report_path(request.node).read_bytes())
        diff = difflib.unified_diff(svg_screen_text(str(expected)), svg_screen_text(actual),
                                    "snapshot", "this run", lineterm="", n=1)
        text = "\n".join(diff) or "(the same text: the colours or styles differ)"
        raise AssertionError(f"the screen differs from its snapshot; its text rows:\n{text}")

    return compare


def frozen_app(home: Path, **kwargs) -> GpuscaleApp:
    """The app as the snapshots see it: frozen clock, the built-in recipe only, no NVML, no blinking,
    no animation."""
    from gpuscale.recipes.shared.registry import get_recipe

    options = dict(home=home, clock=lambda: FROZEN_NOW, recipes={"probe": get_recipe("probe")},
                   list_gpus=lambda: [], cursor_blink=False)
    options.update(kwargs)
    app = GpuscaleApp(**options)
    # No animations: a tab underline or a fade caught half-way made one grey of the NO_COLOR
    # monitor snapshot differ between machines.
    app.animation_level = "none"
    return app


async def settle(pilot, rounds: int = 3) -> None:
    """Let workers finish and their results be shown (a poll, then the widgets it mounts). A worker
    cancelled by a newer one of its exclusive group (new history filters, say) is not an error."""
    for _ in range(rounds):
        await pilot.pause(0.05)
        ended = await asyncio.gather(*(worker.wait() for worker in pilot.app.workers), return_exceptions=True)
        for outcome in ended:
            if isinstance(outcome, Exception) and not isinstance(outcome, WorkerCancelled):
                raise outcome
    await pilot.pause()


def app_recording_notifications(home: Path) -> tuple[GpuscaleApp, list[str]]:
    """An app on HOME with the probe recipe and no GPUs, and the list its notifications go to."""
    from gpuscale.recipes.shared.registry import get_recipe

    app = GpuscaleApp(home=home, recipes={"probe": get_recipe("probe")}, list_gpus=lambda: [], cursor_blink=False)
    shown: list[str] = []
    notify = app.notify

    def recording(message, **options):
        shown.append(message)
        notify(message, **options)

    app.notify = recording
    return app, shown


@contextlib.asynccontextmanager
async def history_screen(home: Path, size: tuple[int, int] = (120, 40)):
    """The app on HOME's history at SIZE: started, F4 pressed, settled. Yields (app, pilot)."""
    app = frozen_app(home)
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        await pilot.press("f4")
        await settle(pilot)
        yield app, pilot


async def settle_screen(pilot, timeout: float = 10.0) -> None:
    """Settle, then until two screenshots 0.1 s apart are the same. On a busy machine a DataTable
    may widen its columns a frame after its rows arrived: a snapshot must wait for the last frame."""
    last = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await settle(pilot)
        await pilot.pause(0.1)
        shot = pilot.app.export_screenshot()
        if shot == last:
            return
        last = shot


def screen_text(app) -> str:
    """What the terminal shows now, as text: one line per row of cells."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(segment.text for segment in strip) for strip in strips)


def shown_whole(app, text: str) -> bool:
    """Whether `text` is on screen, word after word, where a wrapped line or a box's border may
    break it."""
    words = " ".join(screen_text(app).replace("│", " ").split())
    return " ".join(text.split()) in words


async def wait_for(pilot, condition, timeout: float = 60.0, message: str = "condition", explain=None):
    """Poll `condition()` while the app runs; returns its first truthy value. On a timeout the
    error carries `explain()`, what the test knows of the state it waited on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await pilot.pause(0.25)
    state = f"; {explain()}" if explain else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {message}{state}")


async def opened_monitor(pilot, timeout: float = 30.0):
    """The run monitor the app opened on (a live run's), once it is mounted."""
    from gpuscale.app.widgets.run_monitor import RunMonitor

    await settle(pilot)
    return await wait_for(pilot, lambda: next(iter(pilot.app.screen.query(RunMonitor)), None), timeout, "the monitor")


def run_async(coro):
    return asyncio.run(coro)


# ---- the frozen history -------------------------------------------------------------------------

PROBE_SETTINGS = {
    "model": "random-tiny", "dataset": "tiny-math", "gpus": "all", "batch_size": 8, "precision": "auto",
    "compile": False, "seed": 0, "max_examples": None, "nnodes": 1, "node_rank": 0, "rdzv_endpoint": None,
    "rdzv_id": "gpuscale", "telemetry_interval": 1.0, "steps": 32, "prompt_tokens": 64, "warmup_steps": 2,
}


def _command(run_id: int, nproc: int) -> list[str]:
    return ["python", "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
            "--max-restarts", "0", "-m", "gpuscale.recipes", "--recipe", "probe", "--settings",
            f"/srv/gpuscale/runs/{run_id}/settings.json"]


def _new_run(store: Store, settings: dict, started: float, nproc: int, **fields) -> int:
    run_id = store.create_run("probe", {**PROBE_SETTINGS, **settings}, [], "node001")
    store.update_run(run_id, created_at=started - 2, started_at=started, command=_command(run_id, nproc), **fields)
    return run_id


def _write_logs(store: Store, run_id: int, ranks: int, lines: list[str]) -> None:
    logs = Path(store.get_run(run_id)["run_dir"]) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        text = [f"rank {rank}/{ranks} on cuda:{rank} (torch.bfloat16), pid {4100 + rank}", *lines]
        (logs / f"rank{rank}.log").write_text("\n".join(text) + "\n")
    (logs / "launcher.log").write_text("")


def _cpu_samples(run_id: int, start: float, seconds: int) -> list[dict]:
    rows = []
    for i in range(seconds):
        t = start + i + 0.5
        rows.append({"run_id": run_id, "t": t, "kind": "host", "idx": -1, "name": "cpu",
                     "mem_used_mb": 6_000.0 + 10 * i, "mem_total_mb": 32_000.0, "util": 60.0 + 30 * math.sin(i / 5),
                     "run_mem_mb": 900.0})
        for rank in range(2):
            rows.append({"run_id": run_id, "t": t, "kind": "rank", "idx": rank, "name": f"rank {rank}",
                         "run_mem_mb": 420.0 + rank * 5 + min(i, 30), "mem_total_mb": 32_000.0})
    return rows


def _gpu_samples(run_id: int, end: float, seconds: int, busy: int, gpus: int = 8, every: int = 1) -> list[dict]:
    """`busy` GPUs working hard; the others idle with almost no memory (the waste to point out)."""
    rows = []
    for i in range(0, seconds, every):
        t = end - seconds + i + 0.25
        for idx in range(gpus):
            working = idx < busy
            rows.append({
                "run_id": run_id, "t": t, "kind": "gpu", "idx": idx, "name": GPU_NAME,
                "mem_used_mb": (52_000.0 + 1_500 * idx + (i % 7) * 40) if working else 4_900.0,
                "mem_total_mb": GPU_TOTAL_MB,
                "util": (88.0 + (i * 7 + idx * 3) % 11) if working else (i % 3) * 1.0,
                "power_w": (520.0 + (i % 9) * 9) if working else 72.0,
                "temp_c": (63.0 + idx % 3) if working else 34.0,
                "sm_clock_mhz": 1_980.0, "run_mem_mb": 50_000.0 if working else 4_400.0,
            })
    return rows


def _metrics(run_id: int, start: float, seconds: int, rates: list[float], figures: bool, every: int = 1) -> list[dict]:
    """One step every `every` seconds per rank; rank r counts about rates[r] tokens a second."""
    rows = []
    for i in range(0, seconds, every):
        t = start + i + 0.5
        for rank, rate in enumerate(rates):
            rows.append({"run_id": run_id, "rank": rank, "t": t, "step": i + 1, "name": "tokens",
                         "value": every * rate * (1 + 0.05 * math.sin(i / 7 + rank))})
            rows.append({"run_id": run_id, "rank": rank, "t": t, "step": i + 1, "name": "samples", "value": 4.0})
            if figures:
                rows.append({"run_id": run_id, "rank": rank, "t": t, "step": i + 1, "name": "loss",
                             "value": 2.5 * math.exp(-i / 150) + 0.4})
                rows.append({"run_id": run_id, "rank": rank, "t": t, "step": i + 1, "name": "reward",
                             "value": 0.7 - 0.5 * math.exp(-i / 120)})
    return rows


def write_frozen_history(home: Path) -> dict[str, int]:
    """Five runs with fixed times and figures: what the History, Details, Compare and Monitor
    snapshots show. The live one's supervisor is this test process, so `reconcile` keeps it live."""
    store = Store(home)
    ids = {}

    start = FROZEN_NOW - 7_200
    ids["cpu"] = _new_run(store, {"gpus": 2, "batch_size": 8}, start, 2, status="succeeded", ended_at=start + 245,
                          summary={"world_size": 2, "dtype": "float32", "tokens_per_s": 61.3,
                                   "step_time_ms_median": 261.0, "peak_mem_mb_per_rank": [449.0, 455.0]},
                          progress={"t": start + 245, "step": 240, "total": 240, "tokens_per_s": 61.3,
                                    "samples_per_s": 0.0, "tokens_per_s_by_rank": {"0": 30.8, "1": 30.5},
                                    "latest": {"step_time_ms": 259.0}})
    store.add_rows(_metrics(ids["cpu"], start, 240, [30.0, 30.0], figures=False), _cpu_samples(ids["cpu"], start, 245))
    _write_logs(store, ids["cpu"], 2, ["decode 240 steps", "done"])

    start = FROZEN_NOW - 5_400
    ids["failed"] = _new_run(store, {"batch_size": 4096, "precision": "bf16"}, start, 8, status="failed",
                             ended_at=start + 42, exit_code=1,
                             error="rank 3: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB",
                             hint="out of GPU memory: lower batch_size (now 4096; try 2048)")

    start = FROZEN_NOW - 3_600
    ids["big"] = _new_run(store, {"batch_size": 256, "precision": "bf16", "steps": 2000}, start, 8, status="succeeded",
                          ended_at=start + 600,
                          summary={"world_size": 8, "dtype": "bfloat16", "tokens_per_s": 10_412.5, "reward": 0.69,
                                   "loss": 0.41, "step_time_ms_median": 24.6},
                          progress={"t": start + 600, "step": 2000, "total": 2000, "tokens_per_s": 10_412.5,
                                    "samples_per_s": 32.0, "tokens_per_s_by_rank": {},
                                    "latest": {"loss": 0.41, "reward": 0.69}})
    store.add_rows(_metrics(ids["big"], start, 600, [1_300.0] * 8, figures=True, every=5),
                   _gpu_samples(ids["big"], start + 600, 600, busy=8, every=5))
    _write_logs(store, ids["big"], 2, ["decode 2000 steps", "done"])

    start = FROZEN_NOW - 1_800
    ids["stopped"] = _new_run(store, {"batch_size": 64, "precision": "bf16"}, start, 8, status="stopped",
                              ended_at=start + 95, summary={"duration_s": 95.0},
                              progress={"t": start + 95, "step": 900, "total": 5000, "tokens_per_s": 9_800.0,
                                        "samples_per_s": 30.0, "tokens_per_s_by_rank": {}, "latest": {"loss": 0.9}})

    start = FROZEN_NOW - 300
    rates = [1_310.0] * 4 + [110.0] * 4  # ranks 4-7 on the idle GPUs: stragglers
    by_rank = {str(r): rate for r, rate in enumerate(rates)}
    ids["live"] = _new_run(store, {"batch_size": 64, "precision": "bf16", "steps": 5000}, start, 8, status="running",
                           supervisor_pid=os.getpid(), supervisor_started=psutil.Process().create_time(),
                           progress={"t": FROZEN_NOW - 1, "step": 1200, "total": 5000, "tokens_per_s": sum(rates),
                                     "samples_per_s": 32.0, "tokens_per_s_by_rank": by_rank, "tokens": 3_100_000.0,
                                     "samples": 9_600.0, "latest": {"loss": 0.93, "reward": 0.52}})
    # The last two minutes at 1 s: more than the 1-minute chart and the 30 s waste window need.
    store.add_rows(_metrics(ids["live"], FROZEN_NOW - 120, 119, rates, figures=True),
                   _gpu_samples(ids["live"], FROZEN_NOW, 119, busy=4))
    _write_logs(store, ids["live"], 2, ["step 1100 loss 0.95", "step 1200 loss 0.93"])
    store.close()
    return ids


@pytest.fixture
def store(home):
    """The test's own view of the history; any run still live at the end is stopped (a fixture:
    test modules import it by name)."""
    store = Store(home)
    yield store
    for run in store.live_runs():
        launch.stop_run(store, run["id"])
