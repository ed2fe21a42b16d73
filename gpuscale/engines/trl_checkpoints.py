"""Checkpoints for the TRL recipes (sft, rft, grpo-mtl): the settings every training recipe shares
(`checkpoint_every`, `keep_checkpoints`, `resume_from`) as TrainingArguments.

    config = trainer_args(settings, ctx, SFTConfig, **checkpoint_args(settings, ctx.run_dir))
    trainer.train(resume_from_checkpoint=resume_checkpoint(settings))

TRL's trainer then writes RUN_DIR/checkpoints/checkpoint-<step>/ (model, optimizer, scheduler, RNG
states, the step and the data position) and, given a checkpoint, continues from it. The checkpoint
folders themselves (which is complete, the newest, pruning) are runs/checkpoints.py's, for every recipe.

The trainer's checkpoint restores the RNGs it knows of (torch's, numpy's and Python's global ones,
per rank), not the generators gpuscale keeps beside it (the engine's sampling stream in rollout.py,
PCGrad's order in grpo_mtl/multitask.py). Those are seeded afresh at every optimizer step from
`derived_seed(seed, ..., step)` (data/seeds.py) instead of being drawn on from the start of the run: a step's random
numbers then depend on the run's seed and the step alone, and a run resumed from a checkpoint draws
exactly what the uninterrupted run drew (tests/integration/test_resume.py checks the weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuscale.runs.run_dir import RunDir


def checkpoint_args(settings, run_dir: str | Path) -> dict[str, Any]:
    """TrainingArguments fields for the run's checkpoints: every `checkpoint_every` optimizer steps
    into RUN_DIR/checkpoints, the newest `keep_checkpoints` kept; none when checkpoint_every is 0
    but the one SLURM's signal asks for (engines/preemption.py), which goes there too."""
    every = getattr(settings, "checkpoint_every", 0)
    where = {"output_dir": str(RunDir(run_dir).checkpoints),
             "save_total_limit": getattr(settings, "keep_checkpoints", None) or None}
    if not every:
        return {"save_strategy": "no", **where}
    return {"save_strategy": "steps", "save_steps": every, **where}


def resume_checkpoint(settings) -> str | None:
    """What to hand `trainer.train(resume_from_checkpoint=...)`: the folder `gpuscale resume` set, or None."""
    return getattr(settings, "resume_from", None) or None

