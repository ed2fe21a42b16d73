"""A short fingerprint of each recipe's defaults: what a measured figure was measured with.

A figure measured at a recipe's defaults describes today's tool only while those defaults stand. Every
bench result records the fingerprint of every recipe's defaults (bench/record.py), so that a test can
tell a figure measured at today's defaults from one measured at older ones, which must be measured again
or go. The fingerprint covers each setting's default as the settings class declares it, with both values
of a device default (recipes/shared/device_defaults.py: `auto` alone would hide a change of the GPU's
value). It does not cover the data: a change of the data set's held-out problems is its own edition.
A setting added later with the behaviour before it as its default (`BEHAVIOUR_BEFORE`) is left out
while its default is that one: the figures measured before it still describe the defaults; its default
changed, it counts like any other.

No torch: the front end and the tests compute it.
"""

from __future__ import annotations

import hashlib
import json

from gpuscale.recipes.shared.device_defaults import device_defaults
from gpuscale.recipes.shared.registry import BUILTIN, get_recipe

# recipe -> {setting: the default that keeps the behaviour before the setting}
BEHAVIOUR_BEFORE = {
    "grpo-mtl": {"rollout": "sync", "max_staleness": 1},  # issue 53: max_staleness is read only by async
}


def recipe_defaults(name: str) -> dict:
    """The recipe's defaults by setting, a device default as {"gpu": ..., "cpu": ...}; a setting of
    `BEHAVIOUR_BEFORE` at that default left out."""
    settings_cls = get_recipe(name).settings_cls
    defaults = settings_cls().model_dump(mode="json")
    for field, default in device_defaults(settings_cls).items():
        defaults[field] = {"gpu": default.gpu, "cpu": default.cpu}
    for field, before in BEHAVIOUR_BEFORE.get(name, {}).items():
        if defaults.get(field) == before:
            del defaults[field]
    return defaults


def fingerprint(defaults: dict) -> str:
    return hashlib.sha256(json.dumps(defaults, sort_keys=True).encode()).hexdigest()[:16]


def defaults_fingerprints() -> dict[str, str]:
    """Every built-in recipe's fingerprint, by name."""
    return {name: fingerprint(recipe_defaults(name)) for name in sorted(BUILTIN)}
