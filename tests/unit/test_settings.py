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


def every_number_setting():
    """(recipe, field) for every setting of every built-in recipe that takes a number and no true/false."""
    from gpuscale.recipes.shared.registry import BUILTIN, get_recipe
    from gpuscale.runs.settings import _admits

    for name in BUILTIN:
        settings_cls = get_recipe(name).settings_cls
        for field, info in settings_cls.model_fields.items():
            if _admits(info.annotation, (int, float)) and not _admits(info.annotation, (bool,)):
                yield settings_cls, field


@pytest.mark.parametrize("value", [True, False, [True, 1]])
def test_true_or_false_is_refused_where_a_number_is_expected(value):
    """A preset's `batch_size = true` was taken as 1: a TOML bool is not a number for any setting."""
    checked = list(every_number_setting())
    assert {"batch_size", "seed", "gpus", "epochs", "gpu_memory_share"} <= {field for _, field in checked}
    for settings_cls, field in checked:
        with pytest.raises(SettingsError) as info:
            resolve_settings(settings_cls, overrides={field: value}, environ={})
        assert str(info.value) == f"{field}: {value!r}: true/false where a number is expected"


def test_true_or_false_settings_still_take_them():
    assert resolve_settings(Settings, overrides={"compile": True}, environ={}).compile is True
    assert resolve_settings(Settings, overrides={"compile": "false"}, environ={}).compile is False
    assert resolve_settings(Settings, overrides={"batch_size": 3.0}, environ={}).batch_size == 3


@pytest.mark.parametrize("seed, reason", [
    ("12345678901234567890123", "Input should be less than or equal to 4294967295"),
    (2**32, "Input should be less than or equal to 4294967295"),
    (-1, "Input should be greater than or equal to 0"),
])
def test_a_seed_numpy_would_refuse_is_refused_before_launch(seed, reason):
    """transformers' set_seed seeds numpy with the run's seed, which takes 0 to 2**32 - 1."""
    import numpy

    with pytest.raises(ValueError):
        numpy.random.seed(int(seed))
    with pytest.raises(SettingsError) as info:
        resolve_settings(Settings, overrides={"seed": seed}, environ={})
    assert str(info.value) == f"seed: {seed!r}: {reason}"
    assert resolve_settings(Settings, overrides={"seed": str(2**32 - 1)}, environ={}).seed == 2**32 - 1


def test_a_preset_serves_several_recipes_through_their_tables(tmp_path):
    from gpuscale.recipes.sft import Settings as SftSettings
    from gpuscale.runs.settings import read_preset

    preset = tmp_path / "p.toml"
    preset.write_text('gpus = 2\nseed = 5\n[probe]\nsteps = 7\nseed = 6\n[sft]\nepochs = 1.5\n')
    recipes = ("probe", "sft", "rft")
    probe = resolve_settings(Settings, preset=read_preset(preset, "probe", recipes), environ={})
    assert (probe.gpus, probe.steps, probe.seed) == (2, 7, 6)  # the recipe's table over the top level
    sft = resolve_settings(SftSettings, preset=read_preset(preset, "sft", recipes), environ={})
    assert (sft.gpus, sft.epochs, sft.seed) == (2, 1.5, 5)  # probe's table is probe's alone
    assert read_preset(preset, "rft", recipes) == {"gpus": 2, "seed": 5}


def test_a_preset_table_that_names_no_recipe_is_refused(tmp_path):
    from gpuscale.runs.settings import read_preset

    preset = tmp_path / "p.toml"
    preset.write_text('[sfft]\nepochs = 2\n')
    with pytest.raises(SettingsError) as info:
        read_preset(preset, "sft", ("probe", "sft"))
    assert str(info.value).startswith(f"preset: {preset}: [sfft]: a table holds one recipe's settings and no "
                                      "recipe is called 'sfft' (recipes: probe, sft)")


def test_a_recipe_s_own_setting_at_the_top_of_a_preset_says_where_it_goes(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('epochs = 2\n')
    with pytest.raises(SettingsError) as info:
        resolve_settings(Settings, preset=preset, environ={})
    assert str(info.value).startswith("preset: epochs: unknown setting")
    assert str(info.value).endswith("(a setting of one recipe goes in its [RECIPE] table, e.g. [sft])")
