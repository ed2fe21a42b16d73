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

# The recipes that ship with gpuscale, so that a source checkout on PYTHONPATH knows them too;
# other packages add theirs through the entry point group.
BUILTIN = {"probe": "gpuscale.recipes.probe", "power-sampling": "gpuscale.recipes.power_sampling"}


@dataclass(frozen=True)
class Recipe:
    name: str
    module: str
    summary: str
    settings_cls: type[RunSettings]
    launcher: str = "torchrun"


@lru_cache(maxsize=1)
def all_recipes() -> dict[str, Recipe]:
    modules = dict(BUILTIN)
    modules.update({entry.name: entry.value for entry in entry_points(group=GROUP)})
    recipes = {}
    for name, module_name in sorted(modules.items()):
        module = importlib.import_module(module_name)
        recipes[name] = Recipe(
            name=name,
            module=module_name,
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
