"""The hang watch (control/hang_watch.py): the ranks' heartbeats as a real Reporter writes them and the
supervisor's tailer reads them, the timeout rule and its allowances, a late rank's warning, and where
a rank stands read from a real faulthandler dump."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from gpuscale.app.views.collapse import late_warnings
from gpuscale.control.hang_watch import (
    AUTO_FLOOR_S,
    LATE_FLOOR_S,
    PHASE_ALLOWANCE_S,
    HangWatch,
    RankStand,
    hung_error,
    main_thread_frames,
    where,
)
from gpuscale.control.metrics_tail import Beat, MetricsTailer
from gpuscale.engines import reporter as reporter_module
from gpuscale.engines.reporter import Reporter
from gpuscale.runs.heartbeat import (
    BEAT_EVERY_S,
    BEAT_KEY,
    EVALUATE,
    HEARTBEATS_ENV,
    LOADING,
    SAVE,
    STACKS_SIGNAL,
    STEP,
    beats_on,
)
from gpuscale.runs.settings import RunSettings, SettingsError, resolve_settings


def steps(rank: int, start: float, seconds: list[float], first_step: int = 0) -> list[Beat]:
    """A rank's lines: a beat into its first step at `start`, then a logged step after each of `seconds`."""
    beats, t = [Beat(rank, start, first_step, STEP)], start
    for done, took in enumerate(seconds, first_step + 1):
        t += took
        beats.append(Beat(rank, t, done, STEP))
    return beats


def test_a_reporter_writes_a_beat_on_each_change_of_phase_and_at_most_one_a_second_within_one(tmp_path):
    reporter = Reporter(tmp_path, 1)
    for _ in range(50):  # a busy evaluation: one line, not fifty
        reporter.beat(EVALUATE)
    reporter.log(step=1, loss=2.0)  # a logged step: always written, and the rank is stepping
    reporter.beat(STEP)  # the same phase right after a line: nothing more
    reporter.beat(SAVE)
    time.sleep(BEAT_EVERY_S + 0.1)
    reporter_module.beat(SAVE, step=1)  # the module's beat finds the rank's Reporter
    reporter.close()
    reporter_module.beat(SAVE)  # after close: nothing, and no error
    tailer = MetricsTailer(tmp_path / "metrics", 3)
    rows = tailer.read_new()
    assert [(b.phase, b.step) for b in tailer.take_beats()] == [
        (LOADING, 0), (EVALUATE, 0), (STEP, 1), (SAVE, 1), (SAVE, 1)]
    assert tailer.take_beats() == []  # handed over once
    assert [row["name"] for row in rows] == ["loss"]  # a heartbeat is no metric row


def test_gpuscale_heartbeats_0_keeps_a_rank_from_beating_and_nothing_else(tmp_path, monkeypatch):
    """The bench aid (bench/heartbeat_cost.py): no beat, the logged steps and the summary written as ever."""
    assert beats_on({}) and beats_on({HEARTBEATS_ENV: "1"}) and not beats_on({HEARTBEATS_ENV: " 0"})
    monkeypatch.setenv(HEARTBEATS_ENV, "0")
    reporter = Reporter(tmp_path, 0)  # would beat LOADING
    reporter.beat(EVALUATE)
    reporter.log(step=1, loss=2.0)
    reporter_module.beat(SAVE, step=1)
    reporter.summary({"steps": 1})
    reporter.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [sorted(line) for line in lines] == [["loss", "rank", "step", "t"], ["rank", "summary", "t"]]


def test_the_step_timeout_is_auto_larger_of_the_floor_and_five_times_the_p95_step():
    watch = HangWatch(None, started_at=0.0, ranks=range(2))
    assert watch.timeout_s() == AUTO_FLOOR_S  # nothing measured yet
    # The first step of each rank (compiling: 300 s) is left out of the pace.
    watch.saw(steps(0, 10.0, [300.0] + [40.0] * 19) + steps(1, 10.0, [300.0] + [40.0] * 18 + [60.0]))
    assert watch.step_time_p95() == 40.0
    assert watch.timeout_s() == 200.0
    assert HangWatch(45, 0.0, range(1)).timeout_s() == 45.0
    assert HangWatch(0, 0.0, range(1)).timeout_s() is None


def test_a_run_is_hung_only_when_no_rank_advanced_within_its_allowance():
    watch = HangWatch(20, started_at=0.0, ranks=range(2))
    assert watch.hung(PHASE_ALLOWANCE_S - 1) is None  # loading: the phases' allowance, not 20 s
    assert watch.hung(PHASE_ALLOWANCE_S + 1) is not None  # no rank ever wrote a line
    watch.saw(steps(0, 100.0, [1.0] * 5) + steps(1, 100.0, [1.0] * 5))  # both at step 5 at t=105
    assert watch.hung(124.0) is None
    stands = watch.hung(126.0)
    assert [(s.rank, s.step, s.phase, s.allowance_s) for s in stands] == [(0, 5, STEP, 20.0), (1, 5, STEP, 20.0)]
    watch.saw([Beat(0, 125.0, 5, EVALUATE)])  # rank 0 evaluates alone: it advances, the run is not hung
    assert watch.hung(140.0) is None
    assert watch.hung(125.0 + PHASE_ALLOWANCE_S + 1) is not None
    watch.saw([Beat(0, 130.0, None, None)])  # a summary line: alive, still evaluating
    assert watch.stands(131.0)[0].phase == EVALUATE
    off = HangWatch(0, started_at=0.0, ranks=range(1))
    assert off.hung(10 * PHASE_ALLOWANCE_S) is None


def test_the_first_step_and_a_save_get_the_phases_allowance():
    watch = HangWatch(20, started_at=0.0, ranks=range(1))
    watch.saw([Beat(0, 5.0, 0, STEP)])  # in its first step
    assert watch.stands(6.0)[0].allowance_s == PHASE_ALLOWANCE_S
    watch.saw([Beat(0, 50.0, 1, STEP), Beat(0, 51.0, 2, STEP), Beat(0, 51.5, 2, SAVE)])
    assert watch.stands(52.0)[0].allowance_s == PHASE_ALLOWANCE_S
    watch.saw([Beat(0, 60.0, 2, STEP), Beat(0, 61.0, 3, STEP)])
    assert watch.stands(62.0)[0].allowance_s == 20.0
    # The save's time is no step time: the pace is step 1 -> 2 and step 2 -> 3 after the save, 1 s each.
    assert watch.step_time_p95() == 1.0


def test_a_rank_ahead_in_a_save_waits_on_the_rank_behind_and_gets_the_steps_allowance():
    """Rank 1 froze in step 6 after its gradient all-reduce; rank 0 logged step 6 and went on to the save,
    where it waits on rank 1: the run is hung at the step's 20 s, not after the save's allowance."""
    watch = HangWatch(20, started_at=0.0, ranks=range(2))
    watch.saw(steps(0, 100.0, [1.0] * 5) + steps(1, 100.0, [1.0] * 5))  # both at step 5 at t=105
    watch.saw([Beat(0, 106.0, 6, STEP), Beat(0, 106.1, 6, SAVE)])
    assert watch.hung(125.5) is None  # rank 0: 19.4 s in the save
    stands = watch.hung(126.2)
    assert [(s.rank, s.step, s.phase) for s in stands] == [(0, 6, SAVE), (1, 5, STEP)]
    # Both at the save's step: rank 0 writes the checkpoint, rank 1 is done and waits in the next step.
    watch.saw([Beat(1, 106.0, 6, STEP), Beat(1, 106.1, 6, SAVE), Beat(1, 106.5, 6, STEP)])
    assert watch.hung(106.1 + PHASE_ALLOWANCE_S - 1) is None
    assert watch.hung(106.1 + PHASE_ALLOWANCE_S + 1) is not None


def test_a_late_rank_is_warned_from_three_times_its_p95_step_and_never_under_the_floor():
    watch = HangWatch(None, started_at=0.0, ranks=range(2))
    watch.saw(steps(0, 0.0, [2.0] * 10) + steps(1, 0.0, [10.0] * 10))  # rank 0 at t=20, rank 1 at t=100
    assert [s.rank for s in watch.late(129.0)] == [0]  # rank 1: 29 s, under 3 x 10 s
    late = watch.late(131.0)
    assert [s.rank for s in late] == [0, 1]  # rank 0: 111 s > 3 x 2; rank 1: 31 s > 3 x 10
    fast = HangWatch(None, started_at=0.0, ranks=range(1))
    fast.saw(steps(0, 0.0, [0.1] * 10))
    assert fast.late(1.0 + LATE_FLOOR_S - 0.5) == [] and fast.late(1.0 + LATE_FLOOR_S + 0.5) != []
    progress = watch.progress(131.0)
    assert progress["hang_timeout_s"] == AUTO_FLOOR_S and [entry["rank"] for entry in progress["late"]] == [0, 1]
    [warning] = late_warnings(progress)
    assert warning.startswith("ranks 0, 1 late: no progress for 111 s at step 10 (over 3x the p95 step time, 10 s)")
    assert warning.endswith("the run ends as hung after 120 s without progress (hang_timeout)")
    assert late_warnings({**progress, "hang_timeout_s": None})[0].endswith("hang_timeout is off: nothing ends it")
    assert late_warnings({}) == []


def test_hang_timeout_takes_seconds_auto_and_off_and_refuses_anything_else():
    assert RunSettings().hang_timeout == "auto"
    assert RunSettings(hang_timeout="").hang_timeout == "auto"
    assert RunSettings(hang_timeout="off").hang_timeout == RunSettings(hang_timeout="none").hang_timeout == 0
    assert RunSettings(hang_timeout="90").hang_timeout == 90.0
    for value, why in (("-1", "seconds must be 0 (off) or more"), ("nan", "seconds must be 0 (off) or more"),
                       ("soon", "expected 'auto', 'off' (or 0) or a number of seconds")):
        with pytest.raises(SettingsError) as refused:
            resolve_settings(RunSettings, overrides={"hang_timeout": value}, environ={})
        assert str(refused.value) == f"hang_timeout: {value!r}: {why}"


def test_a_real_faulthandler_dump_says_where_the_main_thread_waits(tmp_path):
    """A process that answers STACKS_SIGNAL as a rank does (engines/distributed.py), blocked in a
    function called from a helper thread's company: the main thread's innermost frame is named."""
    stacks = tmp_path / "stacks.txt"
    code = f"""
import faulthandler, sys, threading, time
faulthandler.register({int(STACKS_SIGNAL)}, file=open({str(stacks)!r}, "w"), all_threads=True)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
def waits_for_a_peer():
    print("ready", flush=True)
    time.sleep(60)
waits_for_a_peer()
"""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(STACKS_SIGNAL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "<module>" not in stacks.read_text():
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    frames = main_thread_frames(stacks.read_text())
    assert [frame["function"] for frame in frames] == ["waits_for_a_peer", "<module>"]
    assert where(frames).startswith("in waits_for_a_peer (<string>:")  # its line: the print's or the sleep's
    assert where([]) is None


def test_a_collective_is_named_with_the_gpuscale_code_that_called_it():
    frames = [{"file": "/venv/site-packages/torch/distributed/distributed_c10d.py", "line": "4394",
               "function": "all_gather_single"},
              {"file": "/venv/site-packages/torch/distributed/c10d_logger.py", "line": "83", "function": "wrapper"},
              {"file": "/venv/site-packages/torch/distributed/distributed_c10d.py", "line": "4413",
               "function": "all_gather_into_tensor"},
              {"file": "/src/gpuscale/recipes/eggroll/trainer.py", "line": "426", "function": "_gather"},
              {"file": "<frozen runpy>", "line": "198", "function": "_run_module_as_main"}]
    assert where(frames) == "waits in all_gather_into_tensor (distributed_c10d.py:4413) from _gather (trainer.py:426)"


# Rank 0's stacks as faulthandler wrote them in a 2-rank sft run under accelerate launch, rank 1 stopped
# (tests/integration/test_hung_runs.py): DDP's gradient all-reduce waits inside autograd's engine, with
# no torch.distributed frame in Python's stack.
BACKWARD_STACKS = """\
Thread 0x00007f7af11fd6c0 (most recent call first):
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 331 in wait
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 629 in wait
  File "/work/main/.venv/lib/python3.11/site-packages/tqdm/_monitor.py", line 69 in run
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f7b1dc7bb80 (most recent call first):
  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 395 in backward
  File "/work/main/.venv/lib/python3.11/site-packages/torch/_tensor.py", line 623 in backward
  File "/work/main/.venv/lib/python3.11/site-packages/accelerate/accelerator.py", line 2861 in backward
  File "/work/main/.venv/lib/python3.11/site-packages/transformers/trainer.py", line 2126 in training_step
  File "/work/main/.venv/lib/python3.11/site-packages/trl/trainer/sft_trainer.py", line 1693 in training_step
  File "/work/main/.venv/lib/python3.11/site-packages/transformers/trainer.py", line 1917 in _run_epoch
  File "/work/main/.venv/lib/python3.11/site-packages/transformers/trainer.py", line 1660 in _inner_training_loop
  File "/work/main/.venv/lib/python3.11/site-packages/transformers/trainer.py", line 1576 in train
  File "/work/main/gpuscale/recipes/shared/training.py", line 87 in train_model
  File "/work/main/gpuscale/recipes/shared/training.py", line 178 in train_sft_dataset
  File "/work/main/gpuscale/recipes/shared/training.py", line 147 in train_sft
  File "/work/main/gpuscale/recipes/sft/trainer.py", line 27 in run_sft
  File "/work/main/gpuscale/recipes/sft/__init__.py", line 129 in run
  File "/work/main/gpuscale/recipes/shared/contract.py", line 185 in run_on_device
  File "/work/main/gpuscale/engines/distributed.py", line 245 in run_rank
  File "/work/main/gpuscale/recipes/__main__.py", line 24 in main
  File "/work/main/gpuscale/recipes/__main__.py", line 28 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def test_a_rank_in_autograds_engine_waits_in_the_gradient_all_reduce_where_it_has_peers():
    frames = main_thread_frames(BACKWARD_STACKS)
    assert frames[0]["function"] == "_engine_run_backward" and frames[-1]["function"] == "_run_module_as_main"
    waits = "waits in the gradient all-reduce (inside backward, _engine_run_backward) from train_model (training.py:87)"
    assert where(frames) == waits
    # A run of one rank has no all-reduce to wait in: its backward is only where it stands.
    assert where(frames, peers=False) == "in _engine_run_backward (graph.py:979) from train_model (training.py:87)"
    # Waiting, it is held by the rank that does not wait.
    stands = [RankStand(0, 6, STEP, 21.0, 20.0, 0.5), RankStand(1, 6, STEP, 20.4, 20.0, 0.5)]
    looping = "in spin (trainer.py:12)"
    assert hung_error(stands, {0: "sleeping", 1: "running"}, {0: waits, 1: looping}, "/r/errors") == (
        f"hung: rank 1 made no progress for 20 s at step 6 ({looping}); rank 0 at step 6 {waits}; stacks in /r/errors/")


def test_the_hung_error_names_the_rank_that_holds_the_others():
    stands = [RankStand(0, 138, STEP, 121.0, 120.0, 1.0), RankStand(1, 138, STEP, 122.0, 120.0, 1.0)]
    waits = "waits in all_reduce (distributed_c10d.py:2850) from train (training.py:80)"
    # Rank 1 stopped (SIGSTOP): it cannot answer; rank 0 waits for it.
    stopped = hung_error(stands, {0: "sleeping", 1: "stopped"}, {0: waits, 1: None}, "/r/errors", idle_gpus=[0, 1])
    assert stopped == ("hung: rank 1 made no progress for 122 s at step 138 (stopped: SIGSTOP or a debugger holds "
                       f"it); rank 0 at step 138 {waits}; GPUs 0, 1 at 0% utilization; stacks in /r/errors/")
    # Both answer: the one not waiting in a collective holds the other.
    looping = "in spin (trainer.py:12)"
    assert hung_error(stands, {0: "sleeping", 1: "running"}, {0: waits, 1: looping}, "/r/errors").startswith(
        f"hung: rank 1 made no progress for 122 s at step 138 ({looping}); rank 0 at step 138 {waits}")
    # Both wait: the one silent longest.
    assert hung_error(stands, {0: "sleeping", 1: "sleeping"}, {0: waits, 1: waits}, "/r/errors").startswith(
        "hung: rank 1 made no progress for 122 s")
    evaluating = [RankStand(0, 5, EVALUATE, 700.0, 600.0, None)]
    assert hung_error(evaluating, {0: "disk-sleep"}, {0: None}, "/r/errors") == (
        "hung: rank 0 made no progress for 700 s at step 5 (evaluate, in uninterruptible sleep: I/O or a driver); "
        "stacks in /r/errors/")


def test_heartbeat_lines_keep_their_format(tmp_path):
    """The line the supervisor reads (runs/heartbeat.py): its keys, one JSON object a line."""
    reporter = Reporter(tmp_path, 2)
    reporter.close()
    [line] = (tmp_path / "metrics" / "rank2.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert set(record) == {"t", "rank", "step", BEAT_KEY} and record[BEAT_KEY] == LOADING and record["rank"] == 2
    assert signal.Signals(STACKS_SIGNAL).name == "SIGUSR2"
