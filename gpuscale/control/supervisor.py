"""One supervisor per run: `python -m gpuscale.control.supervisor RUN_ID --home HOME`.

Started by a front end in a session of its own, it outlives the terminal. It spawns the launcher
(torchrun or accelerate) in its own process group, and once per tick samples telemetry, tails the ranks'
metrics into the store and checks the launcher. SIGTERM stops the run: SIGTERM to the launcher's group,
SIGKILL after STOP_GRACE_S (HUNG_STOP_GRACE_S for a hung run). When the launcher has exited, it records
the status, the summary, and for a failed run the failing rank's first error line and a hint. A run that
ended before rank 0 wrote its summary and results (stopped, failed) keeps what it did: the ranks'
results files merged into results.jsonl, and a summary of the figures so far marked partial. No process
of the run outlives it: the launcher dies with it (PR_SET_PDEATHSIG) and, at the end, anything still
carrying the run's mark is killed. A run none of whose ranks advances for its `hang_timeout` is ended as
hung (control/hang_watch.py): every rank's stacks asked for, then the stop above, the run `failed`.

A run of one process in all has no launcher (control/launch.py:launcher_argv): the supervisor starts its
rank itself, with the variables the launcher would have given it (plan.json's DIRECT_RANK_ENV), and "the
launcher" in this module (its process group, its pid, its log, its exit code) is then that rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import traceback
from pathlib import Path

import psutil

from gpuscale.control import disk_space, hang_watch, run_queue, telemetry
from gpuscale.control.metrics_tail import MetricsTailer, Throughput
from gpuscale.control.run_errors import first_error, hint_for
from gpuscale.control.store import Store, StoreError, UnknownRun
from gpuscale.data import step_phases
from gpuscale.runs.checkpoints import latest_checkpoint
from gpuscale.runs.devices import usable_cores, visible_gpu_indices
from gpuscale.runs.heartbeat import STACKS_SIGNAL
from gpuscale.runs.process import RUN_DIR_ENV, die_with_parent, kill_run_processes, run_processes, signal_group
from gpuscale.runs.run_dir import RunDir, merge_results

STOP_GRACE_S = 7.0
# A hung run's ranks stand blocked in a collective or stopped, where SIGTERM's handler cannot run: their
# stacks are taken and their last checkpoint is on disk, so they get only this before SIGKILL (7 s of the
# 37 s a SIGSTOPped rank's run took to end went to the grace: bench/faults.py's stop cases).
HUNG_STOP_GRACE_S = 1.0
# While a preemption is asked, SIGUSR1 goes to the ranks again this often: a rank still starting
# (the launcher's ignored disposition, until run_rank takes the signal) would have missed it.
PREEMPT_RESEND_S = 5.0
RANK_MODULE = "gpuscale.recipes"  # a rank is `python -m gpuscale.recipes ...` (recipes/__main__.py)
# plan.json's key for what a rank started without a launcher adds to its environment
# (control/launch.py:direct_rank_environment); absent where the run has a launcher.
DIRECT_RANK_ENV = "direct_rank_env"
# Metric rows kept while the history cannot be written (all are in the ranks' metric files too).
MAX_UNSENT_ROWS = 100_000
# How long the ranks of a hung run have to write their stacks (faulthandler writes at once; a rank that
# has not by then is stopped, or blocked where no signal is taken).
STACKS_WAIT_S = 3.0


class Supervisor:
    def __init__(self, store: Store, run_id: int):
        self.store = store
        self.run = store.get_run(run_id)
        self.run_id = run_id
        self.run_dir = Path(self.run["run_dir"])
        self.plan = json.loads(RunDir(self.run_dir).plan.read_text())
        self.interval = float(self.run["settings"].get("telemetry_interval", 1.0))
        self.stop_requested_at: float | None = None
        self.preempt_requested_at: float | None = None  # SIGUSR1: SLURM's signal ahead of the time limit
        self.preempt_sent_at: float | None = None
        self.term_sent = False
        self.killed = False
        self.stop_grace_s = STOP_GRACE_S
        self.throughput = Throughput()
        self.tailer = MetricsTailer(RunDir(self.run_dir).metrics_dir, run_id)
        self.started_at = time.time()
        self.hangs = self.new_hang_watch()
        self.hung_error: str | None = None  # the run was ended as hung: its error
        self.gpu_samples: list[dict] = []  # the latest telemetry of the run's GPUs, for a hung run's error
        self.energy: telemetry.EnergyMeter | None = None  # read from when the launcher starts (supervise)
        self.history_failing = False
        # Metric rows not yet in the history (kept while it cannot be written), and after runs.db was
        # replaced, per rank the time up to which the repair restored this run's rows (None: not yet).
        self.unsent: list[dict] = []
        self.restored_upto: dict[int, float] | None = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False), self._wake_w.setblocking(False)

    # ---- signals: each one just wakes the loop, which does the work --------------------------

    def install_signal_handlers(self) -> None:
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal must not end the run
        signal.signal(signal.SIGUSR1, self._request_preemption)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the launcher's exit wakes the loop at once

    def _request_stop(self, *_args) -> None:
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()

    def _request_preemption(self, *_args) -> None:
        if self.preempt_requested_at is None:
            self.preempt_requested_at = time.monotonic()

    def _sleep_until(self, deadline: float) -> None:
        timeout = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([self._wake_r], [], [], timeout)
        if ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass

    # ---- the run ------------------------------------------------------------------------------

    def launch(self) -> subprocess.Popen:
        live = []  # the ranks of the live runs on this host, this one's included
        self.write_history(lambda: live.append(self.store.live_ranks_on(self.run["host"])))
        ranks_here = live[0] if live else 0
        gpus_here = len(visible_gpu_indices()) if self.plan["gpu_indices"] else 0
        threads, why = omp_threads(os.environ, self.plan["nproc"], ranks_here=ranks_here, gpus_here=gpus_here)
        compile_threads = os.environ.get(COMPILE_THREADS_ENV)
        say(f"OMP_NUM_THREADS={threads} per rank ({why}); {COMPILE_THREADS_ENV}="
            + (f"{compile_threads} (set by the user)" if compile_threads else f"{threads}, the same share"))
        env = {**rank_environment(os.environ, self.run_dir, self.plan, threads), **self.direct_rank_env()}
        # The launcher writes to its own copy of the descriptor: ours is closed once it has started. A rank
        # started without one writes there only until it opens its own log (engines/distributed.py).
        with open(RunDir(self.run_dir).launcher_log, "ab") as log:
            return subprocess.Popen(
                self.run["command"], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                process_group=0, preexec_fn=launcher_preexec, cwd=self.run_dir,
            )

    def direct_rank_env(self) -> dict[str, str]:
        """What the rank of a run without a launcher adds to its environment ({} for a run with one)."""
        return self.plan.get(DIRECT_RANK_ENV) or {}

    def tick(self, sampler) -> None:
        now = time.time()
        rows = self.tailer.read_new()
        self.throughput.add(rows)
        rows += self.throughput.run_wide_rows(self.run_id)  # the figures combined over the ranks
        samples = sampler.sample(now) if sampler else []
        self.gpu_samples = [sample for sample in samples if sample["kind"] == "gpu"] or self.gpu_samples
        self.hangs.saw(self.tailer.take_beats())
        progress = self.throughput.progress(now)
        if nonfinite := self.tailer.nonfinite():
            progress["nonfinite"] = nonfinite  # the front ends warn (app/views/collapse.py)
        if recent := step_phases.recent_by_rank(self.tailer.step_phases):
            progress["step_phases"] = recent  # each rank's last steps: the front ends' live advice
        if check := self.tailer.summaries.get(0, {}).get("resume_check"):
            progress["resume_check"] = check  # a resumed run's check so far: the monitor warns while it runs
        if self.stop_requested_at is not None:
            progress["stopping"] = True  # the front ends then show no ETA while the ranks wind down
        else:
            progress.update(self.hangs.progress(now))  # a late rank: the front ends warn

        self.unsent = (self.unsent + rows)[-MAX_UNSENT_ROWS:]  # older ones are in the metric files

        def write() -> None:
            if not self.run_restored():
                return  # the repair has not restored this run yet: the rows wait
            self.store.add_rows(self.not_restored(self.unsent), samples)
            self.unsent = []
            self.store.update_run(self.run_id, progress=progress)

        self.write_history(write)

    def write_history(self, write) -> None:
        """Do `write` on the history as it is now. runs.db replaced by `gpuscale doctor --repair`
        (which gives the new one this run's row): the new file is opened. A damaged history does not
        end the run: the error goes to this log, the run goes on, and its end is in run.json too
        (`finish`), where the repair and every front end find it."""
        try:
            if self.store.replaced():
                say("runs.db was replaced (gpuscale doctor --repair): writing to the new one")
                self.store.close()
                self.store = Store(self.store.home)
                self.restored_upto = None
            write()
            self.history_failing = False
        except (sqlite3.DatabaseError, StoreError) as error:
            if not self.history_failing:
                say(f"the run history cannot be written ({error}); the run goes on")
            self.history_failing = True

    def run_restored(self) -> bool:
        """Whether the history holds this run: always, unless runs.db was replaced and the repair
        has not yet restored the run (its row and its metric rows come in one transaction); then
        the time up to which each rank's rows were restored is noted."""
        if self.restored_upto is None:
            try:
                self.store.get_run(self.run_id)
            except UnknownRun:
                return False
            self.restored_upto = self.store.last_metric_times(self.run_id)
        return True

    def not_restored(self, rows: list[dict]) -> list[dict]:
        """`rows` less those the repair restored from the metric files (each rank's rows come in
        time order): written again, they would count twice."""
        if not self.restored_upto:
            return rows
        upto, self.restored_upto = self.restored_upto, {}
        return [row for row in rows if row["t"] > upto.get(row["rank"], float("-inf"))]

    def pass_preemption_on(self) -> None:
        """SIGUSR1 to the run's ranks: they write a checkpoint and end (engines/preemption.py)."""
        if self.preempt_requested_at is None or self.stop_requested_at is not None:
            return
        now = time.monotonic()
        if self.preempt_sent_at is not None and now - self.preempt_sent_at < PREEMPT_RESEND_S:
            return
        if self.preempt_sent_at is None:
            say("SIGUSR1: asking the ranks to write a checkpoint and end (preemption)")
        self.preempt_sent_at = now
        for proc in run_processes(str(self.run_dir)):
            try:
                # The ranks only: a helper a rank started (torch's compile workers) takes no such signal.
                if RANK_MODULE in proc.cmdline():
                    proc.send_signal(signal.SIGUSR1)
            except psutil.Error:
                pass

    def new_hang_watch(self) -> hang_watch.HangWatch:
        """The run's hang watch, its ranks loading from now (control/hang_watch.py)."""
        settings = self.run["settings"]
        timeout = settings.get("hang_timeout", "auto")  # a run recorded before the setting: auto
        first_rank = int(settings.get("node_rank", 0)) * self.plan["nproc"]
        return hang_watch.HangWatch(None if timeout == "auto" else float(timeout), time.time(),
                                    range(first_rank, first_rank + self.plan["nproc"]))

    def rank_processes(self) -> dict[int, psutil.Process]:
        """The run's rank processes by rank: the rank module's that carry RANK (a launcher, whose argv
        names the module too, carries none). The one rank of a run without a launcher is rank 0, with
        RANK or without: `accelerate launch` gives its one process none."""
        ranks = {}
        no_rank = "0" if self.direct_rank_env() else None
        for proc in run_processes(str(self.run_dir)):
            try:
                if RANK_MODULE in proc.cmdline() and (rank := proc.environ().get("RANK", no_rank)) is not None:
                    ranks[int(rank)] = proc
            except (psutil.Error, ValueError):
                pass
        return ranks

    def end_hung(self, stands: list[hang_watch.RankStand]) -> None:
        """No rank advanced within its allowance: ask every rank for its stacks, say where each stood
        (RunDir.hung, and the error's one line), and stop the run the usual way; it ends `failed`."""
        folder = RunDir(self.run_dir)
        processes = self.rank_processes()
        states = {rank: process_state(processes.get(rank)) for rank in (stand.rank for stand in stands)}
        asked = {rank: proc for rank, proc in processes.items() if states.get(rank) != "stopped"}
        for proc in asked.values():
            try:
                proc.send_signal(STACKS_SIGNAL)
            except psutil.Error:
                pass
        deadline = time.monotonic() + STACKS_WAIT_S
        while time.monotonic() < deadline and not all(stacks_written(folder, rank) for rank in asked):
            time.sleep(0.1)
        time.sleep(0.2)  # the last thread's stack may still be being written
        places = {stand.rank: hang_watch.where(hang_watch.main_thread_frames(read_stacks(folder, stand.rank)),
                                               peers=len(stands) > 1)
                  for stand in stands}
        self.hung_error = hang_watch.hung_error(stands, states, places, folder.errors_dir, self.idle_gpus())
        record = {"error": self.hung_error, "timeout_s": self.hangs.timeout_s(),
                  "step_time_p95_s": self.hangs.step_time_p95(),
                  "ranks": [{**dataclasses.asdict(stand), "state": states.get(stand.rank),
                             "where": places.get(stand.rank)} for stand in stands]}
        with contextlib.suppress(OSError):  # a full disk: the error line still ends the run
            folder.hung.write_text(json.dumps(record, indent=2))
        say(self.hung_error)
        self.stop_grace_s = HUNG_STOP_GRACE_S
        self._request_stop()

    def idle_gpus(self) -> list[int]:
        """NVML's word on a hung run: its GPUs, if every one was at 0% utilization in the latest sample."""
        idle = [sample["idx"] for sample in self.gpu_samples if sample.get("util") == 0]
        return idle if len(idle) == len(self.gpu_samples) else []

    def enforce_stop(self, launcher: subprocess.Popen) -> None:
        """SIGTERM the launcher's group once; SIGKILL everything of the run after the grace time."""
        if self.stop_requested_at is None:
            return
        if not self.term_sent:
            signal_group(launcher.pid, signal.SIGTERM)
            self.term_sent = True
        elif time.monotonic() - self.stop_requested_at > self.stop_grace_s and not self.killed:
            signal_group(launcher.pid, signal.SIGKILL)
            kill_run_processes(str(self.run_dir), timeout=1.0)
            self.killed = True

    def supervise(self) -> None:
        me = psutil.Process()
        mine = {"supervisor_pid": os.getpid(), "supervisor_started": me.create_time()}
        if run_queue.waits_in_queue(self.run):
            self.store.update_run(self.run_id, **mine)  # a waiter is a live supervisor: `reconcile` checks it
            if not self.wait_for_turn():
                self.end_in_queue()
                self.close()
                return
        else:
            self.started_at = time.time()
            self.store.update_run(self.run_id, status="running", started_at=self.started_at, **mine)
        wall_start, cpu_start = time.monotonic(), sum(me.cpu_times()[:2])
        if not disk_space.keep_room(RunDir(self.run_dir).room_reserve):
            say(f"no room for {disk_space.size_text(disk_space.END_RESERVE_BYTES)} to record the run's end in "
                "(control/disk_space.py)")
        self.energy = self._start_energy_meter()
        self.hangs = self.new_hang_watch()  # the ranks load from the launch, not from a wait in the queue
        launcher = self.launch()
        self.store.update_run(self.run_id, launcher_pid=launcher.pid)
        sampler = self._make_sampler(launcher.pid)
        next_tick = time.monotonic()
        while launcher.poll() is None:
            self.enforce_stop(launcher)
            self.pass_preemption_on()
            if time.monotonic() >= next_tick:
                self.tick(sampler)
                if self.stop_requested_at is None and (stands := self.hangs.hung(time.time())):
                    self.end_hung(stands)
                next_tick = time.monotonic() + self.interval
            # Signals and the launcher's exit wake the loop early; while stopping, check the grace time often.
            self._sleep_until(next_tick if self.stop_requested_at is None else time.monotonic() + 0.2)
        self.tick(sampler)
        leftovers = kill_run_processes(str(self.run_dir), timeout=2.0)
        cpu_percent = 100.0 * (sum(me.cpu_times()[:2]) - cpu_start) / max(1e-9, time.monotonic() - wall_start)
        self.finish(launcher.returncode, cpu_percent, leftovers)
        self.close()

    def wait_for_turn(self) -> bool:
        """A run queued with `--queue`: wait until it may start (`run_queue.may_start`) and take its turn;
        False where it was stopped (SIGTERM) or ended by another process meanwhile."""
        slots = run_queue.cpu_slots()
        demand = run_queue.Demand.of_plan(self.plan)
        print(f"queued: waiting for {demand.describe(slots)}, behind the runs queued before it for them", flush=True)
        while self.stop_requested_at is None:
            status = self.take_turn(slots)
            if status == "running":
                self.started_at = self.store.get_run(self.run_id)["started_at"]
                print(f"its turn came after {time.time() - self.run['created_at']:.1f} s queued", flush=True)
                return True
            if status not in (None, "queued"):
                print(f"the run was recorded {status} while queued: nothing to start", flush=True)
                return False
            self._sleep_until(time.monotonic() + run_queue.POLL_S)
        return False

    def take_turn(self, slots: int) -> str | None:
        """The run's status once it asked for its turn (`Store.take_turn`); None where the history
        could not be read or does not hold the run now."""
        status = []
        self.write_history(lambda: status.append(self.store.take_turn(
            self.run_id, lambda run, live: run_queue.may_start(run, live, slots), started_at=time.time())))
        return status[0] if status else None

    def end_in_queue(self) -> None:
        """Stopped while it waited its turn: recorded `stopped`, nothing having started."""
        end = {"error": None, "hint": "stopped while queued: it never started", "summary": {}}
        RunDir(self.run_dir).record_end("stopped", **end)
        self.write_history(lambda: self.store.finish_run(self.run_id, "stopped", **end))

    def close(self) -> None:
        """Close the wake-up socket pair (a supervisor made in a test process must not leak it)."""
        try:
            previous = signal.set_wakeup_fd(-1)
            if previous not in (-1, self._wake_w.fileno()):
                signal.set_wakeup_fd(previous)  # another owner's: left as it was
        except ValueError:  # not the main thread, where no wake-up descriptor was set from
            pass
        self._wake_r.close()
        self._wake_w.close()

    def _make_sampler(self, launcher_pid: int):
        try:
            return telemetry.make_sampler(self.run_id, self.plan["gpu_indices"], launcher_pid)
        except Exception as exc:  # telemetry must never take a run down
            say(f"telemetry unavailable: {exc}")
            return None

    def _start_energy_meter(self) -> telemetry.EnergyMeter | None:
        try:
            return telemetry.EnergyMeter.start(self.plan["gpu_indices"])
        except Exception as exc:  # like telemetry, the energy figures must never take a run down
            say(f"energy unavailable: {exc}")
            return None

    def _energy_figures(self, summary: dict, progress: dict) -> dict:
        if self.energy is None:
            return {}
        try:
            figures = self.energy.figures(summary, logged_tokens=progress.get("tokens") or 0.0)
        except Exception as exc:
            return {"energy_unavailable": f"the energy counter could not be read ({exc})"}
        if "energy_j" not in figures:
            return figures
        return telemetry.shared_gpu_figures(figures, self._runs_sharing_gpus())

    def _runs_sharing_gpus(self) -> dict[int, list[int]] | None:
        """The other runs that used this run's GPUs while it lived, live ones too; None where the
        history cannot be read."""
        found = []
        self.write_history(lambda: found.append(self.store.runs_sharing_gpus(
            self.run_id, self.run["host"], self.plan["gpu_indices"], self.started_at, time.time())))
        return found[0] if found else None

    def finish(self, exit_code: int, cpu_percent: float, leftovers: int) -> None:
        disk_space.free_room(RunDir(self.run_dir).room_reserve)  # the end is written in it on a full disk
        if leftovers:
            say(f"killed {leftovers} leftover process(es) of the run")
        if self.hung_error is not None:
            status, error, hint = "failed", self.hung_error, hung_hint(self.run_id, self.run_dir)
        elif self.stop_requested_at is not None:
            status, error, hint = "stopped", None, None
        elif self.preempt_requested_at is not None and self.preempted() is not None:
            # The ranks ended as asked (a peer's exit code may say it lost rank 0 meanwhile).
            status, error, hint = "preempted", None, preempted_hint(self.run_id, self.preempted())
        elif exit_code == 0:
            status, error, hint = "succeeded", None, None
        else:
            status = "failed"
            error, hint = failure(self.run_dir, self.store.home, exit_code, self.run["settings"],
                                  direct_rank=bool(self.direct_rank_env()))
        # A run that ended before rank 0 merged its results keeps the rows its ranks finished (in
        # their own files, where a full disk leaves no room for the merge).
        with contextlib.suppress(OSError):
            merge_results(self.run_dir)
        remove_unasked_stacks(self.run_dir)
        progress = self.throughput.progress(time.time(), finished=True)
        if nonfinite := self.tailer.nonfinite():
            progress["nonfinite"] = nonfinite
        summary = ended_summary(self.tailer.summaries.get(0, {}), progress, status == "succeeded")
        summary.update(self._run_figures(cpu_percent))
        summary.update(step_phases.summarise(self.tailer.step_phases))
        summary.update(self._energy_figures(summary, progress))
        end = {"exit_code": exit_code, "summary": summary, "error": error, "hint": hint, "progress": progress}
        # The folder first: the one record of a stop, and of the end of a run whose history was lost.
        if unwritten := RunDir(self.run_dir).try_record_end(status, started_at=self.started_at, **end):
            say(f"the run's end could not be written to run.json ({unwritten}); the history holds it")
        self.write_history(lambda: self.store.finish_run(self.run_id, status, **end))

    def preempted(self) -> dict | None:
        """What rank 0 wrote on ending at SLURM's signal (RunDir.preempted), or None."""
        try:
            return json.loads(RunDir(self.run_dir).preempted.read_text())
        except (OSError, ValueError):
            return None

    def _run_figures(self, cpu_percent: float) -> dict:
        figures = {
            "duration_s": round(time.time() - self.started_at, 3),
            "supervisor_cpu_percent": round(cpu_percent, 3),
        }
        if skipped := self.run["settings"].get("questions_too_long"):
            figures["questions_too_long"] = skipped  # left out before launch (too_long=skip; control/launch.py)
        if fitted := self.run["settings"].get("fitted_to_ranks"):
            # Defaults moved before launch to split over the ranks (recipes/shared/rank_split.py), beside
            # those rank 0 moved itself (a device default: eggroll's population).
            by_rank = self.tailer.summaries.get(0, {}).get("fitted_to_ranks")
            figures["fitted_to_ranks"] = "; ".join(filter(None, (fitted, by_rank)))
        peaks = []
        self.write_history(lambda: peaks.extend(self.store.device_peaks(self.run_id, kinds=("gpu", "rank"))))
        if peaks:
            figures["peak_run_mem_mb"] = {f"{p['kind']}{p['idx']}": round(p["peak_run_mem_mb"] or 0, 1) for p in peaks}
        # Seconds each GPU ran the run's own kernels: what the run cost the card where others shared it.
        busy = {f"gpu{p['idx']}": round(p["mean_run_util"] / 100 * figures["duration_s"], 1)
                for p in peaks if p["kind"] == "gpu" and p["mean_run_util"] is not None}
        if busy:
            figures["gpu_busy_s"] = busy
        return figures


def say(line: str) -> None:
    """A line of the supervisor's log (its stdout: RUN_DIR/logs/supervisor.log). On a full disk the
    line is lost, not the supervisor: it must still record how the run ended."""
    try:
        print(line, flush=True)
    except OSError:
        pass


def failure(run_dir: Path, home: Path, exit_code: int, settings: dict,
            direct_rank: bool = False) -> tuple[str, str | None]:
    """What a failed run died of, and a hint: the first error of its ranks (control/run_errors.py;
    `direct_rank`: `exit_code` is the one rank's own, started without a launcher); where GPUSCALE_HOME's
    file system is full, that, in one line naming it, the rank's error kept as the hint (a rank on a
    full disk often cannot even write its error, and dies "with no error")."""
    error, hint = first_error(run_dir, exit_code, direct_rank=direct_rank)
    if disk_space.mentions_disk_full(error) or disk_space.short_of_room(run_dir):
        return disk_space.disk_full_line(home), f"the disk filled during the run; {error}"
    return error, hint_for(error, settings) if hint is None else hint


def process_state(proc: psutil.Process | None) -> str:
    """psutil's state of a rank's process (`stopped`, `sleeping`, `disk-sleep`...), `gone` for none."""
    try:
        return proc.status() if proc is not None else "gone"
    except psutil.Error:
        return "gone"


def read_stacks(folder: RunDir, rank: int) -> str:
    try:
        return folder.stacks(rank).read_text(errors="replace")
    except OSError:
        return ""


def stacks_written(folder: RunDir, rank: int) -> bool:
    return bool(read_stacks(folder, rank).strip())


def remove_unasked_stacks(run_dir: Path) -> None:
    """Each rank keeps its stacks file open from its start, empty unless the supervisor asked for its
    stacks: the empty ones go, so that errors/ holds only what was written."""
    for path in RunDir(run_dir).stacks_files():
        try:
            if path.stat().st_size == 0:
                path.unlink()
        except OSError:
            pass


def hung_hint(run_id: int, run_dir: Path) -> str:
    """What to do after a hung run: resume from its last checkpoint, the stacks saying where it stood."""
    checkpoint = latest_checkpoint(run_dir)
    go_on = (f"`gpuscale resume {run_id}` goes on from {checkpoint.name}" if checkpoint else
             "it wrote no checkpoint: run it again (checkpoint_every sets how often one is written)")
    return (f"{go_on}; errors/hung.json and the stacks say where each rank stood (`gpuscale logs {run_id}` "
            "for what it printed)")


def launcher_preexec() -> None:
    """In the launcher, before exec: it dies with the supervisor, and ignores SIGUSR1 (torchrun would
    die of it; SLURM may send it to every process of a job step). The ranks inherit the ignored
    signal and take it themselves once started (engines/preemption.py). A rank started without a
    launcher gets the same: SIGUSR1 ignored until it takes it, and SIGTERM should the supervisor die
    (until run_rank asks for SIGKILL instead, as it does under a launcher)."""
    die_with_parent(signal.SIGTERM)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def preempted_hint(run_id: int, preempted: dict | None) -> str:
    """What a preempted run's end says: what it left, and how it goes on."""
    checkpoint = (preempted or {}).get("checkpoint")
    if checkpoint:
        return (f"preempted after step {preempted.get('step')}: {Path(checkpoint).name} written; the requeued "
                f"SLURM job continues from it (or `gpuscale resume {run_id}`)")
    return ("preempted with no checkpoint (the signal came outside a training loop that writes one, or the "
            "recipe writes none): the requeued SLURM job resumes from an earlier checkpoint if there is one, "
            "else starts it over")


def partial_summary(progress: dict) -> dict:
    """The figures of a run that ended without rank 0's summary (stopped, failed, lost), from its
    metrics so far (a `Throughput.progress`): steps done of the total, samples and tokens done, and
    every other figure the ranks logged, combined over the ranks; marked `"partial": true`."""
    figures = {"partial": True, **(progress.get("latest") or {})}
    figures.update(steps_done=progress.get("step", 0), samples=progress.get("samples", 0.0),
                   tokens=progress.get("tokens", 0.0))
    if progress.get("total") is not None:
        figures["steps_total"] = progress["total"]
    return figures


def ended_summary(rank0_summary: dict, progress: dict, succeeded: bool) -> dict:
    """The summary a run is recorded with: rank 0's summary (its parts merged); for a run that did
    not succeed, on top of the figures of its progress (`partial_summary`), so that neither the
    steps it trained nor the figures it had already measured are lost. Rank 0's figures win where
    both name one."""
    if succeeded:
        return dict(rank0_summary)
    return {**partial_summary(progress), **rank0_summary}


def summary_from_files(run_dir: str | Path, run_id: int) -> dict:
    """The summary of a run whose supervisor is gone (so not a run that succeeded), from the ranks'
    metric files, which hold all they logged, after the supervisor's last tick too: `ended_summary`
    of rank 0's summary parts and the figures so far."""
    tailer = MetricsTailer(RunDir(run_dir).metrics_dir, run_id)
    throughput = Throughput()
    throughput.add(tailer.read_new())
    summary = ended_summary(tailer.summaries.get(0, {}), throughput.progress(time.time(), finished=True), False)
    return {**summary, **step_phases.summarise(tailer.step_phases)}


# Inductor's pool of compile workers, each a process of its own: left alone every rank starts as many as it
# may use cores (at most 32): in the acceptance's one call, dozens of runs on 16 cores each started 16 at once
# (bench/RESULTS.md, "Where the card's time goes in the one call"). A rank gets as many as its OpenMP threads,
# its share of the cores; at 1 Inductor compiles in the rank itself.
COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def rank_environment(environ, run_dir: Path, plan: dict, threads: str | None = None) -> dict[str, str]:
    """The launcher's (and so every rank's) environment: the run marker, the devices, the threads (OpenMP's
    and Inductor's compile workers, unless the user set them), and where transformers' TensorBoard
    integration writes (otherwise under the checkpoints)."""
    env = dict(environ)
    env[RUN_DIR_ENV] = str(run_dir)
    env.setdefault("TENSORBOARD_LOGGING_DIR", str(RunDir(run_dir).tensorboard))
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's device numbers then match NVML's
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if plan["gpu_indices"]:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, plan["gpu_indices"]))
    else:
        env["GPUSCALE_DEVICE"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = threads or omp_threads(environ, plan["nproc"])[0]
    env[COMPILE_THREADS_ENV] = environ.get(COMPILE_THREADS_ENV) or env["OMP_NUM_THREADS"]
    return env


def omp_threads(environ, nproc: int, cores: int | None = None, busy: float | None = None, ranks_here: int = 0,
                gpus_here: int = 0) -> tuple[str, str]:
    """OpenMP threads per rank, and why (the supervisor's log says both).

    A value the user set wins. Otherwise the ranks share the cores that are free now. Left alone,
    torchrun gives each of several ranks one thread but a single rank every core, so 1 and N GPUs
    would differ in host threads too. Counting only free cores keeps a busy machine from collapsing:
    a rank with more threads than free cores waits at every OpenMP barrier for a descheduled thread
    (on 2 busy cores a tiny decode step took 500 ms with 2 threads, 1.6 ms with 1: bench/RESULTS.md),
    while one thread on an idle machine loses at most the parallel speed-up.

    Free cores cannot see runs that start at the same moment (the load average lags; their ranks do
    not exist yet), so two caps more: the cores over `ranks_here`, the ranks of every live run on this
    host (this one's included, from the history), and on a GPU the GPU's share of the cores
    (`gpus_here`: the GPUs this process sees). Four 1-GPU runs started together on a 64-core host each
    took 64 threads, and each ran 1.5-2x slower than alone (bench/RESULTS.md, the scaling section).
    """
    if environ.get("OMP_NUM_THREADS"):
        return environ["OMP_NUM_THREADS"], "set by the user"
    cores = cores or usable_cores()
    busy = busy_cores(cores) if busy is None else busy
    free = max(0, int(cores - busy + 0.5))
    ranks_here = max(ranks_here, nproc)
    threads = max(1, min(free // nproc, cores // ranks_here, cores // gpus_here if gpus_here else cores))
    return str(threads), (f"{cores} cores, {busy:.1f} busy, {free} free, {nproc} rank(s) of {ranks_here} on this host"
                          + (f", {gpus_here} GPUs" if gpus_here else "")
                          + ": the least of free cores / ranks, cores / ranks on the host"
                          + (", cores / GPUs" if gpus_here else "") + ", at least 1")


def busy_cores(cores: int) -> float:
    """How many cores other work uses now: the larger of the 1-minute load average (what has been
    running) and the last 0.2 s of CPU use (what has just started)."""
    return max(os.getloadavg()[0], psutil.cpu_percent(interval=0.2) / 100 * cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_id", type=int)
    parser.add_argument("--home", type=Path, required=True)
    args = parser.parse_args()
    store = Store(args.home)
    # What the run starts names the same home, from the run folder it starts in (a relative
    # GPUSCALE_HOME of the user's would name another folder there); the ranks never open the history
    # itself: a run id in their settings is a run folder by launch (launch.run_ids_as_folders).
    os.environ["GPUSCALE_HOME"] = str(store.home)
    supervisor = Supervisor(store, args.run_id)
    supervisor.install_signal_handlers()
    try:
        supervisor.supervise()
    except BaseException as exc:
        with contextlib.suppress(OSError):  # the log is on the run's disk, which may be full
            traceback.print_exc()
        kill_run_processes(str(supervisor.run_dir), timeout=2.0)
        disk_space.free_room(RunDir(supervisor.run_dir).room_reserve)
        with contextlib.suppress(OSError):
            merge_results(supervisor.run_dir)
        end = {"error": f"supervisor: {type(exc).__name__}: {exc}",
               "summary": summary_from_files(supervisor.run_dir, args.run_id)}
        if disk_space.is_disk_full(exc):
            end["error"] = disk_space.disk_full_line(store.home)
        RunDir(supervisor.run_dir).try_record_end("failed", **end)
        supervisor.write_history(lambda: supervisor.store.finish_run(args.run_id, "failed", **end))
        if disk_space.is_disk_full(exc):
            sys.exit(1)  # recorded, in one line: the traceback would say no more
        raise


if __name__ == "__main__":
    main()
