"""A figure measured at a recipe's defaults says which defaults (recipes/shared/defaults_fingerprint.py)."""

from gpuscale.recipes.shared import defaults_fingerprint
from gpuscale.recipes.shared.defaults_fingerprint import defaults_fingerprints, fingerprint, recipe_defaults


def test_a_device_default_counts_both_of_its_values():
    eggroll = recipe_defaults("eggroll")
    assert eggroll["population"] == {"gpu": 2048, "cpu": 64} and eggroll["sigma"] == 0.003
    moved = {**eggroll, "population": {"gpu": 1024, "cpu": 64}}  # a GPU value changed, `auto` as before
    assert fingerprint(moved) != fingerprint(eggroll)


def test_a_changed_default_changes_its_recipe_s_fingerprint_alone(monkeypatch):
    before = defaults_fingerprints()
    assert before == defaults_fingerprints()  # the same defaults, the same fingerprints
    real = defaults_fingerprint.recipe_defaults
    monkeypatch.setattr(defaults_fingerprint, "recipe_defaults",
                        lambda name: {**real(name), **({"prompts_per_step": 15} if name == "grpo-mtl" else {})})
    after = defaults_fingerprints()
    assert [name for name in before if before[name] != after[name]] == ["grpo-mtl"]


def test_a_setting_added_off_by_default_changes_no_fingerprint_until_its_default_moves(monkeypatch):
    from pydantic import Field, create_model

    from gpuscale.recipes.shared.registry import get_recipe

    recipe = get_recipe("grpo-mtl")
    before = defaults_fingerprints()["grpo-mtl"]

    def with_new_mode(default: str):
        settings_cls = create_model("Settings", __base__=recipe.settings_cls, new_mode=(str, Field(default)))
        monkeypatch.setattr(recipe, "settings_cls", settings_cls)
        return defaults_fingerprints()["grpo-mtl"]

    assert with_new_mode("off") != before  # a new setting counts...
    assert defaults_fingerprint.settings_added_since("grpo-mtl", before) == ["new_mode"]  # ...and is found
    neutral = {**defaults_fingerprint.NEUTRAL_ADDITIONS["grpo-mtl"], "new_mode": "off"}
    monkeypatch.setattr(defaults_fingerprint, "NEUTRAL_ADDITIONS", {"grpo-mtl": neutral})
    assert with_new_mode("off") == before  # ...unless named with the default that keeps the old behaviour
    assert with_new_mode("on") != before  # and only while its default is that one


def test_a_setting_added_at_the_behaviour_before_it_counts_only_once_its_default_changes(monkeypatch):
    """grpo-mtl's rollout (sync, the only behaviour before it) is left out of its fingerprint; a default
    of async would count."""
    from types import SimpleNamespace
    from typing import Literal

    from gpuscale.recipes.grpo_mtl import Settings

    assert "rollout" not in recipe_defaults("grpo-mtl") and "max_staleness" not in recipe_defaults("grpo-mtl")
    before = defaults_fingerprints()["grpo-mtl"]

    class AsyncByDefault(Settings):
        rollout: Literal["sync", "async"] = "async"

    real = defaults_fingerprint.get_recipe
    monkeypatch.setattr(defaults_fingerprint, "get_recipe", lambda name: SimpleNamespace(
        settings_cls=AsyncByDefault) if name == "grpo-mtl" else real(name))
    assert recipe_defaults("grpo-mtl")["rollout"] == "async" and defaults_fingerprints()["grpo-mtl"] != before
