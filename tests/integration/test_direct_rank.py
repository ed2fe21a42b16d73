"""A run of one process in all starts its rank without a launcher (control/launch.py:launcher_argv): end
to end on CPU, the real CLI, supervisor and rank, for a torchrun recipe (probe) and an accelerate one
(grpo-mtl). Runs of two ranks keep theirs (test_runs.py's stopped run, test_sft_run.py's command). A one-process
run stopped (`gpuscale stop`: SIGTERM to the rank's process group, the supervisor's child) is test_runs.py's
test_stopped_run_keeps_its_results_and_a_partial_summary (power-sampling on 1 rank)."""

from __future__ import annotations

import json

import psutil
import pytest

from conftest import gpuscale, leftover_processes, run_json, wait_until
from gpuscale.control.store import Store
from gpuscale.runs.process import RUN_DIR_ENV
from gpuscale.runs.statuses import LIVE_STATUSES

pytestmark = pytest.mark.e2e  # every test here starts real runs

PROBE = ["--recipe", "probe", "--gpus", "1", "--set", "steps=4", "--set", "prompt_tokens=8", "--batch-size", "2"]
GRPO = ["--recipe", "grpo-mtl", "--gpus", "1", "--set", "rollout.n=4", "--set", "data.train_batch_size=4",
        "--set", "ppo_micro_batch_size_per_gpu=4", "--set", "max_response_length=16", "--set", "max_steps=2",
        "--set", "eval_examples=0", "--set", "max_examples=16"]


def supervisors_child(home, run_id: int) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the process the run's supervisor started, read while it lives (once
    it has exec'd: before, it is a copy of the supervisor, without the run's mark)."""
    store = Store(home)

    def started() -> tuple[list[str], dict[str, str]] | None:
        try:
            for child in psutil.Process(store.get_run(run_id)["supervisor_pid"]).children():
                if RUN_DIR_ENV in (environment := child.environ()):
                    return child.cmdline(), environment
        except (psutil.Error, TypeError, ValueError):  # no supervisor yet, or already gone
            pass
        return None

    return wait_until(started, 60, interval=0.05, message=f"the child of run {run_id}'s supervisor")


def ended(home, run_id: int) -> dict:
    """The run as `gpuscale show` gives it once it has ended. Waited for in the history itself: a `gpuscale
    show` each poll took about half a CPU-second, one core's worth beside the run it waits for."""
    store = Store(home)
    wait_until(lambda: store.get_run(run_id)["status"] not in LIVE_STATUSES, 180, message=f"run {run_id} to end")
    return run_json("show", str(run_id))


@pytest.mark.parametrize("arguments", [PROBE, GRPO], ids=["torchrun", "accelerate"])
def test_a_one_process_run_starts_its_rank_itself(home, arguments):
    run_id = int(gpuscale("run", *arguments, "--detach").stdout)
    argv, environment = supervisors_child(home, run_id)
    assert argv[1:5] == ["-m", "gpuscale.recipes", "--recipe", arguments[1]]  # the rank: no launcher between
    if arguments is PROBE:  # torchrun's variables for its one rank
        assert (environment["RANK"], environment["WORLD_SIZE"], environment["LOCAL_RANK"]) == ("0", "1", "0")
        assert int(environment["MASTER_PORT"]) > 0
    else:  # accelerate's for its one process, which has no RANK
        assert environment["ACCELERATE_USE_CPU"] == "True" and environment["ACCELERATE_MIXED_PRECISION"] == "no"
        assert "RANK" not in environment
    run = ended(home, run_id)
    assert run["status"] == "succeeded", run["error"]
    assert run["command"] == argv and run["summary"]["world_size"] == 1
    shown = gpuscale("show", str(run_id)).stdout.splitlines()
    assert f"command: python -m gpuscale.recipes --recipe {arguments[1]} --settings {run['run_dir']}/settings.json" \
        in shown
    assert not leftover_processes(run["run_dir"])


def test_a_one_process_run_whose_rank_is_killed_names_rank_0_and_the_signal(home):
    """SIGKILL, as the kernel's out-of-memory killer sends it: no error file, no traceback, no launcher's
    table of failed ranks; the rank's own end, its exit status, names it."""
    result = gpuscale("run", *PROBE, "--json", env={"GPUSCALE_INJECT_FAULT": "0:kill:2"})
    assert result.returncode == 1
    run = json.loads(result.stdout)
    assert run["status"] == "failed" and run["error"] == "rank 0: killed by SIGKILL with no error of its own"
    assert "out-of-memory killer" in run["hint"]
    assert not leftover_processes(run["run_dir"])
