"""End to end on CPU: a rank that stops advancing, or dies, ends its run, under torchrun (eggroll) and
under accelerate launch (sft): real ranks on gloo, a real supervisor and runs.db.

- SIGSTOP of rank 1 in a step (not in a save, which has minutes) with hang_timeout=16: a late warning
  first (at LATE_FLOOR_S, 10 s), then the run ends `failed`, its error `hung: rank 1 ...`, within 60 s,
  with rank 0's stacks in RUN_DIR/errors/ and no process left (the two launchers' runs at once: their
  allowances, every rank idle, pass together).
- SIGKILL of rank 1: every other rank ends within 10 s (the launcher's own doing: torchrun's agent,
  which accelerate launch runs too, ends the group when one rank fails), the error naming rank 1. Under
  torchrun here; under accelerate launch (sft, 2 ranks, rank 1 killed in training) it is bench/faults.py's
  sft-kill case, whose test (test_bench_scripts.py's test_faults_bench_kills_a_rank_and_times_the_others_end_on_cpu)
  asserts the same: the other rank gone within 10 s, `failed`, the same error line, no process left. A
  rank killed so is also how the kernel's out-of-memory killer ends one: the run's hint says so.
"""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import gpuscale, leftover_processes, rank_processes, run_json, slow, wait_until
from gpuscale.app.views.collapse import late_warnings
from gpuscale.control.hang_watch import main_thread_frames
from gpuscale.control.metrics_tail import beat_of
from gpuscale.control.store import Store
from gpuscale.recipes.shared.registry import get_recipe
from gpuscale.runs.heartbeat import STEP
from gpuscale.runs.run_dir import RunDir
from gpuscale.runs.statuses import LIVE_STATUSES

pytestmark = pytest.mark.e2e  # every test here starts real runs

# Long enough to be stopped mid-training; a collective every step, so rank 0 waits on a stopped rank 1.
RUNS = {
    "torchrun": ["--recipe", "eggroll", "--set", "population=8", "--set", "prompts_per_step=4",
                 "--set", "max_new_tokens=24", "--set", "steps=500", "--set", "eval_examples=8",
                 "--set", "fitness=correctness", "--batch-size", "16", "--set", "max_examples=64"],
    "accelerate": ["--recipe", "sft", "--batch-size", "2", "--set", "max_examples=64", "--set", "max_steps=500",
                   "--set", "max_length=64", "--set", "eval_examples=2", "--set", "max_new_tokens=8",
                   "--set", "checkpoint_every=2"],
}


def start(home: Path, launcher: str, *extra: str) -> int:
    """A detached 2-rank run under `launcher`: its id."""
    assert get_recipe(RUNS[launcher][1]).launcher == launcher
    return int(gpuscale("run", *RUNS[launcher], "--gpus", "2", *extra, "--detach").stdout)


def at_step_4(home: Path, run_id: int) -> Path:
    """The run's folder, once each of its ranks has logged step 4 (its step times known)."""
    store = Store(home)
    wait_until(lambda: {m["rank"] for m in store.metrics(run_id) if m["step"] >= 4} >= {0, 1}, 240,
               message="both ranks at step 4")
    return Path(store.get_run(run_id)["run_dir"])


LAUNCHERS = list(RUNS)


def last_phase(run_dir: Path, rank: int) -> str | None:
    """The phase the rank's last metric line says it is in (control/metrics_tail.py's reading)."""
    lines = RunDir(run_dir).metrics(rank).read_text().splitlines()
    try:
        return beat_of(json.loads(lines[-1])).phase if lines else None
    except ValueError:
        return None  # stopped as it wrote the line


def stop_in_a_step(run_dir: Path) -> None:
    """SIGSTOP rank 1 in a training step: stopped in a save (checkpoint_every=2) it would be a rank
    frozen in a checkpoint, which has the phases' allowance of minutes (control/hang_watch.py), so it
    goes on (SIGCONT) and is stopped again until its last line says it stepped."""
    proc = rank_processes(run_dir)[1]
    for _ in range(40):
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.5)  # a line written as the signal came is on disk by now
        if last_phase(run_dir, 1) == STEP:
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.3)
    raise AssertionError(f"rank 1 of {run_dir} was never stopped in a step")


def until_ended(home: Path, run_id: int, since: float) -> tuple[dict, float, list[str]]:
    """The run as it ended (or as it was slow(120) s after `since`), the seconds from `since` to then,
    and the late warnings its progress gave on the way."""
    store, warned = Store(home), []
    while (run := store.get_run(run_id))["status"] in LIVE_STATUSES and time.monotonic() - since < slow(120):
        warned += late_warnings(run.get("progress") or {})
        time.sleep(0.5)
    return run, time.monotonic() - since, warned


# Above LATE_FLOOR_S (10 s), with room for a late warning to be seen before the run ends.
HANG_TIMEOUT = 16


@pytest.fixture(scope="module")
def hung_runs(module_home) -> dict:
    """A run under each launcher with hang_timeout=HANG_TIMEOUT, rank 1 of both stopped (SIGSTOP) at once,
    so that they wait out their allowance together, every rank idle: {launcher: its folder, then what
    `until_ended` saw of it}; and, under "killed", the id of the run the kill test kills, started (detached,
    no hang_timeout of its own) while the two wait, on the cores their idle ranks leave."""
    started = {launcher: start(module_home, launcher, "--set", f"hang_timeout={HANG_TIMEOUT}")
               for launcher in LAUNCHERS}
    folders = {launcher: at_step_4(module_home, run_id) for launcher, run_id in started.items()}
    for folder in folders.values():
        stop_in_a_step(folder)
    stopped = time.monotonic()
    with ThreadPoolExecutor(len(started)) as pool:
        ended = pool.map(lambda run_id: until_ended(module_home, run_id, stopped), started.values())
        killed = start(module_home, "torchrun")
        return {"killed": killed, **{launcher: (folders[launcher], *seen) for launcher, seen in zip(started, ended)}}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_stopped_rank_ends_the_run_as_hung_naming_it(hung_runs, launcher):
    run_dir, run, took, warned = hung_runs[launcher]
    assert run["status"] == "failed" and took < slow(60), (run["status"], took)
    silent = re.match(r"hung: rank 1 made no progress for (\d+) s ", run["error"])
    assert silent and HANG_TIMEOUT <= int(silent[1]) < HANG_TIMEOUT + 10, run["error"]
    assert "(stopped: SIGSTOP or a debugger holds it); rank 0 at step " in run["error"]
    assert run["error"].endswith(f"stacks in {run_dir / 'errors'}/")
    assert any(warning.startswith(("rank 1 late", "ranks 0, 1 late")) for warning in warned), warned
    stacks = (run_dir / "errors" / "stacks-rank0.txt").read_text()
    assert "Current thread" in stacks and "run_rank" in stacks  # rank 0 answered, with its whole stack
    assert not (run_dir / "errors" / "stacks-rank1.txt").exists()  # stopped: asked for nothing, its empty file gone
    where = json.loads((run_dir / "errors" / "hung.json").read_text())
    assert [(rank["rank"], rank["state"]) for rank in where["ranks"]] == [(0, "sleeping"), (1, "stopped")]
    # A collective, on a peer that never comes: a torch.distributed call, or DDP's gradient all-reduce,
    # which runs inside autograd's engine where Python's frames end (accelerate's sft, as CI caught it).
    in_backward = main_thread_frames(stacks)[0]["function"] == "_engine_run_backward"
    waits = "waits in the gradient all-reduce (inside backward, _engine_run_backward)" if in_backward else "waits in "
    assert where["ranks"][0]["where"].startswith(waits), where
    assert f"rank 0 at step {where['ranks'][0]['step']} " in run["error"] and where["ranks"][0]["where"] in run["error"]
    assert not leftover_processes(str(run_dir))
    if launcher == "accelerate":  # its checkpoints are kept, and the hint goes on from the newest
        shown = run_json("show", str(run["id"]))
        assert shown["hint"].startswith(f"`gpuscale resume {run['id']}` goes on from checkpoint-")


def test_a_killed_rank_ends_every_other_within_ten_seconds(module_home, hung_runs):
    run_id = hung_runs["killed"]  # a torchrun run (eggroll), as RUNS["torchrun"] without hang_timeout
    run_dir = at_step_4(module_home, run_id)
    rank_processes(run_dir)[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not rank_processes(run_dir), 10, interval=0.1, message="every rank to end")
    took = time.monotonic() - killed
    run = wait_until(lambda: (r := run_json("show", str(run_id)))["status"] not in LIVE_STATUSES and r, 60)
    assert took < slow(10)
    # Named with its signal, never torchrun's wrapper, and the hint says what sends a SIGKILL unasked: the
    # kernel's out-of-memory killer (no error file, no traceback).
    assert run["status"] == "failed" and run["error"] == "rank 1: killed by SIGKILL with no error of its own"
    assert "out-of-memory killer" in run["hint"]
    assert not leftover_processes(str(run_dir))
