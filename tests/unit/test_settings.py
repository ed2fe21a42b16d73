import pytest

from gpuscale.recipes.probe import Settings
from gpuscale.runs.settings import SettingsError, check_field, parse_assignments, resolve_settings


def test_layers_later_wins(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('batch_size = 4\nsteps = 7\nprecision = "bf16"\n')
    env = {"GPUSCALE_BATCH_SIZE": "16", "PROBE_STEPS": "9"}
    s = resolve_settings(Settings, preset=preset, overrides={"steps": "11"}, environ=env)
    assert (s.batch_size, s.steps, s.precision) == (16, 11, "bf16")
    s = resolve_settings(Settings, preset=preset, environ={})
    assert (s.batch_size, s.steps) == (4, 7)
    assert resolve_settings(Settings, environ={}).batch_size == Settings.model_fields["batch_size"].default


def test_gpus_forms():
    assert resolve_settings(Settings, overrides={"gpus": "0,3"}, environ={}).gpus == [0, 3]
    assert resolve_settings(Settings, overrides={"gpus": "2"}, environ={}).gpus == 2
    assert resolve_settings(Settings, overrides={"gpus": "3,"}, environ={}).gpus == [3]  # GPU 3 alone
    assert resolve_settings(Settings, environ={}).gpus == "all"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"batch_size": "0"}, "batch_size: '0': Input should be greater than or equal to 1"),
        ({"nope": "1"}, "nope: unknown setting"),
        ({"precision": "fp8"}, "precision: 'fp8':"),
        ({"gpus": "0,0"}, "gpus: '0,0': a GPU index is listed twice"),
        ({"gpus": "x"}, "gpus: 'x': expected 'all', a count"),
        ({"gpus": "0"}, "gpus: '0': at least 1 GPU (or CPU rank) is needed; GPU 0 alone is written '0,'"),
        ({"rdzv_endpoint": "nohostport"}, "rdzv_endpoint: 'nohostport': expected HOST:PORT"),
    ],
)
def test_bad_values_name_field_value_reason(overrides, expected):
    with pytest.raises(SettingsError) as info:
        resolve_settings(Settings, overrides=overrides, environ={})
    assert str(info.value).startswith(expected)


def test_malformed_preset_names_file(tmp_path):
    preset = tmp_path / "bad.toml"
    preset.write_text("batch_size = = 3\n")
    with pytest.raises(SettingsError, match=r"preset: .*bad.toml: not valid TOML"):
        resolve_settings(Settings, preset=preset, environ={})


def test_assignments_and_inline_check():
    assert parse_assignments(["a=1", "b = x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(SettingsError, match="expected key=value"):
        parse_assignments(["novalue"])
    assert check_field(Settings, "batch_size", "0") == "Input should be greater than or equal to 1"
    assert check_field(Settings, "batch_size", "12") is None


def test_every_recipe_says_what_its_batch_size_counts():
    """batch_size means different things (rows per engine call, questions per generation call,
    sequences per micro-batch...): each built-in recipe's help says which, per rank, rather than
    RunSettings' generic words."""
    from gpuscale.recipes.shared.registry import BUILTIN, get_recipe
    from gpuscale.runs.settings import RunSettings

    generic = RunSettings.model_fields["batch_size"].description
    for name in BUILTIN:
        description = get_recipe(name).settings_cls.model_fields["batch_size"].description or ""
        assert description != generic and "per rank" in description, (name, description)
