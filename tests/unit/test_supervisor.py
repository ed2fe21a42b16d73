"""The supervisor's own process hygiene: what it opens for the launcher, it closes."""

from __future__ import annotations

import gc
import json
import signal
import sys
import time
import warnings
from pathlib import Path

from gpuscale.control.store import Store
from gpuscale.control.supervisor import DIRECT_RANK_ENV, Supervisor


def test_launch_leaves_no_file_open_in_the_supervisor(tmp_path):
    store = Store(tmp_path)
    run_id = store.create_run("probe", {}, [sys.executable, "-c", "print('launcher started')"], "host")
    run_dir = tmp_path / "runs" / str(run_id)
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"gpu_indices": [], "nproc": 1}))
    supervisor = Supervisor(store, run_id)
    gc.collect()  # what earlier tests left for the collector is theirs, not this launch's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launcher = supervisor.launch()
        gc.collect()  # a file object nobody closed warns when it is collected
    assert launcher.wait(30) == 0
    assert (run_dir / "logs" / "launcher.log").read_text() == "launcher started\n"  # the child's copy wrote it
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def ignored_signals(pid: int) -> set[int]:
    """The signals process `pid` ignores, from the kernel's mask (SigIgn in /proc/PID/status)."""
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    bits = int(mask.split()[1], 16)
    return {number for number in range(1, 65) if bits & (1 << (number - 1))}


def test_a_rank_without_a_launcher_is_started_as_its_launcher_would_start_it(tmp_path):
    """A one-process run's rank is the supervisor's own child (control/launch.py:launcher_argv): it gets
    plan.json's variables on top of every run's, SIGUSR1 (SLURM's, which the rank takes once it has
    started) ignored as under a launcher, and the hang watch finds it as rank 0, though `accelerate
    launch` gives its one process no RANK."""
    store = Store(tmp_path)
    # A stand-in rank: its argv names the rank's module, as `python -m gpuscale.recipes ...` does.
    run_id = store.create_run("sft", {}, [sys.executable, "-c", "import time; time.sleep(60)", "gpuscale.recipes"],
                              "host")
    run_dir = tmp_path / "runs" / str(run_id)
    (run_dir / "logs").mkdir(parents=True)
    plan = {"gpu_indices": [], "nproc": 1, DIRECT_RANK_ENV: {"ACCELERATE_USE_CPU": "True", "KMP_BLOCKTIME": "1"}}
    (run_dir / "plan.json").write_text(json.dumps(plan))
    supervisor = Supervisor(store, run_id)
    rank = supervisor.launch()
    try:
        time.sleep(0.5)  # exec'd by now
        ranks = supervisor.rank_processes()
        assert list(ranks) == [0] and ranks[0].pid == rank.pid
        environment = ranks[0].environ()
        assert environment["ACCELERATE_USE_CPU"] == "True" and environment["KMP_BLOCKTIME"] == "1"
        assert environment["GPUSCALE_RUN_DIR"] == str(run_dir) and "RANK" not in environment
        assert signal.SIGUSR1 in ignored_signals(rank.pid)
        # Where the run has a launcher, a process of the module without RANK is that launcher, not a rank.
        del supervisor.plan[DIRECT_RANK_ENV]
        assert supervisor.rank_processes() == {}
    finally:
        rank.kill()
        rank.wait()
        supervisor.close()


def test_the_headline_combines_every_rank_live_and_equals_the_summary_at_the_end(tmp_path):
    """Two ranks whose running accuracies differ, through real metric files and a real store: the
    stored progress, the progress line, the stored run-wide series (the Charts tab) and the finished
    run's headline all give the run's accuracy, not the last rank's line."""
    from gpuscale.app.views.feed import RunFeed, figure_series
    from gpuscale.app.views.runs import progress_line
    from gpuscale.engines.reporter import Reporter

    store = Store(tmp_path)
    run_id = store.create_run("power-sampling", {}, [sys.executable, "-c", "pass"], "host")
    run_dir = tmp_path / "runs" / str(run_id)
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "plan.json").write_text(json.dumps({"gpu_indices": [], "nproc": 2}))
    store.update_run(run_id, status="running", started_at=1.0)
    supervisor = Supervisor(store, run_id)
    ranks = [Reporter(run_dir, rank=0), Reporter(run_dir, rank=1)]
    ranks[0].log(step=1, samples=4, accuracy=3 / 4)  # 3 of 4 right
    ranks[1].log(step=1, samples=8, accuracy=2 / 8)  # 2 of 8 right: rank 1 writes last
    supervisor.tick(sampler=None)
    run = store.get_run(run_id)
    assert run["progress"]["latest"]["accuracy"] == 5 / 12
    assert "accuracy 0.4167" in progress_line(run, now=10.0)
    feed = RunFeed(run_id, keep_s=float("inf"))
    feed.poll(store, now=1e10)
    charted = figure_series(feed, "accuracy", now=feed_end(store, run_id), window_s=60)
    assert charted.ys[-1] == 5 / 12
    ranks[0].summary({"accuracy": 5 / 12, "acceptance_rate": 0.3})
    for reporter in ranks:
        reporter.close()
    supervisor.tick(sampler=None)  # the launcher has exited: the last tick reads the summary
    supervisor.finish(exit_code=0, cpu_percent=1.0, leftovers=0)
    run = store.get_run(run_id)
    assert run["status"] == "succeeded" and run["progress"]["latest"]["accuracy"] == run["summary"]["accuracy"]


def feed_end(store: Store, run_id: int) -> float:
    return max(row["t"] for row in store.metrics(run_id)) + 1.0
