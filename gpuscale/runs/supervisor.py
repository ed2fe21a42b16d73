"""One supervisor per run: `python -m gpuscale.runs.supervisor RUN_ID --home HOME`.

Started by a front end in a session of its own, it outlives the terminal. It spawns the launcher
(torchrun or accelerate) in its own process group, and once per tick samples telemetry, tails the
ranks' metrics into the store and checks the launcher. SIGTERM stops the run: SIGTERM to the launcher's
group, SIGKILL after STOP_GRACE_S. When the launcher has exited, it records the status, the summary,
and for a failed run the failing rank's first error line and a hint. A run that ended before rank 0
wrote its summary and results (stopped, failed) keeps what it did: the ranks' results files merged
into results.jsonl, and a summary of the figures so far marked partial. No process of the run outlives it:
the launcher dies with it (PR_SET_PDEATHSIG) and, at the end, anything still carrying the run's mark is
killed.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import time
import traceback
from pathlib import Path

import psutil

from gpuscale.runs import telemetry
from gpuscale.runs.metrics import MetricsTailer, Throughput
from gpuscale.runs.process import RUN_DIR_ENV, die_with_parent, kill_run_processes, signal_group
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.store import Store, merge_rank_results

STOP_GRACE_S = 7.0


class Supervisor:
    def __init__(self, store: Store, run_id: int):
        self.store = store
        self.run = store.get_run(run_id)
        self.run_id = run_id
        self.run_dir = Path(self.run["run_dir"])
        self.plan = json.loads(RunDir(self.run_dir).plan.read_text())
        self.interval = float(self.run["settings"].get("telemetry_interval", 1.0))
        self.stop_requested_at: float | None = None
        self.term_sent = False
        self.killed = False
        self.throughput = Throughput()
        self.tailer = MetricsTailer(RunDir(self.run_dir).metrics_dir, run_id)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False), self._wake_w.setblocking(False)

    # ---- signals: each one just wakes the loop, which does the work --------------------------

    def install_signal_handlers(self) -> None:
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal must not end the run
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the launcher's exit wakes the loop at once

    def _request_stop(self, *_args) -> None:
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()

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
        threads, why = omp_threads(os.environ, self.plan["nproc"])
        print(f"OMP_NUM_THREADS={threads} per rank ({why})", flush=True)
        env = rank_environment(os.environ, self.run_dir, self.plan, threads)
        # The launcher writes to its own copy of the descriptor: ours is closed once it has started.
        with open(RunDir(self.run_dir).launcher_log, "ab") as log:
            return subprocess.Popen(
                self.run["command"], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                process_group=0, preexec_fn=lambda: die_with_parent(signal.SIGTERM), cwd=self.run_dir,
            )

    def tick(self, sampler) -> None:
        now = time.time()
        rows = self.tailer.read_new()
        self.throughput.add(rows)
        rows += self.throughput.run_wide_rows(self.run_id)  # the figures combined over the ranks
        samples = sampler.sample(now) if sampler else []
        self.store.add_rows(rows, samples)
        progress = self.throughput.progress(now)
        if self.stop_requested_at is not None:
            progress["stopping"] = True  # the front ends then show no ETA while the ranks wind down
        self.store.update_run(self.run_id, progress=progress)

    def enforce_stop(self, launcher: subprocess.Popen) -> None:
        """SIGTERM the launcher's group once; SIGKILL everything of the run after the grace time."""
        if self.stop_requested_at is None:
            return
        if not self.term_sent:
            signal_group(launcher.pid, signal.SIGTERM)
            self.term_sent = True
        elif time.monotonic() - self.stop_requested_at > STOP_GRACE_S and not self.killed:
            signal_group(launcher.pid, signal.SIGKILL)
            kill_run_processes(str(self.run_dir), timeout=1.0)
            self.killed = True

    def supervise(self) -> None:
        me = psutil.Process()
        self.store.update_run(
            self.run_id, status="running", supervisor_pid=os.getpid(),
            supervisor_started=me.create_time(), started_at=time.time(),
        )
        wall_start, cpu_start = time.monotonic(), sum(me.cpu_times()[:2])
        launcher = self.launch()
        self.store.update_run(self.run_id, launcher_pid=launcher.pid)
        sampler = self._make_sampler(launcher.pid)
        next_tick = time.monotonic()
        while launcher.poll() is None:
            self.enforce_stop(launcher)
            if time.monotonic() >= next_tick:
                self.tick(sampler)
                next_tick = time.monotonic() + self.interval
            # Signals and the launcher's exit wake the loop early; while stopping, check the grace time often.
            self._sleep_until(next_tick if self.stop_requested_at is None else time.monotonic() + 0.2)
        self.tick(sampler)
        leftovers = kill_run_processes(str(self.run_dir), timeout=2.0)
        cpu_percent = 100.0 * (sum(me.cpu_times()[:2]) - cpu_start) / max(1e-9, time.monotonic() - wall_start)
        self.finish(launcher.returncode, cpu_percent, leftovers)

    def _make_sampler(self, launcher_pid: int):
        try:
            return telemetry.make_sampler(self.run_id, self.plan["gpu_indices"], launcher_pid)
        except Exception as exc:  # telemetry must never take a run down
            print(f"telemetry unavailable: {exc}", flush=True)
            return None

    def finish(self, exit_code: int, cpu_percent: float, leftovers: int) -> None:
        if leftovers:
            print(f"killed {leftovers} leftover process(es) of the run", flush=True)
        if self.stop_requested_at is not None:
            status, error, hint = "stopped", None, None
        elif exit_code == 0:
            status, error, hint = "succeeded", None, None
        else:
            status = "failed"
            error, hint = first_error(self.run_dir, exit_code)
            hint = hint_for(error, self.run["settings"]) if hint is None else hint
        # A run that ended before rank 0 merged its results keeps the rows its ranks finished.
        merge_rank_results(self.run_dir)
        progress = self.throughput.progress(time.time(), finished=True)
        summary = merged_summary(self.tailer.summaries.get(0), status, progress)
        summary.update(self._run_figures(cpu_percent))
        self.store.finish_run(
            self.run_id, status, exit_code=exit_code, summary=summary, error=error, hint=hint, progress=progress,
        )

    def _run_figures(self, cpu_percent: float) -> dict:
        run = self.store.get_run(self.run_id)
        figures = {
            "duration_s": round(time.time() - (run["started_at"] or time.time()), 3),
            "supervisor_cpu_percent": round(cpu_percent, 3),
        }
        peaks = self.store.device_peaks(self.run_id, kinds=("gpu", "rank"))
        if peaks:
            figures["peak_run_mem_mb"] = {f"{p['kind']}{p['idx']}": round(p["peak_run_mem_mb"] or 0, 1) for p in peaks}
        return figures


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


def merged_summary(written: dict | None, status: str, progress: dict) -> dict:
    """The run's summary: rank 0's where it wrote a whole one; a run that ended without (stopped,
    failed, lost) gets `partial_summary` of its figures so far, with whatever partial summary rank 0
    had written over it (figures measured before the end, e.g. the accuracy before training)."""
    summary = dict(written or {})
    if status == "succeeded" or (summary and not summary.get("partial")):
        return summary
    return {**partial_summary(progress), **summary}


def summary_from_files(run_dir: str | Path, run_id: int) -> dict:
    """The summary of a run whose supervisor is gone, from the ranks' metric files, which hold all
    they logged, after the supervisor's last tick too: rank 0's own summary where it wrote one, else
    `partial_summary` of the figures so far."""
    tailer = MetricsTailer(RunDir(run_dir).metrics_dir, run_id)
    throughput = Throughput()
    throughput.add(tailer.read_new())
    return merged_summary(tailer.summaries.get(0), "lost", throughput.progress(time.time(), finished=True))


def rank_environment(environ, run_dir: Path, plan: dict, threads: str | None = None) -> dict[str, str]:
    """The launcher's (and so every rank's) environment: the run marker, the devices, the threads."""
    env = dict(environ)
    env[RUN_DIR_ENV] = str(run_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's device numbers then match NVML's
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if plan["gpu_indices"]:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, plan["gpu_indices"]))
    else:
        env["GPUSCALE_DEVICE"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = threads or omp_threads(environ, plan["nproc"])[0]
    return env


def omp_threads(environ, nproc: int, cores: int | None = None, busy: float | None = None) -> tuple[str, str]:
    """OpenMP threads per rank, and why (the supervisor's log says both).

    A value the user set wins. Otherwise the ranks share the cores that are free now. Left alone,
    torchrun gives each of several ranks one thread but a single rank every core, so 1 and N GPUs
    would differ in host threads too. Counting only free cores keeps a busy machine from collapsing:
    a rank with more threads than free cores waits at every OpenMP barrier for a descheduled thread
    (on 2 busy cores a tiny decode step took 500 ms with 2 threads, 1.6 ms with 1: bench/RESULTS.md),
    while one thread on an idle machine loses at most the parallel speed-up.
    """
    if environ.get("OMP_NUM_THREADS"):
        return environ["OMP_NUM_THREADS"], "set by the user"
    cores = cores or os.cpu_count() or 1
    busy = busy_cores(cores) if busy is None else busy
    free = max(0, int(cores - busy + 0.5))
    threads = max(1, free // nproc)
    return str(threads), f"{cores} cores, {busy:.1f} busy, {free} free, {nproc} rank(s): free cores / ranks, at least 1"


def busy_cores(cores: int) -> float:
    """How many cores other work uses now: the larger of the 1-minute load average (what has been
    running) and the last 0.2 s of CPU use (what has just started)."""
    return max(os.getloadavg()[0], psutil.cpu_percent(interval=0.2) / 100 * cores)


def first_error(run_dir: Path, exit_code: int) -> tuple[str, str | None]:
    """The first error written by any rank (by time), else the launcher log's last error line."""
    records = []
    for path in RunDir(run_dir).error_files():
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if records:
        first = min(records, key=lambda r: r["t"])
        return f"rank {first['rank']}: {first['message']}", None
    log = RunDir(run_dir).launcher_log
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for line in reversed(lines):
        if "Error" in line or "error:" in line:
            return line.strip(), None
    if exit_code < 0:
        return f"launcher killed by signal {-exit_code}", None
    return f"launcher exited with code {exit_code}", None


def hint_for(error: str, settings: dict) -> str | None:
    text = error.lower()
    if "out of memory" in text or "outofmemoryerror" in text:
        size = settings.get("batch_size")
        smaller = max(1, size // 2) if isinstance(size, int) else None
        return f"out of GPU memory: lower batch_size (now {size}; try {smaller})" if smaller else "lower batch_size"
    if "address already in use" in text:
        return "the rendezvous port is taken: pick another --rdzv-endpoint port"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_id", type=int)
    parser.add_argument("--home", type=Path, required=True)
    args = parser.parse_args()
    store = Store(args.home)
    supervisor = Supervisor(store, args.run_id)
    supervisor.install_signal_handlers()
    try:
        supervisor.supervise()
    except BaseException as exc:
        traceback.print_exc()
        kill_run_processes(str(supervisor.run_dir), timeout=2.0)
        merge_rank_results(supervisor.run_dir)
        store.finish_run(args.run_id, "failed", error=f"supervisor: {type(exc).__name__}: {exc}",
                         summary=summary_from_files(supervisor.run_dir, args.run_id))
        raise


if __name__ == "__main__":
    main()
