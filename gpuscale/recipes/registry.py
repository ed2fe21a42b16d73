"""The recipes gpuscale knows: entry points of the group `gpuscale.recipes`.

Each entry point names a module that defines `Settings` (a RunSettings subclass), `SUMMARY` (one
line for the recipe list), optionally `LAUNCHER` ("torchrun", the default, or "accelerate"), and a rank
entry point run by `python -m <module> --settings FILE`. Loading a recipe imports only that module's
top level, which must not import torch: the TUI lists recipes at start-up.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points

from gpuscale.engines.settings import RunSettings, SettingsError

GROUP = "gpuscale.recipes"


@dataclass(frozen=True)
class Recipe:
    name: str
    module: str
    summary: str
    settings_cls: type[RunSettings]
    launcher: str = "torchrun"


@lru_cache(maxsize=1)
def all_recipes() -> dict[str, Recipe]:
    recipes = {}
    for entry in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        module = importlib.import_module(entry.value)
        recipes[entry.name] = Recipe(
            name=entry.name,
            module=entry.value,
            summary=getattr(module, "SUMMARY", ""),
            settings_cls=module.Settings,
            launcher=getattr(module, "LAUNCHER", "torchrun"),
        )
    return recipes


def get_recipe(name: str) -> Recipe:
    recipes = all_recipes()
    if name not in recipes:
        known = ", ".join(recipes) or "none installed"
        raise SettingsError(f"recipe: {name!r}: unknown recipe; known recipes: {known}")
    return recipes[name]
