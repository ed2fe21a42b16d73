"""A short fingerprint of each recipe's defaults: what a measured figure was measured with.

A figure measured at a recipe's defaults describes today's tool only while those defaults stand. Every
bench result records the fingerprint of every recipe's defaults (bench/record.py), so that a test can
tell a figure measured at today's defaults from one measured at older ones, which must be measured again
or go. The fingerprint covers each setting's default as the settings class declares it, with both values
of a device default (recipes/shared/device_defaults.py: `auto` alone would hide a change of the GPU's
value). It does not cover the data: a change of the data set's held-out problems is its own edition.

A setting added after a figure was measured, whose default keeps what the code did before (a new mode
that is off by default), changes nothing the figure measured: NEUTRAL_ADDITIONS names it with that
default, and the fingerprint leaves it out while its default is that value. Once its default changes, it
counts, and every figure of its recipe is stale.

No torch: the front end and the tests compute it.
"""

from __future__ import annotations

import hashlib
import json

from gpuscale.recipes.shared.device_defaults import device_defaults
from gpuscale.recipes.shared.registry import BUILTIN, get_recipe

# recipe -> {setting: the default that keeps the behaviour before it}: settings added since the figures
# README quotes were measured (bench/readme_figures.py).
NEUTRAL_ADDITIONS: dict[str, dict[str, object]] = {
    # max_staleness, generation_gpus and old_logprobs are read only by rollout=async; 0 generators: every rank
    # generates; no domain_weights: the training prompts are the data's own, in the order TRL drew them before it;
    # no entropy_coef: TRL's loss without its entropy term
    "grpo-mtl": {"rollout": "sync", "max_staleness": 1, "generation_gpus": 0, "old_logprobs": "loss",
                 "domain_weights": "", "entropy_coef": 0.0},
}


def recipe_defaults(name: str) -> dict:
    """The recipe's defaults by setting, a device default as {"gpu": ..., "cpu": ...}, less the
    NEUTRAL_ADDITIONS still at their neutral default."""
    settings_cls = get_recipe(name).settings_cls
    defaults = settings_cls().model_dump(mode="json")
    for field, default in device_defaults(settings_cls).items():
        defaults[field] = {"gpu": default.gpu, "cpu": default.cpu}
    for field, neutral in NEUTRAL_ADDITIONS.get(name, {}).items():
        if field in defaults and defaults[field] == neutral:
            del defaults[field]
    return defaults


def fingerprint(defaults: dict) -> str:
    return hashlib.sha256(json.dumps(defaults, sort_keys=True).encode()).hexdigest()[:16]


def defaults_fingerprints() -> dict[str, str]:
    """Every built-in recipe's fingerprint, by name."""
    return {name: fingerprint(recipe_defaults(name)) for name in sorted(BUILTIN)}


def settings_added_since(name: str, recorded: str) -> list[str]:
    """The settings of recipe `name` without which today's defaults have the fingerprint `recorded`: a setting added
    since a figure was measured, the figure otherwise at today's defaults. Where its default keeps the behaviour
    before it, it belongs in NEUTRAL_ADDITIONS; else the figure is stale indeed. (One setting at a time: a figure
    two additions old is only said to be stale.)"""
    defaults = recipe_defaults(name)
    return [field for field in defaults
            if fingerprint({key: value for key, value in defaults.items() if key != field}) == recorded]
