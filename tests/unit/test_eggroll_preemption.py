"""eggroll on SLURM's signal (engines/preemption.py), one in-process rank on the embedded model: the
signal during step 1 ends the run after that step with its checkpoint (none was scheduled:
checkpoint_every=0), and the run continued from it ends with the weights of the run left alone."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from gpuscale.engines import preemption
from gpuscale.engines.distributed import RankContext
from gpuscale.engines.reporter import Reporter
from gpuscale.recipes.eggroll import Eggroll, Settings
from gpuscale.recipes.eggroll.trainer import run_eggroll
from gpuscale.runs.checkpoints import list_checkpoints
from gpuscale.runs.run_dir import RunDir

TINY = {"eval_examples": 0, "population": 4, "prompts_per_step": 2, "max_new_tokens": 4, "steps": 3,
        "batch_size": 8, "save_model": False, "checkpoint_every": 0, "optimizer": "adam", "lr": 0.05, "sigma": 0.05,
        "max_examples": 16}  # not the whole 200,000-problem training split: ~4 s a run to generate


def final_summary(run_dir: Path) -> dict:
    records = [json.loads(line) for line in RunDir(run_dir).metrics(0).read_text().splitlines()]
    return [r["summary"] for r in records if "summary" in r and not r.get("partial")][-1]


def run(run_dir: Path, signal_at_step: int | None = None, **settings) -> None:
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, run_dir)
    reporter = Reporter(run_dir, 0)
    if signal_at_step is not None:
        log = reporter.log

        def log_then_signal(step, **scalars):
            log(step, **scalars)
            if step == signal_at_step:
                os.kill(os.getpid(), signal.SIGUSR1)  # as the supervisor passes SLURM's on, mid-step

        reporter.log = log_then_signal
    try:
        run_eggroll(Eggroll().for_device(Settings(**{**TINY, **settings}), on_gpu=False, ranks=1), ctx, reporter)
    finally:
        reporter.close()


def test_a_preempted_eggroll_run_checkpoints_that_step_and_resumes_to_the_same_weights(tmp_path, one_torch_thread):
    before = signal.getsignal(signal.SIGUSR1)
    preemption.install()
    try:
        with pytest.raises(preemption.Preempted) as ended:
            run(tmp_path / "preempted", signal_at_step=1)
    finally:
        preemption.install()  # the flag down again, for the runs below
        signal.signal(signal.SIGUSR1, before)
    checkpoints = list_checkpoints(tmp_path / "preempted")
    assert [p.name for p in checkpoints] == ["checkpoint-1"]
    assert (ended.value.step, ended.value.checkpoint) == (1, str(checkpoints[0]))

    run(tmp_path / "alone")
    run(tmp_path / "continued", resume_from=str(checkpoints[0]))
    alone, continued = final_summary(tmp_path / "alone"), final_summary(tmp_path / "continued")
    assert continued["weights_checksum"] == alone["weights_checksum"]
    assert continued["fitness_mean_first"] == alone["fitness_mean_first"]  # the parent's step 1, carried
