"""How fast the TUI opens and how much CPU it costs while it monitors a live run.

    python bench/tui_perf.py [--seconds 30] [--repeats 5] [--size 120x40] [--out OUT.json]
    python bench/tui_perf.py --first-frame-only --size 80x24 --repeats 10   # the first-frame figure in RESULTS.md

Three figures, each measured in a fresh child process so that nothing is cached or shared:

- Time to first frame in a real terminal (tmux; skipped where tmux is not installed): `gpuscale-tui`
  as a user types it, in a tmux pane of `--size`, in an empty GPUSCALE_HOME, from the shell's clock
  just before it execs the command to the first capture of the pane that shows the launch screen
  (its Recipes list and Command box). The pane is captured every POLL_S seconds, so a time is late
  by at most that. The load average before the first repeat is recorded: the figure means an idle
  machine only where it is low (under 0.3 for 1 minute on 2 cores). Profiling the start-up:
  `python -X importtime -m gpuscale.app.tui_main` (imports) and pyinstrument on the same child as
  `--child first-frame` (see bench/README.md).
- Time to first frame, headless: from the moment the parent starts the child (interpreter start-up
  and every import included) to Textual's Ready event (the first frame has been drawn), in an empty
  GPUSCALE_HOME. The median of `--repeats` runs; also when the launch form (built just after the
  first frame) is shown.
- The app's own CPU use while it shows the monitor of a live run at a 1 s refresh, over `--seconds`
  seconds after the monitor has shown its first poll: user + system time of the app's process (all
  its threads, so the pollers are counted) over wall time, in % of one core. Two runs to monitor:
    cpu-run     a real `probe` run on 1 CPU rank (this machine has no GPU): host CPU and rank RSS rows;
    8-gpu-feed  a feeder process writes what a supervisor of an 8-GPU run writes each second (8 GPU
                samples; 8 ranks x 20 steps x 4 metrics; the progress) for a run it owns, so the
                app shows 8 GPU rows, the waste warnings and the charts exactly as for a real one.
  The feeder and the run are other processes: their CPU is not the app's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from record import write_result  # noqa: E402

HERE = Path(__file__).resolve()


# ---- children ------------------------------------------------------------------------------------


def child_first_frame(size: tuple[int, int], spawned_at: float) -> None:
    """Run in a fresh interpreter: import the app, open it headless, report when the first frame is up.

    Times count from `spawned_at`, the parent's clock just before it started this process (psutil's
    create_time cannot serve: Linux gives the boot time in whole seconds, which put it 0.55 s early
    on the dev machine and inflated every figure by as much)."""
    me = psutil.Process()
    started = spawned_at
    from gpuscale.app.tui import GpuscaleApp

    imported_s = time.time() - started

    class Timed(GpuscaleApp):
        def on_ready(self) -> None:
            self.first_frame_s = time.time() - started
            self.cpu_s = sum(me.cpu_times()[:2])
            super().on_ready()
            self.set_interval(0.005, self._form_shown)

        def _form_shown(self) -> None:
            """The launch form (built just after the first frame) is mounted and read."""
            if self.screen.form() is not None and "$ " in str(self.screen.query_one("#preview").render()):
                self.form_s = time.time() - started
                self.exit()

    app = Timed(cursor_blink=False)
    app.run(headless=True, size=size)
    print(json.dumps({"first_frame_ms": 1000 * app.first_frame_s, "cpu_ms": 1000 * app.cpu_s,
                      "form_ms": 1000 * app.form_s, "imports_ms": 1000 * imported_s,
                      "torch_loaded": "torch" in sys.modules}))


def child_monitor(size: tuple[int, int], seconds: float) -> None:
    """Run in a fresh interpreter: open the app on the live run's monitor and measure its CPU time."""
    from gpuscale.app.tui import GpuscaleApp
    from gpuscale.app.widgets.run_monitor import RunMonitor

    poll_ms: list[float] = []
    original_read = RunMonitor._read

    def timed_read(self):
        start = time.perf_counter()
        try:
            return original_read(self)
        finally:
            poll_ms.append(1000 * (time.perf_counter() - start))

    RunMonitor._read = timed_read

    async def scenario() -> dict:
        app = GpuscaleApp(cursor_blink=False, poll_s=1.0)
        async with app.run_test(size=size) as pilot:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                monitors = list(app.screen.query(RunMonitor))
                if monitors and monitors[0].view is not None and monitors[0].view.devices:
                    break
                await pilot.pause(0.2)
            else:
                raise SystemExit("the monitor never showed the run")
            await pilot.pause(2.0)  # past the first poll's one-off work (mounting rows, first charts)
            me = psutil.Process()
            cpu0, wall0, polls0 = sum(me.cpu_times()[:2]), time.monotonic(), len(poll_ms)
            await pilot.pause(seconds)
            cpu, wall = sum(me.cpu_times()[:2]) - cpu0, time.monotonic() - wall0
            monitor = list(app.screen.query(RunMonitor))[0]
            return {
                "cpu_percent": 100 * cpu / wall, "seconds": wall, "polls": len(poll_ms) - polls0,
                "poll_ms_median": statistics.median(poll_ms[polls0:]) if poll_ms[polls0:] else None,
                "devices": len(monitor.view.devices), "warnings": list(monitor.view.warnings),
            }

    print(json.dumps(asyncio.run(scenario())))


def child_feed(home: Path, gpus: int = 8, steps_per_s: int = 20) -> None:
    """Write what an 8-GPU run's supervisor writes each second, for a run owned by this process."""
    from gpuscale.control.store import Store

    store = Store(home)
    run_id = store.create_run("probe", {"gpus": gpus, "batch_size": 64, "steps": 10**6}, [], "bench")
    me = psutil.Process()
    start = time.time()
    store.update_run(run_id, status="running", started_at=start, supervisor_pid=me.pid,
                     supervisor_started=me.create_time())
    print(run_id, flush=True)
    step = 0
    while True:
        now = time.time()
        metrics = []
        for i in range(steps_per_s):
            step += 1
            t = now - 1 + i / steps_per_s
            for rank in range(gpus):
                for name, value in (("tokens", 64.0), ("samples", 0.0), ("loss", 2 / math.log(step + 2)),
                                    ("reward", 1 - 1 / math.log(step + 2))):
                    metrics.append({"run_id": run_id, "rank": rank, "t": t, "step": step, "name": name, "value": value})
        # Values that move every tick, as real ones do: every label and sparkline changes each second.
        samples = [{"run_id": run_id, "t": now, "kind": "gpu", "idx": i, "name": "NVIDIA H100 80GB HBM3",
                    "mem_used_mb": (60_000.0 if i < 6 else 3_000.0) + 2 * (step // 200 % 50), "mem_total_mb": 81_559.0,
                    "util": random.uniform(85, 100) if i < 6 else random.uniform(0, 3),
                    "power_w": random.uniform(550, 700), "temp_c": random.uniform(58, 66), "sm_clock_mhz": 1980.0,
                    "run_mem_mb": 58_000.0} for i in range(gpus)]
        store.add_rows(metrics, samples)
        rate = 64.0 * steps_per_s
        store.update_run(run_id, progress={"t": now, "step": step, "total": 10**6, "tokens_per_s": rate * gpus,
                                           "samples_per_s": 0.0,
                                           "tokens_per_s_by_rank": {str(r): rate for r in range(gpus)},
                                           "latest": {"loss": 2 / math.log(step + 2)}})
        time.sleep(max(0.0, 1.0 - (time.time() - now)))


# ---- the parent ----------------------------------------------------------------------------------


# The launch screen's recipe list and command box: on screen in its first frame.
FIRST_FRAME_MARKERS = ("Recipes", "Command")
POLL_S = 0.005


def tui_command() -> str:
    """`gpuscale-tui` as installed beside this Python (a user's command), else the module."""
    script = Path(sys.executable).with_name("gpuscale-tui")
    return shlex.quote(str(script)) if script.exists() else f"{shlex.quote(sys.executable)} -m gpuscale.app.tui_main"


def measure_first_frame_tmux(size: str, repeats: int, env: dict) -> dict | None:
    """`gpuscale-tui` in a tmux pane, from the shell's exec of it to its first frame on the pane (see
    the module docstring); each repeat in a tmux server of its own and an empty home."""
    if shutil.which("tmux") is None:
        return None
    width, height = size.split("x")
    load = os.getloadavg()
    times = []
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory(prefix="gpuscale-first-frame-") as tmp:
            stamp = Path(tmp) / "started"
            tmux = ["tmux", "-L", f"gpuscale-first-frame-{os.getpid()}-{repeat}"]
            shell = f"date +%s.%N > {shlex.quote(str(stamp))}; exec {tui_command()}"
            child_env = {key: value for key, value in env.items() if key not in ("COLUMNS", "LINES")}
            child_env["GPUSCALE_HOME"] = str(Path(tmp) / "home")
            subprocess.run([*tmux, "new-session", "-d", "-x", width, "-y", height, "sh", "-c", shell],
                           env=child_env, check=True)
            try:
                shown_at = wait_for_pane(tmux, FIRST_FRAME_MARKERS, timeout_s=30)
                times.append(shown_at - float(stamp.read_text()))
            finally:
                subprocess.run([*tmux, "kill-server"], capture_output=True)
        time.sleep(1.0)  # the app's exit and the next start do not overlap
    return {"median_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times), "max_ms": 1000 * max(times),
            "runs_ms": [round(1000 * t) for t in times], "load_average_before": [round(x, 2) for x in load],
            "command": "gpuscale-tui", "poll_ms": 1000 * POLL_S}


def wait_for_pane(tmux: list[str], markers: tuple[str, ...], timeout_s: float) -> float:
    """The time of the first capture of the pane that shows every marker."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        screen = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True).stdout
        if all(marker in screen for marker in markers):
            return time.time()
        time.sleep(POLL_S)
    raise SystemExit(f"the app showed no first frame ({', '.join(markers)}) in {timeout_s:.0f} s")


def run_child(*args: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, str(HERE), *args], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def measure_first_frame(size: str, repeats: int, env: dict) -> dict:
    runs = [run_child("--child", "first-frame", "--size", size, "--spawned-at", repr(time.time()), env=env)
            for _ in range(repeats)]
    assert not any(r["torch_loaded"] for r in runs), "torch was imported before the first frame"
    times = [r["first_frame_ms"] for r in runs]
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "cpu_ms": statistics.median(r["cpu_ms"] for r in runs),
            "form_ms": statistics.median(r["form_ms"] for r in runs),
            "imports_ms": statistics.median(r["imports_ms"] for r in runs)}


def with_cpu_run(home: Path, env: dict, size: str, seconds: float) -> dict:
    """A real probe run on 1 CPU rank, monitored by the app, then stopped."""
    os.environ["GPUSCALE_HOME"] = str(home)
    from gpuscale.control import launch
    from gpuscale.control.store import Store
    from gpuscale.recipes.shared.registry import get_recipe
    from gpuscale.runs.settings import resolve_settings

    store = Store(home)
    recipe = get_recipe("probe")
    settings = resolve_settings(recipe.settings_cls, environ={}, overrides={
        "gpus": 1, "batch_size": 2, "steps": 100000, "prompt_tokens": 8})
    run_id = launch.start_run(store, recipe, settings)
    try:
        deadline = time.monotonic() + 180
        while not store.metrics(run_id, "tokens") and time.monotonic() < deadline:
            time.sleep(0.5)
        return run_child("--child", "monitor", "--size", size, "--seconds", str(seconds), env=env)
    finally:
        launch.stop_run(store, run_id)


def with_feed(home: Path, env: dict, size: str, seconds: float) -> dict:
    feeder = subprocess.Popen([sys.executable, str(HERE), "--child", "feed"], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        feeder.stdout.readline()  # its run id: the run exists
        time.sleep(3)  # a few ticks in the store
        return run_child("--child", "monitor", "--size", size, "--seconds", str(seconds), env=env)
    finally:
        feeder.terminate()
        feeder.wait()


BASELINE = """No baseline: it measures the TUI's own start-up time and CPU use; nothing is compared with other code."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__ + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="120x40")
    parser.add_argument("--first-frame-only", action="store_true", help="only the times to first frame")
    parser.add_argument("--json", "--out", dest="json", type=Path, help="default: "
                        "bench/results/tui/tui-perf-<date>-<card>.json")
    parser.add_argument("--child", choices=["first-frame", "monitor", "feed"], help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = tuple(int(part) for part in args.size.split("x"))
    if args.child == "first-frame":
        return child_first_frame(size, args.spawned_at)
    if args.child == "monitor":
        return child_monitor(size, args.seconds)
    if args.child == "feed":
        return child_feed(Path(os.environ["GPUSCALE_HOME"]))

    results = {"size": args.size, "cpu": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory(prefix="gpuscale-tui-perf-") as tmp:
        homes = {name: Path(tmp) / name for name in ("empty", "cpu-run", "8-gpu-feed")}
        # PYTHONPATH: the children measure this checkout, whatever copy of gpuscale is installed.
        envs = {name: {**os.environ, "GPUSCALE_HOME": str(path), "PYTHONPATH": str(HERE.parent.parent)}
                for name, path in homes.items()}
        results["first_frame_tmux"] = measure_first_frame_tmux(args.size, args.repeats, envs["empty"])
        results["first_frame"] = measure_first_frame(args.size, args.repeats, envs["empty"])
        if not args.first_frame_only:
            results["monitor"] = {
                "cpu-run": with_cpu_run(homes["cpu-run"], envs["cpu-run"], args.size, args.seconds),
                "8-gpu-feed": with_feed(homes["8-gpu-feed"], envs["8-gpu-feed"], args.size, args.seconds),
            }
    print_table(results)
    write_result("tui", "tui-perf", {"seconds": args.seconds, "repeats": args.repeats, "size": args.size,
                                     "first_frame_only": args.first_frame_only}, results, out=args.json)


def print_table(results: dict) -> None:
    print(f"gpuscale-tui at {results['size']}, {results['cpu']}, {results['date']}")
    print()
    if r := results.get("first_frame_tmux"):
        print("| time to first frame (`gpuscale-tui` in tmux, exec to first frame) | median | min | max "
              "| load average before (1, 5, 15 min) |")
        print("|---|---|---|---|---|")
        print(f"| gpuscale-tui | {r['median_ms']:.0f} ms | {r['min_ms']:.0f} ms | {r['max_ms']:.0f} ms "
              f"| {', '.join(map(str, r['load_average_before']))} |")
        print()
    print("| time to first frame (launch to first frame, headless) | median | min | max "
          "| of which imports (median) | CPU time to first frame (median) | launch form shown (median) |")
    print("|---|---|---|---|---|---|---|")
    r = results["first_frame"]
    print(f"| gpuscale-tui | {r['median_ms']:.0f} ms | {r['min_ms']:.0f} ms | {r['max_ms']:.0f} ms "
          f"| {r['imports_ms']:.0f} ms | {r['cpu_ms']:.0f} ms | {r['form_ms']:.0f} ms |")
    print()
    if "monitor" not in results:
        return
    print("| monitoring a live run, 1 s refresh | app CPU (% of one core) | seconds | polls "
          "| poll (median, worker thread) | rows |")
    print("|---|---|---|---|---|---|")
    for label, r in results["monitor"].items():
        poll = f"{r['poll_ms_median']:.1f} ms" if r["poll_ms_median"] is not None else "-"
        print(f"| {label} | {r['cpu_percent']:.2f} | {r['seconds']:.0f} | {r['polls']} | {poll} | {r['devices']} |")


if __name__ == "__main__":
    main()
