"""The training recipes' `report_to`: transformers' integrations, each checked to be installed before
launch (without importing transformers), none and all standing alone."""

import importlib

import pytest

from gpuscale.recipes.shared.registry import all_recipes
from gpuscale.recipes.shared.report_backends import REPORT_BACKENDS, checked_report_to
from gpuscale.recipes.shared.training_settings import TrainingSettings
from gpuscale.runs.settings import SettingsError, resolve_settings


def test_the_names_are_transformers_integrations():
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    # kubeflow: transformers turns it on by itself inside a Kubeflow TrainJob; nothing to install.
    assert set(REPORT_BACKENDS) == set(INTEGRATION_TO_CALLBACK) - {"kubeflow"}


@pytest.fixture
def installed_here(tmp_path, monkeypatch):
    """`wandb` importable (an empty package on sys.path), and nothing else of the integrations."""
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    real_find_spec = importlib.util.find_spec
    others = {module for needs, _ in REPORT_BACKENDS.values() for group in needs for module in group} - {"wandb"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in others else real_find_spec(name, *a))


@pytest.mark.parametrize("value, kept", [("none", "none"), ("", "none"), (" None ", "none"), ("all", "all"),
                                         ("wandb", "wandb"), ("WandB, wandb", "wandb")])
def test_none_all_and_installed_integrations_are_taken(installed_here, value, kept):
    assert checked_report_to(value) == kept


@pytest.mark.parametrize("value, reason", [
    ("tensorboard", "tensorboard is not installed here (pip install tensorboard): the trainer would fail when it "
                    "starts"),
    ("wandb,dagshub", "dagshub is not installed here (pip install dagshub mlflow)"),
    ("tensorbored", "unknown integration 'tensorbored'; known: none, all, tensorboard, wandb"),
    ("none,wandb", "none and all stand alone"),
    ("all,wandb", "none and all stand alone"),
])
def test_an_unknown_or_missing_integration_is_refused_naming_it(installed_here, value, reason):
    with pytest.raises(ValueError, match="^" + reason.replace("(", r"\(").replace(")", r"\)")):
        checked_report_to(value)


@pytest.mark.parametrize("name", [name for name, recipe in all_recipes().items()
                                  if issubclass(recipe.settings_cls, TrainingSettings)])
def test_every_training_recipe_takes_it_and_refuses_it_before_launch(installed_here, name):
    settings_cls = all_recipes()[name].settings_cls
    assert settings_cls().report_to == "none"
    assert resolve_settings(settings_cls, overrides={"report_to": "wandb"}, environ={}).report_to == "wandb"
    with pytest.raises(SettingsError, match="^report_to: 'tensorboard': tensorboard is not installed here"):
        resolve_settings(settings_cls, overrides={"report_to": "tensorboard"}, environ={})
