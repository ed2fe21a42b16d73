"""The recipes gpuscale knows, by name: the one list of them.

Built-in recipes are listed in BUILTIN; other packages add theirs through the entry point group
`gpuscale.recipes` (name = "package.module:RecipeClass"). Each names a `Recipe` subclass (see
contract.py). Loading a recipe imports only its module's top level, which must not import torch: the
TUI lists recipes at start-up.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from importlib.metadata import entry_points

from gpuscale.recipes.shared.contract import Recipe
from gpuscale.runs.settings import SettingsError

GROUP = "gpuscale.recipes"

# Adding a recipe: its package under recipes/, and one line here.
BUILTIN = {
    "probe": "gpuscale.recipes.probe:Probe",
    "power-sampling": "gpuscale.recipes.power_sampling:PowerSampling",
    "sft": "gpuscale.recipes.sft:SFT",
    "eggroll": "gpuscale.recipes.eggroll:Eggroll",
    "grpo-mtl": "gpuscale.recipes.grpo_mtl:GrpoMtl",
    "rft": "gpuscale.recipes.rft:RFT",
}


def load_recipe(reference: str) -> Recipe:
    """An instance of the Recipe class that "package.module:Class" names."""
    module_name, _, class_name = reference.partition(":")
    recipe_cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(recipe_cls, type) and issubclass(recipe_cls, Recipe)):
        raise TypeError(f"{reference} is not a gpuscale.recipes.shared.contract.Recipe subclass")
    return recipe_cls()


@lru_cache(maxsize=1)
def all_recipes() -> dict[str, Recipe]:
    references = dict(BUILTIN)
    references.update({entry.name: entry.value for entry in entry_points(group=GROUP)})
    recipes = {}
    for name, reference in sorted(references.items()):
        recipe = load_recipe(reference)
        if recipe.name != name:
            raise TypeError(f"{reference} is registered as {name!r} but calls itself {recipe.name!r}")
        recipes[name] = recipe
    return recipes


def get_recipe(name: str) -> Recipe:
    recipes = all_recipes()
    if name not in recipes:
        known = ", ".join(recipes) or "none installed"
        raise SettingsError(f"recipe: {name!r}: unknown recipe; known recipes: {known}")
    return recipes[name]
