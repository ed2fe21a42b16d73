"""eggroll's checkpoints: RUN_DIR/checkpoints/checkpoint-<step>/, written by rank 0.

What a step needs to go on exactly: the perturbed parameters (their fp32 masters, so a bf16 model
loses nothing), Adam's state (optimizer=adam), the step, and the figures the summary is built
from. The noise and the prompts of a step are regenerated from (seed, step), so none is stored; the
ES update is the same on every rank, so one copy serves any number of ranks. The ranks' own
generators (used only by sampling without common random numbers) are kept with the world size they
belong to and restored only under the same world size; under another one, every rank seeds its
generator from (seed, step, rank) instead.

The folder is written under a temporary name and renamed into place, with `checkpoint.json` last, so
a run killed while writing never leaves a half checkpoint (runs/checkpoints.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpuscale.data.seeds import derived_seed
from gpuscale.engines.reporter import beat
from gpuscale.runs.checkpoints import prune_checkpoints, writing_checkpoint
from gpuscale.runs.heartbeat import SAVE

STATE_FILE = "state.pt"
META_FILE = "checkpoint.json"
# 2: the noise, the prompts and the ranks' generators seeded by data/seeds.derived_seed (1: by
# arithmetic on the seed). A step's draws are not stored but regenerated from (seed, step), so a
# format-1 checkpoint resumed under the new rule would go on with other noise and prompts than the
# run it came from: neither that run's continuation nor a fresh one. It is refused, saying so.
FORMAT = 2


def save(trainer, step: int, history: dict) -> Path | None:
    """Every rank calls it (the ranks' generator states are gathered); rank 0 writes. `history`:
    the JSON-able figures so far (fitness means, tokens, the `before` accuracies)."""
    ctx, settings = trainer.ctx, trainer.settings
    beat(SAVE)
    generators = ctx.gather(trainer.generator.get_state().cpu())
    if not ctx.is_main:
        return None
    modules = trainer.linears + trainer.norms
    state = {
        "names": [name for name, _ in modules],
        "masters": [master.detach().cpu() for master in trainer.updater.masters],
        "adam": trainer.updater.adam.state_dict() if trainer.updater.adam is not None else None,
        "generators": generators,
    }
    with writing_checkpoint(ctx.run_dir, step) as folder:
        torch.save(state, folder / STATE_FILE)
        meta = {"format": FORMAT, "recipe": "eggroll", "step": step, "seed": settings.seed,
                "world_size": ctx.world_size, "optimizer": settings.optimizer, "history": history}
        (folder / META_FILE).write_text(json.dumps(meta))
    prune_checkpoints(ctx.run_dir, settings.keep_checkpoints)
    return folder


def load(trainer, path: str | Path) -> tuple[int, dict]:
    """Put the checkpoint's parameters, Adam state and (same world size) generator into `trainer`;
    returns the step it ended and its history."""
    path, ctx, settings = Path(path), trainer.ctx, trainer.settings
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("recipe") != "eggroll":
        raise ValueError(f"resume_from: {path}: not an eggroll checkpoint")
    if meta.get("format") != FORMAT:
        raise ValueError(f"resume_from: {path}: checkpoint format {meta.get('format')}, expected {FORMAT}: it was "
                         "written under an earlier seed rule, so its steps' noise and prompts cannot be drawn "
                         "again; start the run afresh")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    modules = trainer.linears + trainer.norms
    names = [name for name, _ in modules]
    if state["names"] != names:
        raise ValueError(f"resume_from: {path}: its parameters are not this run's ({len(state['names'])} saved, "
                         f"{len(names)} here: a different model, or perturb_norms changed)")
    updater = trainer.updater
    with torch.no_grad():
        for master, saved in zip(updater.masters, state["masters"]):
            master.copy_(saved.to(master.device))
        for weight, master in zip(updater.weights, updater.masters):
            if master is not weight:
                weight.copy_(master)
    if updater.adam is not None and state["adam"] is not None:
        updater.adam.load_state_dict(state["adam"])
    elif updater.adam is not None:
        print(f"{path}: saved with optimizer {meta.get('optimizer')}: Adam starts afresh", flush=True)
    step = int(meta["step"])
    if meta.get("world_size") == ctx.world_size and len(state["generators"]) == ctx.world_size:
        trainer.generator.set_state(state["generators"][ctx.rank])
    else:
        trainer.generator.manual_seed(derived_seed(settings.seed, "sampling", ctx.rank, step))
    return step, meta.get("history") or {}
